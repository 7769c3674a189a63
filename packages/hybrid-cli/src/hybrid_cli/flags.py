"""Command-line flags: one per config field, named as in OpenRLHF, typed from the dataclass.

* Every :class:`~hybrid_algos.train.config.RLConfig` field ``x`` is a flag ``--x``; switches (bool fields) are
  ``--x`` / ``--no_x``; pairs take two numbers (``--eps_clip_low_high 0.2 0.28``); mappings take ``KEY=VALUE`` words
  (``--placement actor=0-7 rollout=4-7``) or one JSON object.
* Every flag of OpenRLHF's ``train_ppo_ray`` is accepted in both spellings (``--vllm.num_engines`` and
  ``--vllm_num_engines``) from one table (:mod:`hybrid_cli.openrlhf_flags`): a flag that means one of our settings is
  another name of it; the others are parsed with OpenRLHF's own arity into ``openrlhf:<name>`` and translated (or
  refused, naming what to use instead) after parsing.
* A flag nobody knows is an error naming it and the closest flag. Nothing is silently ignored, and abbreviations are
  off (``--pre`` is not ``--pretrain``).
* Only the flags actually given end up in the result, so ``defaults <- --config FILE <- flags`` is a dict merge.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import inspect
import json
import math
import re
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from hybrid_core.errors import ConfigError

from . import openrlhf_flags as orl
from .flag_help import HELP

#: Flags of the training commands that are not config fields.
CLI_ONLY = ("config", "dry_run")


@dataclass(frozen=True)
class FlagSpec:
    """What the parser needs to know about one config field."""

    name: str
    kind: str  # bool | int | float | str | pair | mapping
    optional: bool  # None is a valid value
    default: Any
    help: str
    section: str


# ---- the schema, read from the dataclass --------------------------------------------------------------------------
@functools.cache
def field_specs(cls: type) -> dict[str, FlagSpec]:
    """One :class:`FlagSpec` per dataclass field of ``cls`` (type hints resolved, help from the source comments)."""
    hints = typing.get_type_hints(cls)
    notes, sections = _source_notes(cls)
    specs = {}
    for f in dataclasses.fields(cls):
        kind, optional = _kind(hints[f.name])
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:  # the config dataclasses give every field a default: a flag without one has no value to show
            raise TypeError(f"{cls.__name__}.{f.name}: a field without a default cannot be a flag")
        specs[f.name] = FlagSpec(
            f.name, kind, optional, default, HELP.get(f.name) or notes.get(f.name, ""), sections.get(f.name, "other")
        )
    return specs


def _kind(hint: Any) -> tuple[str, bool]:
    args = typing.get_args(hint)
    optional = type(None) in args
    if optional:
        (hint,) = [a for a in args if a is not type(None)]
    origin = typing.get_origin(hint) or hint
    if origin is tuple:
        return "pair", optional
    if origin is dict:
        return "mapping", optional
    if hint in (bool, int, float, str):
        return hint.__name__, optional
    raise TypeError(f"no flag kind for type {hint!r}")


def _source_notes(cls: type) -> tuple[dict[str, str], dict[str, str]]:
    """``# comment`` after each field and the ``# ---- section ----`` it sits under, from every class in the MRO."""
    notes: dict[str, str] = {}
    sections: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            lines = inspect.getsource(klass).splitlines()
        except (OSError, TypeError):
            continue
        section = None
        for line in lines:
            head = re.match(r"\s*# -{3,} (.+?) -{3,}", line)
            if head:
                section = head.group(1).strip()
                continue
            m = re.match(r"\s{4}(\w+):[^=]+=[^#]*(?:#\s*(.*))?$", line)
            if m:
                if m.group(2):
                    notes[m.group(1)] = m.group(2).strip()
                if section and m.group(1) not in sections:
                    sections[m.group(1)] = section
    return notes, sections


