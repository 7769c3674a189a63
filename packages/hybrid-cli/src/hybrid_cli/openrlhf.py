"""What an OpenRLHF command line means, so that one pasted after ``hybrid ppo`` runs OpenRLHF's algorithm.

Which flags exist and what each means is the table in :mod:`hybrid_cli.openrlhf_flags`; this module holds what is
*not* given: the defaults. hybrid's own default is the hybrid engine (every model and the engines colocated, the
residency planner deciding who sleeps, the built-in ``hf`` engine, the CPU demo's sizes, each algorithm's
hyperparameters). OpenRLHF's ``train_ppo_ray`` defaults are another run (nothing colocated, 8 GPUs per role,
rollout batch 1024, bf16, no engines: generate with the actor's own model, KL estimator k1 in the reward, no rollout
correction, a cosine schedule with warm-up, ...).

**Which defaults a command line gets -- what a user would expect.** Someone who pastes an OpenRLHF script expects
OpenRLHF's run: its 64-GPU "without hybrid engine" command must not silently become colocated, and its GRPO script
must not get another KL estimator. Someone who adds ``--vllm_num_engines 2`` to the demo expects the demo with two
engines, not a switch to vLLM, 8 GPUs per role and batches of 1024. So OpenRLHF's defaults apply to a command line
that *is* an OpenRLHF one (:func:`is_openrlhf_command`): it uses OpenRLHF's dotted spelling (``--vllm.num_engines``:
only OpenRLHF >= 0.10.2 scripts do), or it names its own model (``--pretrain``) *and* places roles the OpenRLHF way
(:data:`PLACEMENT_FLAGS`). The demo (no ``--pretrain``) with a placement flag keeps hybrid's defaults, and a note says
so. ``--placement`` (RLinf-style ranges) is hybrid's own way and never takes OpenRLHF's defaults.

**Which OpenRLHF.** A dotted line is read as OpenRLHF 0.11.2 (the release the flag table is built from; the main
branch's few newer flags are accepted too), a flat one as 0.10.1, the last release before the rename. Every flag of
that release that maps to a setting here and that the line leaves out takes that release's default
(``data/openrlhf_defaults_<release>.json``, argparse's values read from the wheel), translated by the flag's own rule
-- not hybrid's default, whatever the subcommand: ``hybrid grpo`` on an OpenRLHF line gets OpenRLHF's KL estimator
(k1), KL in the reward, ``init_kl_coef`` 0.01 and one sample per prompt, as ``train_ppo_ray`` would. The subcommand
names only the advantage estimator, where the line gives none (``hybrid grpo``: group_norm).

**Where hybrid differs on purpose** (:data:`DIFFERENCES`, and the few cases decided per line), the run's first lines
say so, one per difference: the setting, OpenRLHF's value, hybrid's, and why -- e.g. the residency planner deciding
who sleeps where OpenRLHF keeps every model resident unless told (``--vllm.enable_sleep`` / ``--ds.enable_sleep`` /
``--residency manual`` give OpenRLHF's behaviour).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hybrid_core.errors import ConfigError

from . import openrlhf_flags as orl

#: Flags that place roles the OpenRLHF way (see the module docstring).
PLACEMENT_FLAGS = frozenset(
    {
        "actor_num_nodes",
        "actor_num_gpus_per_node",
        "critic_num_nodes",
        "critic_num_gpus_per_node",
        "ref_num_nodes",
        "ref_num_gpus_per_node",
        "reward_num_nodes",
        "reward_num_gpus_per_node",
        "vllm_num_engines",
        "vllm_tensor_parallel_size",
        "colocate_all_models",
        "colocate_actor_ref",
        "colocate_critic_reward",
    }
)


@dataclass(frozen=True)
class Difference:
    """A setting an OpenRLHF command line leaves out that does not take OpenRLHF's default here."""

    field: str
    openrlhf: str  # OpenRLHF's value, in words
    ours: str  # hybrid's, in words
    why: str


