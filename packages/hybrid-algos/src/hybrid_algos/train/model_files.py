"""Model folders read before Ray starts: a damaged ``config.json``, missing tokenizer files or a model that ships
its own code are reported naming the folder, the file and the fix -- not as a traceback from inside transformers.

``--trust_remote_code`` (off by default) is the one switch for code a model folder ships (``auto_map`` in its
``config.json`` or ``tokenizer_config.json``): every transformers ``from_pretrained`` of the run (actor, critic,
reference, reward model, tokenizer, the engines) gets it, and without it such a folder is refused here.
"""

from __future__ import annotations

import json
import os
from typing import Any

from hybrid_core.errors import ConfigError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "tiktoken.model")


def read_json(field: str, path: str, *, required: bool = True) -> dict[str, Any] | None:
    """A JSON file of a model folder; a ConfigError names ``field``, the file and where it is broken."""
    if not os.path.exists(path):
        if required:
            raise ConfigError(field, f"{os.path.dirname(path)} has no {os.path.basename(path)}.",
                              "Give a Hugging Face model folder (config.json, weights and tokenizer files).")
        return None
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except UnicodeDecodeError:
        raise ConfigError(field, f"{path} is not UTF-8 text.", "Restore the file from the model's source.") from None
    except json.JSONDecodeError as e:
        raise ConfigError(field, f"{path} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}).",
                          "Restore the file from the model's source (it may be truncated or edited by hand).") from None
    except OSError as e:
        raise ConfigError(field, f"{path} cannot be read ({e.strerror}).", "Check the file's permissions.") from None
    if not isinstance(value, dict):
        raise ConfigError(field, f"{path} holds a JSON {type(value).__name__}, not an object.",
                          "Restore the file from the model's source.")
    return value


def check_model_folder(field: str, path: str, *, trust_remote_code: bool) -> None:
    """``config.json`` reads, transformers knows the architecture, and shipped code is only run when allowed."""
    config = read_json(field, os.path.join(path, "config.json"))
    tokenizer_config = read_json(field, os.path.join(path, "tokenizer_config.json"), required=False) or {}
    shipped = [f"{name}: auto_map" for name, cfg in (("config.json", config), ("tokenizer_config.json", tokenizer_config))
               if cfg.get("auto_map")]
    if shipped and not trust_remote_code:
        raise ConfigError("trust_remote_code", f"{path} ships its own Python code ({', '.join(shipped)}), which "
                          "runs only with --trust_remote_code.", "Read that code, then add --trust_remote_code; or "
                          "use a model whose architecture transformers has built in.")
    model_type = config.get("model_type")
    if not shipped:
        from transformers import CONFIG_MAPPING, __version__

        if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
            raise ConfigError(field, f"{path}/config.json has model_type {model_type!r}, which transformers "
                              f"{__version__} does not know.", "Upgrade transformers, or check the model folder.")


def load_tokenizer(field: str, path: str, *, trust_remote_code: bool) -> Any:
    """The folder's tokenizer; a folder without tokenizer files, or one transformers cannot read, is a ConfigError."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers raises OSError, ValueError, TypeError, KeyError... for unreadable folders
        present = [f for f in TOKENIZER_FILES if os.path.exists(os.path.join(path, f))]
        problem = (f"{path} has no tokenizer files (none of {', '.join(TOKENIZER_FILES[:4])}, ...)." if not present
                   else f"the tokenizer in {path} cannot be loaded: {type(e).__name__}: {_first_line(e)}")
        raise ConfigError(field, problem, "Copy the tokenizer files of the model (tokenizer.json, "
                          "tokenizer_config.json, special_tokens_map.json) into the folder.") from None


def _first_line(e: BaseException) -> str:
    lines = [line for line in str(e).splitlines() if line.strip()]
    return lines[0][:300] if lines else ""