# ---- converting values (flags and YAML) ---------------------------------------------------------------------------
def convert(spec: FlagSpec, value: Any, *, source: str = "flag") -> Any:
    """Turn a flag string or a YAML value into the field's type; a ConfigError names the field otherwise."""
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null") and spec.optional):
        if spec.optional:
            return None
        raise ConfigError(spec.name, f"cannot be empty ({source}).", f"Give a {spec.kind} value.")
    try:
        if spec.kind == "bool":
            return _to_bool(value)
        if spec.kind == "int":
            return _to_int(value)
        if spec.kind == "float":
            if isinstance(value, bool) or not math.isfinite(float(value)):
                raise ValueError  # NaN passes every `<` check downstream: refuse it here
            return float(value)
        if spec.kind == "str":
            if isinstance(value, bool) and spec.name in OFF_SWITCHES:  # a file written when it was a switch
                return spec.default if value else OFF_SWITCHES[spec.name]
            if isinstance(value, (dict, list, bool)):
                raise ValueError
            return str(value)
        if spec.kind == "pair":
            if isinstance(value, str):
                value = value.replace(",", " ").split()
            low, high = (float(v) for v in value)
            if not (math.isfinite(low) and math.isfinite(high)):
                raise ValueError
            return (low, high)
        if spec.kind == "mapping":
            return parse_mapping(value)
    except (ValueError, TypeError):
        pass
    example = {
        "bool": "true/false",
        "int": "an integer",
        "float": "a finite number",
        "str": "text",
        "pair": "two numbers, e.g. 0.2 0.28",
        "mapping": "KEY=VALUE words or a JSON object",
    }[spec.kind]
    raise ConfigError(spec.name, f"invalid value {value!r} ({source}).", f"Give {example}.")


def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "yes", "1", "on", "false", "no", "0", "off"):
        return value.lower() in ("true", "yes", "1", "on")
    raise ValueError