#: Settings that keep hybrid's meaning on an OpenRLHF line when the line leaves them out (and hybrid's default is not
#: OpenRLHF's): field -> (hybrid's value in words, why).
DIFFERENCES: dict[str, tuple[str, str]] = {
    "vllm_enable_sleep": (
        "the residency planner decides (each engine sleeps only where the next phase needs its GPU memory)",
        "the planner keeps what fits resident and moves only what must leave; --vllm_enable_sleep, "
        "--no_vllm_enable_sleep or --residency manual decide it as OpenRLHF does",
    ),
    "deepspeed_enable_sleep": (
        "the residency planner decides (each trainer state moves only where the next phase needs its GPU memory)",
        "the planner keeps what fits resident and moves only what must leave; --deepspeed_enable_sleep, "
        "--no_deepspeed_enable_sleep or --residency manual decide it as OpenRLHF does",
    ),
    "ckpt_path": (
        "<save_path>/checkpoints",
        "a run's checkpoints stay in its own run folder, so another run started in the same working directory never "
        "resumes from them (OpenRLHF's default is one folder under the working directory for every run)",
    ),
    "vllm_sync_backend": (
        "nccl where the GPUs have CUDA, gloo on a machine without (chosen per run)",
        "nccl needs CUDA; on GPUs it is OpenRLHF's nccl",
    ),
}

#: What OpenRLHF's ``None`` means for a setting that has no ``None`` here.
NONE_MEANS = {
    "vllm_num_engines": 0,  # no engines: generate with the actor's own model
    "entropy_loss_coef": 0.0,
}  # no entropy term
#: Conversions whose ``None`` default means something here (``--logger.tensorboard_dir`` not given: no TensorBoard).
CONVERT_NONE = {"logger.tensorboard_dir": {"use_tensorboard": False}, "use_tensorboard": {"use_tensorboard": False}}
#: Defaults OpenRLHF reads only when a switch is on: field -> the switch (the line must give it).
CONDITIONAL = {
    "vllm_is_truncated_threshold": "enable_vllm_is_correction",
    "train_max_tokens_per_gpu": "use_dynamic_batch",
    "rollout_max_tokens_per_gpu": "use_dynamic_batch",
    "dynamic_filtering_reward_range": "dynamic_filtering",
}


def is_openrlhf_command(given: Mapping[str, Any], dotted_used: bool) -> bool:
    if "placement" in given:
        return False
    return dotted_used or ("pretrain" in given and bool(PLACEMENT_FLAGS & set(given)))


def line_release(dotted_used: bool) -> str:
    """The OpenRLHF release a command line is read as: 0.11.2 when dotted, else 0.10.1 (the last flat release)."""
    return orl.openrlhf_release() if dotted_used else orl.FLAT_RELEASE


@dataclass
class LineDefaults:
    """What an OpenRLHF command line leaves out: OpenRLHF's defaults taken, and the deliberate differences."""

    release: str
    implied: dict[str, Any]
    differences: list[Difference]
    flag_of: dict[str, str]  # field -> the release's flag for it (to name it in the notes)

    def notes(self, cls: type, command: str) -> list[str]:
        """One note on the defaults taken (those not hybrid's), then one per difference."""
        from .flags import field_specs

        specs = field_specs(cls)
        changed = {k: v for k, v in self.implied.items() if k not in specs or specs[k].default != v}
        head = (
            f"this is an OpenRLHF command line (read as OpenRLHF {self.release}: "
            f"{'dotted' if self.release == orl.openrlhf_release() else 'flat'} flags), so the settings it does "
            f"not give take OpenRLHF's defaults (OpenRLHF {self.release}'s train_ppo_ray parser), not `hybrid "
            f"{command}`'s; those that differ from `hybrid {command}`'s: "
            + (", ".join(f"{k}={_show(v)}" for k, v in changed.items()) or "none")
            + "."
        )
        return [head, *(self.describe(d) for d in self.differences)]

    def describe(self, d: Difference) -> str:
        flag = self.flag_of.get(d.field)
        name = f"--{flag}" if flag else d.field
        return (
            f"differs from OpenRLHF {self.release}: {name} not given: OpenRLHF {d.openrlhf}; here "
            f"{d.field} = {d.ours}. Why: {d.why}."
        )


