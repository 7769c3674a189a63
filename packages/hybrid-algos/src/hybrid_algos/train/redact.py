"""Credentials never reach the run folder: one place that takes them out of what is written there.

OpenRLHF passes the W&B API key itself as ``--use_wandb KEY``, so the config holds it, and the config is written into
every checkpoint (``driver_state.json``), the summary, W&B's own config and metadata (which records the command
line). Whatever a run writes goes through :func:`redact` (data) or :func:`redact_text` (a string): the secrets of the
config -- ``use_wandb`` unless it is only a switch, fields named like a key, token or password, passwords in URLs --
become :data:`REDACTED`, and every other occurrence of those values in any string too.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

REDACTED = "<redacted>"

#: ``--use_wandb`` values that only switch W&B on (its key then comes from ``wandb login`` / WANDB_API_KEY).
SWITCH_VALUES = {"true", "1", "yes", "on", "false", "0", "no", "off", ""}
#: Setting names whose values are credentials (``use_wandb`` is handled apart: it may be only a switch).
_SECRET_NAME = re.compile(
    r"(^|_)(api_?key|secret|password|passwd|access_token|auth_token|hf_token|wandb_key|"
    r"credentials?)($|_)",
    re.IGNORECASE,
)
_URL_PASSWORD = re.compile(r"(\b[a-z][a-z0-9+.-]*://[^/\s:@]+:)([^/\s@]+)(@)", re.IGNORECASE)
_URL_QUERY_SECRET = re.compile(r"([?&](?:api_?key|key|token|access_token|secret|password)=)([^&\s#]+)", re.IGNORECASE)
#: The values seen so far (a process writes several files of one run): also taken out of free text.
_known: set[str] = set()


def secret_name(name: str) -> bool:
    return bool(_SECRET_NAME.search(name))


def is_wandb_key(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() not in SWITCH_VALUES


def secrets_of(config: Any) -> list[str]:
    """The credential values of a config (an object with attributes, or a dict); remembered for :func:`redact_text`."""
    values = config if isinstance(config, dict) else getattr(config, "__dict__", {})
    found = []
    for name, value in values.items():
        if not isinstance(value, str) or not value:
            continue
        if (name == "use_wandb" and is_wandb_key(value)) or secret_name(name):
            found.append(value)
        for pattern in (_URL_PASSWORD, _URL_QUERY_SECRET):
            found += [m.group(2) for m in pattern.finditer(value)]
    remember(found)
    return found


def remember(values: Iterable[str]) -> None:
    _known.update(v for v in values if isinstance(v, str) and len(v) >= 4)  # never a short common string


def redact_text(text: str, secrets: Iterable[str] = ()) -> str:
    text = _URL_PASSWORD.sub(lambda m: m.group(1) + REDACTED + m.group(3), text)
    text = _URL_QUERY_SECRET.sub(lambda m: m.group(1) + REDACTED, text)
    for value in sorted(_known.union(secrets), key=len, reverse=True):
        if value in text:
            text = text.replace(value, REDACTED)
    return text


def redact(value: Any, secrets: Iterable[str] = ()) -> Any:
    """A copy of ``value`` (plain data: dicts, lists, strings, numbers) with every credential replaced."""
    secrets = list(secrets)
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if (k == "use_wandb" and is_wandb_key(v)) or (
                isinstance(k, str) and secret_name(k) and isinstance(v, str) and v
            ):
                out[k] = REDACTED
            else:
                out[k] = redact(v, secrets)
        return out
    if isinstance(value, (list, tuple)):
        return [redact(v, secrets) for v in value]
    if isinstance(value, str):
        return redact_text(value, secrets)
    return value


def redact_argv(argv: Iterable[str]) -> list[str]:
    """A command line with the values of credential flags (``--use_wandb KEY``, ``--x_api_key=K``) replaced."""
    argv = list(argv)
    out = []
    for i, word in enumerate(argv):
        flag = argv[i - 1] if i > 0 else ""
        if word.startswith("--") and "=" in word:
            name, _, value = word.partition("=")
            if _secret_flag(name[2:], value):
                out.append(f"{name}={REDACTED}")
                continue
        if flag.startswith("--") and "=" not in flag and not word.startswith("--") and _secret_flag(flag[2:], word):
            out.append(REDACTED)
            continue
        out.append(redact_text(word))
    return out


def hide_in_argv(argv: list[str]) -> None:
    """Take credentials out of ``argv`` in place (``sys.argv``: libraries such as W&B record it in the run folder)."""
    remember(w.partition("=")[2] if "=" in w else w for w, r in zip(argv, redact_argv(argv)) if w != r)
    argv[:] = redact_argv(argv)


def _secret_flag(name: str, value: str) -> bool:
    name = name.replace("-", "_").split(".")[-1]
    return (name == "use_wandb" and is_wandb_key(value)) or secret_name(name)