def _to_int(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError
        return int(value)
    return int(value)


def parse_mapping(value: Any) -> dict[str, Any]:
    if isinstance(value, dict):
        return dict(value)
    words = [value] if isinstance(value, str) else list(value)
    if len(words) == 1 and words[0].strip().startswith("{"):
        parsed = json.loads(words[0])
        if not isinstance(parsed, dict):
            raise ValueError
        return parsed
    out = {}
    for word in words:
        key, sep, raw = str(word).partition("=")
        if not sep or not key:
            raise ValueError
        out[key] = yaml.safe_load(raw) if raw else ""
    return out


# ---- the parser ---------------------------------------------------------------------------------------------------
class FlagParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are ConfigErrors naming the flag (so callers and tests can see which)."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> typing.NoReturn:  # argparse calls this for every parse error
        m = re.search(r"argument (?:--)?([\w.-]+)(?:/[^:]*)?:", message)
        field = m.group(1).replace("-", "_") if m else self.prog
        raise ConfigError(field, message.rstrip(".") + ".", f"See `{self.prog} --help`.")


#: Where the OpenRLHF flags that are not one of our settings land in the namespace (``openrlhf:<name>``).
OPENRLHF_DEST = "openrlhf:"


def _arity(spec: FlagSpec) -> Any:
    return {"bool": 0, "pair": 2, "mapping": "+"}.get(spec.kind, 1)


#: Short names of our own settings (not OpenRLHF's): the token budget of dynamic batches, as verl and papers say it.
SHORT_NAMES = {"max_tokens_per_gpu": "train_max_tokens_per_gpu"}

#: Settings that were switches and now take a mode: ``--no_x`` (and ``x: false`` in a file) still means this value.
OFF_SWITCHES = {"verify_weight_sync": "off"}


@functools.cache
def aliases(cls: type) -> dict[str, str]:
    """OpenRLHF names (either spelling) that are plainly one of our fields, taking the same kind of value, and our
    own short names."""
    specs = field_specs(cls)
    out = {k: v for k, v in SHORT_NAMES.items() if v in specs}
    for name, flag in orl.openrlhf_flags().items():
        if name in specs:
            continue
        rule = orl.rule_for(name)
        if (
            rule.kind == "same"
            and rule.field in specs
            and flag.action != "store_false"
            and flag.arity == _arity(specs[rule.field])
        ):
            out[name] = rule.field
    return out


def add_config_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per field of ``cls`` (grouped by the config's sections); only given flags reach the namespace.

    Then every OpenRLHF flag: as another name of the field it means, or (hidden from ``--help``) parsed with
    OpenRLHF's arity into ``openrlhf:<name>`` for :func:`given_openrlhf` / :func:`hybrid_cli.openrlhf_flags.translate`.
    """
    groups: dict[str, Any] = {}
    aliases_of: dict[str, list[str]] = {}
    for alias, target in aliases(cls).items():
        aliases_of.setdefault(target, []).append(alias)
    for spec in field_specs(cls).values():
        group = groups.get(spec.section)
        if group is None:
            group = groups[spec.section] = parser.add_argument_group(spec.section)
        names = [f"--{spec.name}", *(f"--{a}" for a in aliases_of.get(spec.name, ()))]
        shown = (
            "" if (spec.kind == "bool" and not spec.default) or spec.default is None else f" (default: {spec.default})"
        )
        common: dict[str, Any] = dict(dest=spec.name, default=argparse.SUPPRESS, help=(spec.help + shown).strip())
        if spec.kind == "bool" and spec.name in orl.openrlhf_flags() and orl.openrlhf_flags()[spec.name].arity == 1:
            # OpenRLHF spells a setting of its own like this switch (--use_tensorboard DIR): a value that is not
            # true/false is OpenRLHF's, translated after parsing (see given_openrlhf).
            group.add_argument(*names, nargs="?", const=True, metavar="true/false", **common)
            group.add_argument(
                f"--no_{spec.name}",
                action="store_false",
                dest=spec.name,
                default=argparse.SUPPRESS,
                help=f"turn --{spec.name} off" if spec.default else argparse.SUPPRESS,
            )
        elif spec.kind == "bool":
            group.add_argument(*names, action="store_true", **common)
            # --no_x is listed where x defaults to on; it exists for every switch (to undo a --config file).
            group.add_argument(
                f"--no_{spec.name}",
                action="store_false",
                dest=spec.name,
                default=argparse.SUPPRESS,
                help=f"turn --{spec.name} off" if spec.default else argparse.SUPPRESS,
            )
        elif spec.kind == "pair":
            group.add_argument(*names, nargs=2, metavar=("LOW", "HIGH"), type=_arg_type(spec, "float"), **common)
        elif spec.kind == "mapping":
            group.add_argument(*names, nargs="+", metavar="KEY=VALUE", **common)
        else:
            group.add_argument(*names, type=_arg_type(spec, spec.kind), metavar=spec.kind.upper(), **common)
            if spec.name in OFF_SWITCHES:
                group.add_argument(
                    f"--no_{spec.name}",
                    action="store_const",
                    const=OFF_SWITCHES[spec.name],
                    dest=spec.name,
                    default=argparse.SUPPRESS,
                    help=f"the same as --{spec.name} {OFF_SWITCHES[spec.name]}",
                )
    taken = {s for action in parser._actions for s in action.option_strings}
    for name, flag in orl.openrlhf_flags().items():
        if f"--{name}" in taken:
            continue
        hidden: dict[str, Any] = dict(dest=OPENRLHF_DEST + name, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        if flag.is_switch:
            parser.add_argument(f"--{name}", action="store_const", const=True, **hidden)
        elif flag.arity == 1:
            parser.add_argument(f"--{name}", **hidden)
        else:
            parser.add_argument(f"--{name}", nargs=flag.arity, **hidden)


def _arg_type(spec: FlagSpec, kind: str):
    one = FlagSpec(spec.name, kind, spec.optional, spec.default, "", "")

    def parse(text: str) -> Any:
        try:
            return convert(one, text)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(e.problem) from None

    parse.__name__ = kind
    return parse


def given_config_values(namespace: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The config fields given on the command line, converted to their types."""
    specs = field_specs(cls)
    out = {}
    for name, value in vars(namespace).items():
        spec = specs.get(name)
        if spec is None:
            continue
        if spec.kind == "bool" and isinstance(value, str):
            try:
                value = _to_bool(value)
            except ValueError:
                continue  # OpenRLHF's spelling of another setting: see given_openrlhf
        out[name] = convert(spec, value) if spec.kind in ("pair", "mapping") else value
    return out


def given_openrlhf(namespace: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The OpenRLHF flags given that are not plainly one of our settings: name -> raw value (text, words, True)."""
    out = {
        name[len(OPENRLHF_DEST) :]: value for name, value in vars(namespace).items() if name.startswith(OPENRLHF_DEST)
    }
    specs = field_specs(cls)
    for name, value in vars(namespace).items():  # a switch of ours given a value OpenRLHF's way (see add_config_flags)
        if name in specs and specs[name].kind == "bool" and isinstance(value, str):
            try:
                _to_bool(value)
            except ValueError:
                out[name] = value
    return out


def translate_openrlhf(
    given: Mapping[str, Any], fields: Mapping[str, Any], cls: type
) -> tuple[dict[str, Any], list[str]]:
    """``fields`` with the settings (and notes) of the OpenRLHF flags in ``given`` that are not plainly one of our
    settings: ``fields`` (ours) win, except where OpenRLHF's meaning overrides them (see orl.translate)."""
    if not given:
        return dict(fields), []
    values, notes, overrides = orl.translate(given, fields, field_specs(cls), lambda spec, raw: convert(spec, raw))
    return {**values, **fields, **overrides}, notes


# ---- unknown flags ------------------------------------------------------------------------------------------------
def check_leftovers(leftovers: Sequence[str], parser: argparse.ArgumentParser, known_switches: set[str]) -> None:
    """Raise a ConfigError for the first thing the parser did not take, naming it and what to do instead."""
    known = sorted(
        s for action in parser._actions for s in action.option_strings if s.startswith("--") and _suggestable(s[2:])
    )
    for word in leftovers:
        if word.startswith("--"):
            flag = word.split("=", 1)[0]
            raise unknown_flag_error(flag[2:], known)
        if word.startswith("-") and len(word) > 1 and not _is_number(word):
            raise ConfigError(word.lstrip("-"), f"unknown option {word}.", "Flags are spelled --name (two dashes).")
    if leftovers:
        raise ConfigError(
            "arguments",
            f"unexpected value(s) {' '.join(leftovers)}.",
            "Each flag takes its own values; switches (e.g. "
            + ", ".join(sorted(known_switches)[:3])
            + ") take none. Check the word before each of these.",
        )


def unknown_flag_error(name: str, known: Sequence[str], *, what: str = "flag", where: str = "") -> ConfigError:
    """The error for an unknown flag (or config-file key), with the closest known name.

    A suggestion never turns the request around: ``--train.colocate_al`` may become ``--train.colocate_all``, but
    never ``--no_colocate_all_models`` (only a name that itself starts with ``no_`` is matched against the
    ``--no_x`` switches)."""
    field = name.replace("-", "_") if "." not in name else name
    dash = "--" if what == "flag" else ""
    plain = [k.lstrip("-") for k in known]
    if not field.startswith("no_"):
        plain = [k for k in plain if not k.startswith("no_") and ".no_" not in k]
    close = difflib.get_close_matches(field, plain, n=1, cutoff=0.6)
    if not close and "." in field:  # a dotted name from another OpenRLHF release: match its last part
        tail = field.rsplit(".", 1)[1]
        close = difflib.get_close_matches(tail, [k for k in plain if "." not in k], n=1, cutoff=0.75)
    fix = f"Did you mean {dash}{close[0]}?" if close else "`hybrid ppo --help` lists the valid names."
    release = orl.openrlhf_release()
    extra = f" (not a flag of OpenRLHF {release}'s train_ppo_ray either)" if "." in field and what == "flag" else ""
    return ConfigError(field, f"unknown {what} {dash}{field}{where}{extra}.", fix)


def _suggestable(name: str) -> bool:
    """A name worth suggesting: ours, or an OpenRLHF name that is not refused outright."""
    flags = orl.openrlhf_flags()
    return name not in flags or orl.rule_for(name).kind != "refuse"


def _is_number(word: str) -> bool:
    try:
        float(word)
        return True
    except ValueError:
        return False


def known_names(cls: type) -> list[str]:
    """Every flag name a config file or command line may use (fields, OpenRLHF names, CLI-only flags)."""
    return sorted({*field_specs(cls), *orl.openrlhf_flags(), *CLI_ONLY})


def resolve_alias(name: str, cls: type | None = None) -> str:
    """Our field for an OpenRLHF name that plainly means it (else the name itself)."""
    if cls is None:
        from hybrid_algos.train.config import RLConfig

        cls = RLConfig
    return aliases(cls).get(name, name)


def merge_layers(*layers: Mapping[str, Any]) -> dict[str, Any]:
    """Later layers win (defaults <- file <- flags)."""
    out: dict[str, Any] = {}
    for layer in layers:
        out.update(layer)
    return out