def line_defaults(cls: type, given: Mapping[str, Any], *, dotted_used: bool) -> LineDefaults:
    """OpenRLHF's defaults (of the release the line is read as) for every setting ``given`` leaves out, and the
    settings that keep hybrid's meaning. ``given``: the settings the line gave, OpenRLHF's flags translated."""
    from .flags import convert, field_specs

    release = line_release(dotted_used)
    specs = field_specs(cls)
    implied: dict[str, Any] = {}
    differences: list[Difference] = []
    flag_of: dict[str, str] = {}
    for name, default in orl.release_defaults(release).items():
        rule = orl.rule_for(name)
        outputs = _outputs(rule, specs)
        if not outputs:
            continue
        for out in outputs:
            flag_of.setdefault(out, name)
        if all(f in given or f in implied for f in outputs):
            continue
        if outputs == ("advantage_estimator",) and specs["advantage_estimator"].default != default:
            ours = specs["advantage_estimator"].default  # the subcommand names the algorithm
            differences.append(
                Difference(
                    "advantage_estimator",
                    str(default),
                    ours,
                    f"the subcommand names the algorithm (`hybrid {cls().algorithm}`: "
                    f"{ours}); give --{name} to choose another",
                )
            )
            continue
        if outputs[0] in DIFFERENCES and specs[outputs[0]].default != default:
            ours, why = DIFFERENCES[outputs[0]]
            differences.append(Difference(outputs[0], _show(default), ours, why))
            continue
        try:
            values = _default_values(rule, name, default, given, specs, convert)
        except ConfigError as e:  # OpenRLHF's default cannot hold what the line gives (a total length too short)
            differences.append(
                Difference(
                    outputs[0],
                    f"{_show(default)} (--{name})",
                    f"hybrid's default ({specs[outputs[0]].default})",
                    f"OpenRLHF's default does not fit the line: {e.problem.rstrip('.')}",
                )
            )
            continue
        implied.update({k: v for k, v in values.items() if k not in given and k not in implied})
    for field_name, switch in CONDITIONAL.items():
        if field_name in implied and given.get(switch) is not True:
            del implied[field_name]
    if implied.get("loss_agg_mode") is not None and given.get("policy_loss_type") == "gspo":
        del implied["loss_agg_mode"]  # OpenRLHF's GSPO averages per sequence whatever --actor.loss_agg_mode says
    if given.get("async_train") and implied.get("enable_vllm_is_correction") is False:
        del implied["enable_vllm_is_correction"]
        differences.append(
            Difference(
                "enable_vllm_is_correction",
                "off",
                "on (hybrid's default correction)",
                "an asynchronous run trains on samples of older weights, and hybrid corrects "
                "that gap with the engines' log-probs (it does not train asynchronously "
                "without); turn it on the OpenRLHF way to choose its level and mode",
            )
        )
    if "backend" not in given:  # OpenRLHF's engines are vLLM; without engines it generates with transformers
        engines = given.get("vllm_num_engines", implied.get("vllm_num_engines"))
        implied["backend"] = "vllm" if engines else "hf"
    return LineDefaults(release, implied, differences, flag_of)


def _outputs(rule: orl.Rule, specs: Mapping[str, Any]) -> tuple[str, ...]:
    """The settings here that a flag's default may set (none for flags that change nothing here)."""
    if rule.kind in ("same", "pending"):
        return (rule.field,) if rule.field is not None and rule.field in specs else ()
    if rule.kind == "convert":
        return tuple(f for f in rule.fields if f in specs)
    return ()


def _default_values(
    rule: orl.Rule, name: str, default: Any, given: Mapping[str, Any], specs: Mapping[str, Any], convert
) -> dict[str, Any]:
    """The settings a flag's default means here, by the flag's own rule (its notes are for given flags: dropped)."""
    if rule.kind in ("same", "pending"):
        field = rule.field
        assert field is not None, f"{name}: a {rule.kind} rule names its setting"  # same() / pending() set it
        spec = specs[field]
        if default is None:
            if field in NONE_MEANS:
                return {field: NONE_MEANS[field]}
            return {field: None} if spec.optional else {}
        if isinstance(default, str) and "%" in default and name in ("logger.wandb.run_name", "wandb_run_name"):
            default = time.strftime(default)  # OpenRLHF's run name is the launch time
        return {field: convert(spec, default)}
    if default is None:
        return dict(CONVERT_NONE.get(name, {}))
    ctx = orl.Context({}, dict(given), frozenset(specs))
    return rule.fn(default, ctx, name)


def _show(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return str(value)


def without_engines(values: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``--vllm_num_engines 0``: OpenRLHF generates with the actor's own model; hybrid puts a built-in (transformers)
    engine on each actor GPU, taking turns with the actor there (the residency plan). A tensor-parallel size is then
    unused (as in OpenRLHF)."""
    if values.get("vllm_num_engines", 1) != 0:
        return {}, []
    changes: dict[str, Any] = {}
    notes = [
        "--vllm_num_engines 0: OpenRLHF generates with the actor's own model; here the built-in transformers "
        "engine runs on each actor GPU, taking turns with the actor (no vLLM)."
    ]
    if values.get("vllm_tensor_parallel_size", 1) > 1:
        changes["vllm_tensor_parallel_size"] = 1
        notes.append(
            f"--vllm_tensor_parallel_size {values['vllm_tensor_parallel_size']} is unused without engines "
            "(as in OpenRLHF)."
        )
    return changes, notes
