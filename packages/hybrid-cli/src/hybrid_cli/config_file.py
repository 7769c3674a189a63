"""``--config FILE.yaml``: the same names as the flags, one mapping; flags given on the command line win.

::

    # ppo.yaml
    pretrain: /models/llama-3-8b-sft
    actor_num_gpus_per_node: 8
    vllm_num_engines: 8
    eps_clip_low_high: [0.2, 0.28]
    placement: {actor: "0-7", rollout: "0-7"}

OpenRLHF's flag names work as keys too, in either spelling (``vllm.num_engines: 4`` or ``vllm_num_engines: 4``),
with the same meaning as on the command line (:mod:`hybrid_cli.openrlhf_flags`). Unknown keys are errors that name
the key and the closest valid name; values are checked against the field's type (YAML 1.1 reads ``5e-7`` as text,
so numbers written that way are converted, not rejected).
"""

from __future__ import annotations

import os
from typing import Any

import yaml

from hybrid_core.errors import ConfigError

from .flags import CLI_ONLY, convert, field_specs, known_names, resolve_alias, unknown_flag_error
from .openrlhf_flags import openrlhf_flags


def load_config_file(path: str, cls: type) -> tuple[dict[str, Any], dict[str, Any]]:
    """The config fields set in ``path`` (a YAML mapping), converted to their types, and the OpenRLHF keys that are
    not plainly one of them (name -> raw value, for :func:`hybrid_cli.flags.translate_openrlhf`)."""
    if not os.path.isfile(path):
        raise ConfigError("config", f"no file at {path!r}.", "Give the path of a YAML file.")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise ConfigError("config", f"{path!r} is not valid YAML: {e}.") from None
    if data is None:  # an empty file sets nothing
        return {}, {}
    if not isinstance(data, dict):
        raise ConfigError(
            "config",
            f"{path!r} must hold a mapping of flag names to values, not a {type(data).__name__}.",
            "Write one `name: value` per line.",
        )
    specs = field_specs(cls)
    out: dict[str, Any] = {}
    openrlhf: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = resolve_alias(str(raw_key).replace("-", "_"), cls)
        if key in CLI_ONLY:
            raise ConfigError(
                key,
                f"{key!r} in {path!r} is a command-line option, not a setting.",
                f"Pass --{key} on the command line.",
            )
        spec = specs.get(key)
        if spec is None and key in openrlhf_flags():
            openrlhf[key] = value
            continue
        if spec is None:
            raise unknown_flag_error(
                key, [n for n in known_names(cls) if n not in CLI_ONLY], what="key", where=f" in {path!r}"
            )
        out[key] = convert(spec, value, source=f"in {path!r}")
    return out, openrlhf
