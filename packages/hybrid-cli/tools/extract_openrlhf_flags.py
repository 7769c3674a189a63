"""Build ``hybrid_cli/data/openrlhf_flags.json`` (every flag of OpenRLHF's ``train_ppo_ray`` parser) and
``hybrid_cli/data/openrlhf_defaults_<release>.json`` (each flag's default in the two releases an OpenRLHF command line
is read as), from the released wheels themselves and from the main branch's parser.

The flags file is the one source of what OpenRLHF accepts; ``hybrid_cli.openrlhf_flags`` maps each flag in it to a
hybrid setting or refuses it. The defaults files are what an OpenRLHF command line gets for the flags it leaves out
(``hybrid_cli.openrlhf``): the dotted release's (:data:`DOTTED_RELEASE`) for a dotted line, the last flat release's
(:data:`FLAT_DEFAULTS_RELEASE`) for a flat one. Regenerate them when OpenRLHF releases a new parser::

    for v in 0.3.8 0.4.6 0.5.9.post1 0.6.4 0.7.5 0.8.11 0.9.10 0.10.1 0.10.1.post2 0.11.2; do
        pip download "openrlhf==$v" --no-deps -d /tmp/openrlhf-wheels
    done
    git clone https://github.com/OpenRLHF/OpenRLHF /tmp/OpenRLHF
    git -C /tmp/OpenRLHF show main:openrlhf/cli/train_ppo_ray.py > /tmp/train_ppo_ray_main.py
    python packages/hybrid-cli/tools/extract_openrlhf_flags.py /tmp/openrlhf-wheels /tmp/train_ppo_ray_main.py \
        "$(git -C /tmp/OpenRLHF rev-parse main)"

How a parser is read: the statements of ``openrlhf/cli/train_ppo_ray.py``'s ``__main__`` block that come before
``parse_args()`` only build an ``argparse.ArgumentParser``; they are run with ``argparse`` and nothing of OpenRLHF
imported, and each flag is then read back from argparse's own actions (name, action, type, nargs, choices,
default). Nothing of OpenRLHF's text (help strings) is kept, and no code: the defaults are argparse's values (what
``train_ppo_ray`` computes from them after ``parse_args()`` is not a default and is not recorded).

Two spellings: since 0.10.2 the flags are dotted (``--vllm.num_engines``); before, flat (``--vllm_num_engines``).
The newest release (:data:`DOTTED_RELEASE`) gives the dotted list; every older release gives flat names. A dotted
flag's flat name is found by the mechanical rules of OpenRLHF's rename (``a.b`` -> ``a_b``, or the last part, or the
last part without ``_enable``), or, where the rename was not mechanical, by :data:`FLAT_NAMES` below -- and every
pairing is checked: the flat flag must exist in a flat release and take the same kind of value. Flat flags that no
dotted flag continues (removed before 0.10.2) have an empty successor list; each flat flag records the first and
last of the releases read that had it.

The main branch: OpenRLHF's README and example scripts on ``main`` use flags its last release does not have (the
correction switch ``--algo.advantage.is_correction_enable`` and ``--algo.advantage.is_correction_type``, which 0.11.2
spells ``--algo.advantage.is_correction_level`` / ``_mode``). The main branch's parser is read the same way, and its
flags that the release lacks are recorded as ``main_flags`` (with the commit read), paired with their flat names.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import glob
import json
import math
import os
import re
import sys
import tempfile
import zipfile

DOTTED_RELEASE = "0.11.2"
#: The older releases read for flat names: the last flat one and one per minor version back to 0.3.
FLAT_RELEASES = ("0.3.8", "0.4.6", "0.5.9.post1", "0.6.4", "0.7.5", "0.8.11", "0.9.10", "0.10.1.post2")
#: The flat release whose defaults a flat command line gets: 0.10.1, the last release before the dotted rename (its
#: .post1/.post2 fixed bugs elsewhere; their parser is the same, which :func:`main` checks).
FLAT_DEFAULTS_RELEASE = "0.10.1"

#: dotted name -> its flat name(s), where OpenRLHF's rename was not mechanical (one flat flag may have become
#: several dotted ones: ``--l2`` set the weight decay of both actor and critic).
FLAT_NAMES = {
    "train.colocate_all": ("colocate_all_models",),
    "algo.advantage.is_correction_level": ("enable_vllm_is_correction",),
    "algo.advantage.is_correction_mode": ("vllm_is_correction_type",),
    "algo.advantage.is_correction_threshold": ("vllm_is_truncated_threshold",),
    "train.async_enable": ("async_train",),
    "train.partial_rollout_enable": ("partial_rollout",),
    "eval.steps": ("eval_steps",),
    "ckpt.path": ("ckpt_path",),
    "ckpt.save_hf": ("save_hf_ckpt",),
    "ckpt.disable_ds": ("disable_ds_ckpt",),
    "ckpt.max_num": ("max_ckpt_num",),
    "ckpt.max_mem": ("max_ckpt_mem",),
    "ckpt.load_enable": ("load_checkpoint",),
    "ds.use_universal_ckpt": ("use_ds_universal_ckpt",),
    "actor.gradient_checkpointing_enable": ("gradient_checkpointing",),
    "actor.gradient_checkpointing_reentrant": ("gradient_checkpointing_use_reentrant",),
    "ds.enable_sleep": ("deepspeed_enable_sleep",),
    "ds.tensor_parallel_size": ("ds_tensor_parallel_size",),
    "train.dynamic_batch_enable": ("use_dynamic_batch",),
    "ds.lora.rank": ("lora_rank",),
    "ds.lora.alpha": ("lora_alpha",),
    "ds.lora.target_modules": ("target_modules",),
    "ds.lora.dropout": ("lora_dropout",),
    "ckpt.output_dir": ("save_path",),
    "rollout.micro_batch_size": ("micro_rollout_batch_size",),
    "train.micro_batch_size": ("micro_train_batch_size",),
    "reward.normalize_enable": ("normalize_reward",),
    "train.full_determinism_enable": ("full_determinism",),
    "critic.freezing_steps": ("freezing_actor_steps",),
    "algo.kl.target": ("kl_target",),
    "algo.kl.horizon": ("kl_horizon",),
    "algo.kl.init_coef": ("init_kl_coef",),
    "algo.kl.estimator": ("kl_estimator",),
    "algo.kl.use_loss": ("use_kl_loss",),
    "actor.entropy_coef": ("entropy_loss_coef",),
    "reward.clip_range": ("reward_clip_range",),
    "actor.adam.lr": ("actor_learning_rate",),
    "critic.adam.lr": ("critic_learning_rate",),
    "actor.adam.betas": ("adam_betas",),
    "critic.adam.betas": ("adam_betas",),
    "actor.adam.weight_decay": ("l2",),
    "critic.adam.weight_decay": ("l2",),
    "actor.lr_scheduler": ("lr_scheduler",),
    "critic.lr_scheduler": ("lr_scheduler",),
    "actor.lr_warmup_ratio": ("lr_warmup_ratio",),
    "critic.lr_warmup_ratio": ("lr_warmup_ratio",),
    "actor.max_norm": ("max_norm",),
    "critic.max_norm": ("max_norm",),
    "algo.advantage.estimator": ("advantage_estimator",),
    "algo.advantage.no_std_norm": ("no_advantage_std_norm",),
    "actor.model_name_or_path": ("pretrain",),
    "reward.model_name_or_path": ("reward_pretrain",),
    "reward.remote_url": ("remote_rm_url",),
    "critic.model_name_or_path": ("critic_pretrain",),
    "ref.offload": ("ref_reward_offload",),
    "reward.offload": ("ref_reward_offload",),
    "data.prompt_dataset": ("prompt_data",),
    "data.prompt_probs": ("prompt_data_probs",),
    "logger.wandb.key": ("use_wandb",),
    "logger.wandb.org": ("wandb_org",),
    "logger.wandb.group": ("wandb_group",),
    "logger.wandb.project": ("wandb_project",),
    "logger.wandb.run_name": ("wandb_run_name",),
    "algo.dynamic_filtering_enable": ("dynamic_filtering",),
    "algo.dynamic_filtering_range": ("dynamic_filtering_reward_range",),
    "logger.tensorboard_dir": ("use_tensorboard",),
    "ds.ring_attn_head_stride": ("ring_head_stride",),
    "train.agent_func_path": ("agent_func_path",),
    "rollout.vllm_generate_batch_size": ("vllm_generate_batch_size",),
    # the main branch's spelling of the flat era's correction flags (0.11.2: is_correction_level / _mode)
    "algo.advantage.is_correction_enable": ("enable_vllm_is_correction",),
    "algo.advantage.is_correction_type": ("vllm_is_correction_type",),
}
#: Flat switches whose dotted successor takes a value (the switch meant one of its values).
SWITCH_BECAME_VALUE = {("algo.advantage.is_correction_level", "enable_vllm_is_correction")}
#: Dotted flags new since the rename: no flat spelling ever existed.
NEW_SINCE_DOTTED = frozenset(
    {
        "ds.experts_implementation",
        "algo.advantage.is_correction_gating",
        "actor.loss_agg_mode",
        "algo.kl.unbiased_gradient",
        "actor.optim",
        "actor.muon.lr",
        "actor.muon.momentum",
        "actor.muon.ns_steps",
        "actor.muon.nesterov",
        "actor.muon.no_nesterov",
        "actor.adam.eps",
        "actor.min_lr_ratio",
        "critic.optim",
        "critic.muon.lr",
        "critic.muon.momentum",
        "critic.muon.ns_steps",
        "critic.muon.nesterov",
        "critic.muon.no_nesterov",
        "critic.adam.eps",
        "critic.min_lr_ratio",
    }
)
#: Defaults computed when the parser is built (a timestamp); stored as a pattern, not as one run's value.
VOLATILE_DEFAULTS = {"logger.wandb.run_name": "ppo_%m%dT%H:%M", "wandb_run_name": "ppo_%m%dT%H:%M"}

DATA = os.path.join(os.path.dirname(__file__), "..", "src", "hybrid_cli", "data")
OUT = os.path.join(DATA, "openrlhf_flags.json")


def defaults_path(release: str) -> str:
    return os.path.join(DATA, f"openrlhf_defaults_{release}.json")


# ---- reading one parser -------------------------------------------------------------------------------------------
def build_parser(source: str, filename: str) -> argparse.ArgumentParser:
    """Run the parser-building statements of the script's ``__main__`` block (those before ``parse_args()``)."""
    tree = ast.parse(source)
    main = next(node for node in tree.body if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test))
    body = []
    for stmt in main.body:
        if "parse_args" in ast.unparse(stmt):
            break
        body.append(stmt)
    scope = {"argparse": argparse, "datetime": datetime.datetime, "os": os, "math": math}
    exec(compile(ast.Module(body=body, type_ignores=[]), filename, "exec"), scope)  # noqa: S102 - argparse calls
    return scope["parser"]


def read_flags(parser: argparse.ArgumentParser) -> list[dict]:
    """One record per option string, in the parser's order."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        for option in action.option_strings:
            if not option.startswith("--"):
                continue
            out.append(
                {
                    "name": option[2:],
                    "dest": action.dest,
                    "action": _action_kind(action),
                    "type": getattr(action.type, "__name__", None) if action.type else None,
                    "nargs": action.nargs if action.nargs not in (0,) else None,
                    "choices": list(action.choices) if action.choices else None,
                    "default": _jsonable(action.default),
                }
            )
    return out


def _action_kind(action: argparse.Action) -> str:
    if isinstance(action, argparse._StoreTrueAction):
        return "store_true"
    if isinstance(action, argparse._StoreFalseAction):
        return "store_false"
    if isinstance(action, argparse._StoreAction):
        return "store"
    raise TypeError(f"unexpected argparse action {type(action).__name__} for {action.option_strings}")


def _jsonable(value):
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, float) and value.is_integer() and abs(value) >= 1e6:
        return int(value)  # 1e8 written as a float literal: the same count
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


def wheel_parser_source(path: str) -> str:
    with zipfile.ZipFile(path) as wheel:
        (name,) = [n for n in wheel.namelist() if n.endswith("openrlhf/cli/train_ppo_ray.py")]
        return wheel.read(name).decode("utf-8")


def find_wheels(folder: str) -> dict[str, str]:
    wheels = {}
    for path in glob.glob(os.path.join(folder, "openrlhf-*.whl")):
        version = os.path.basename(path).split("-")[1]
        wheels[version] = path
    missing = [v for v in (DOTTED_RELEASE, *FLAT_RELEASES, FLAT_DEFAULTS_RELEASE) if v not in wheels]
    if missing:
        sys.exit(f"missing wheels in {folder}: {', '.join(missing)} (pip download openrlhf==VERSION --no-deps)")
    return wheels


# ---- pairing dotted and flat names -----------------------------------------------------------------------------------
def _same_kind(a: dict, b: dict) -> bool:
    switch = {"store_true", "store_false"}
    if (a["action"] in switch) != (b["action"] in switch):
        return False
    if a["action"] in switch:
        return True
    return a["nargs"] == b["nargs"] or {a["nargs"], b["nargs"]} <= {None, "+", 2}


def flat_candidates(dotted: str) -> list[str]:
    parts = dotted.split(".")
    last = parts[-1]
    return [dotted.replace(".", "_"), last, re.sub(r"_enable$", "", last)]


def pair(dotted_flags: list[dict], flat_by_name: dict[str, dict]) -> dict[str, list[str]]:
    pairs: dict[str, list[str]] = {}
    problems = []
    for flag in dotted_flags:
        name = flag["name"]
        if "." not in name:  # kept its name (--local_rank, --use_ms)
            names = [name] if name in flat_by_name else []
        elif name in FLAT_NAMES:
            names = list(FLAT_NAMES[name])
        elif name in NEW_SINCE_DOTTED:
            names = []
        else:
            names = [c for c in dict.fromkeys(flat_candidates(name)) if c in flat_by_name][:1]
            if not names:
                problems.append(f"{name}: no flat name found; add it to FLAT_NAMES or NEW_SINCE_DOTTED")
        for flat in names:
            if flat not in flat_by_name:
                problems.append(f"{name}: its flat name --{flat} is in no flat release")
            elif not _same_kind(flag, flat_by_name[flat]) and (name, flat) not in SWITCH_BECAME_VALUE:
                problems.append(f"{name}: takes other values than --{flat}")
        pairs[name] = names
    if problems:
        sys.exit("cannot pair dotted and flat names:\n  " + "\n  ".join(problems))
    return pairs


def dumps(data: dict) -> str:
    """JSON with one flag per line (readable diffs when OpenRLHF changes a flag)."""
    lines = ["{"]
    for i, (key, value) in enumerate(data.items()):
        end = "," if i < len(data) - 1 else ""
        if isinstance(value, list) and value and isinstance(value[0], dict):
            rows = [json.dumps(v, separators=(", ", ": ")) for v in value]
            lines.append(f"  {json.dumps(key)}: [\n    " + ",\n    ".join(rows) + f"\n  ]{end}")
        elif isinstance(value, dict) and value:
            rows = [f"{json.dumps(k)}: {json.dumps(v)}" for k, v in value.items()]
            lines.append(f"  {json.dumps(key)}: {{\n    " + ",\n    ".join(rows) + f"\n  }}{end}")
        else:
            lines.append(f"  {json.dumps(key)}: {json.dumps(value)}{end}")
    return "\n".join(lines) + "\n}\n"


def defaults_record(release: str, spelling: str, records: list[dict]) -> dict:
    """One release's defaults: flag name -> argparse's default (a timestamp default as its pattern)."""
    return {
        "about": f"The default of every flag of OpenRLHF {release}'s train_ppo_ray parser (argparse's values, read "
        "from the released wheel; what train_ppo_ray derives from them after parse_args() is not recorded). "
        "Generated by packages/hybrid-cli/tools/extract_openrlhf_flags.py; do not edit by hand.",
        "release": release,
        "spelling": spelling,
        "defaults": {r["name"]: VOLATILE_DEFAULTS.get(r["name"], r["default"]) for r in records},
    }


def main_branch_flags(source: str, commit: str, release: list[dict], flat: dict[str, dict]) -> list[dict]:
    """The main branch's flags that the release does not have, paired with their flat names."""
    if not re.fullmatch(r"[0-9a-f]{40}", commit):
        sys.exit(f"the main branch's commit must be 40 hex digits, got {commit!r}")
    names = {r["name"] for r in release}
    extra = [r for r in read_flags(build_parser(source, "train_ppo_ray.py")) if r["name"] not in names]
    pairs = pair(extra, flat)
    return [{**r, "flat": pairs[r["name"]]} for r in extra]


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        sys.exit(__doc__)
    wheels = find_wheels(argv[0])
    with open(argv[1], encoding="utf-8") as f:
        main_source = f.read()
    with tempfile.TemporaryDirectory():
        dotted = read_flags(build_parser(wheel_parser_source(wheels[DOTTED_RELEASE]), "train_ppo_ray.py"))
        flat: dict[str, dict] = {}
        for version in FLAT_RELEASES:
            for record in read_flags(build_parser(wheel_parser_source(wheels[version]), "train_ppo_ray.py")):
                seen = flat.setdefault(record["name"], {**record, "releases": []})
                if version == FLAT_RELEASES[-1] or not seen["releases"]:
                    seen.update({k: v for k, v in record.items()})
                seen["releases"].append(version)
        last_flat = read_flags(build_parser(wheel_parser_source(wheels[FLAT_DEFAULTS_RELEASE]), "train_ppo_ray.py"))
        if last_flat != read_flags(build_parser(wheel_parser_source(wheels[FLAT_RELEASES[-1]]), "train_ppo_ray.py")):
            sys.exit(
                f"{FLAT_DEFAULTS_RELEASE} and {FLAT_RELEASES[-1]} have different parsers: pick the flat "
                "release whose defaults a flat command line gets (FLAT_DEFAULTS_RELEASE)"
            )
    pairs = pair(dotted, flat)
    main_flags = main_branch_flags(main_source, argv[2], dotted, flat)
    for record in (*dotted, *flat.values(), *main_flags):
        if record["name"] in VOLATILE_DEFAULTS:
            record["default"] = VOLATILE_DEFAULTS[record["name"]]
    data = {
        "about": "Every flag of OpenRLHF's train_ppo_ray parser. Generated by packages/hybrid-cli/tools/"
        "extract_openrlhf_flags.py from the released wheels; do not edit by hand.",
        "release": DOTTED_RELEASE,
        "flat_releases": list(FLAT_RELEASES),
        "flags": [{**record, "flat": pairs[record["name"]]} for record in dotted],
        "flat_flags": [
            {
                **record,
                "releases": [record["releases"][0], record["releases"][-1]],
                "dotted": [d for d, names in pairs.items() if name in names],
            }
            for name, record in sorted(flat.items())
        ],
        "main_commit": argv[2],
        "main_flags": main_flags,
    }
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    outputs = {
        OUT: data,
        defaults_path(DOTTED_RELEASE): defaults_record(DOTTED_RELEASE, "dotted", dotted),
        defaults_path(FLAT_DEFAULTS_RELEASE): defaults_record(FLAT_DEFAULTS_RELEASE, "flat", last_flat),
    }
    for path, content in outputs.items():
        with open(path, "w", encoding="utf-8") as f:
            f.write(dumps(content))
    removed = sum(not r["dotted"] for r in data["flat_flags"])
    print(
        f"{len(data['flags'])} flags of {DOTTED_RELEASE}; {len(data['flat_flags'])} flat flags of "
        f"{FLAT_RELEASES[0]}-{FLAT_RELEASES[-1]}, {removed} of them without a dotted successor; "
        f"{len(main_flags)} of the main branch ({argv[2][:12]}) -> {os.path.relpath(OUT)}; defaults of "
        f"{DOTTED_RELEASE} and {FLAT_DEFAULTS_RELEASE} -> {os.path.relpath(defaults_path(DOTTED_RELEASE))}, "
        f"{os.path.relpath(defaults_path(FLAT_DEFAULTS_RELEASE))}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
