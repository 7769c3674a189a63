"""Which checkpoint a run continues from, and whether this run *can* continue it -- decided before Ray starts.

``--resume`` needs a checkpoint; ``--resume_if_exists`` (OpenRLHF's ``--load_checkpoint``) continues one when there
is one and starts fresh otherwise. A checkpoint records the essentials of the run that wrote it (algorithm,
estimator, model, the trainer's layout); a run that differs in one of them cannot load it (a GRPO checkpoint has no
critic for ``hybrid ppo``; DeepSpeed's files are laid out per rank and ZeRO stage) and is refused with a message
saying which command continues it. Settings that may change between runs (learning rate, KL, ...) only get a note.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hybrid_core.errors import ConfigError

from .checkpoint import CheckpointError, CheckpointManager, UnsafeCheckpoint

if TYPE_CHECKING:
    from .run_settings import RunSettings

log = logging.getLogger(__name__)

#: Must match between the run that wrote a checkpoint and the run that loads it.
ESSENTIALS = (
    "algorithm",
    "uses_critic",
    "actor_world_size",
    "critic_world_size",
    "trainer",
    "zero_stage",
    "tiny_model",
    "lora",
)
#: Different from the checkpoint's: allowed, but said.
NOTED = (
    "actor_learning_rate",
    "critic_learning_rate",
    "init_kl_coef",
    "kl_estimator",
    "use_kl_loss",
    "n_samples_per_prompt",
    "rollout_batch_size",
    "train_batch_size",
    "max_epochs",
    "temperature",
    "seed",
    "pretrain",
    "reward_pretrain",
    "teacher_pretrain",
    "distill_coef",
    "distill_task_coef",
    "reward_fn",
    "prompt_data",
    "task",
    "task_length",
    "bf16",
    "max_steps",
    "lr_scheduler",
    "min_lr_ratio",
    "lr_warmup_ratio",
    "bf16_master_weights",
    "bf16_optimizer_states",
)


@dataclass(frozen=True)
class ResumePoint:
    path: str
    step: int
    state: dict[str, Any]


def essentials(config: Any) -> dict[str, Any]:
    """What a checkpoint records about the run that wrote it (plain data, compared on resume)."""
    return {
        "algorithm": config.algorithm,
        "advantage_estimator": config.advantage_estimator,
        "uses_critic": config.uses_critic,
        "actor_world_size": config.actor_world_size,
        "critic_world_size": config.critic_world_size if config.uses_critic else 0,
        "trainer": config.trainer,  # a DeepSpeed checkpoint and a DCP one are not each other's
        "zero_stage": config.zero_stage,
        "tiny_model": dict(config.tiny_model) if config.pretrain is None else None,
        # the checkpoint holds an adapted model's parameters (or a plain one's): the other cannot load them
        "lora": f"rank {config.lora_rank} on {config.lora_target_modules}" if config.lora_rank else None,
    }


def find_resume_point(run: RunSettings, ckpt: CheckpointManager, config: Any) -> ResumePoint | None:
    """The checkpoint this run continues from (None: a fresh start); a ConfigError when it cannot continue. ``run``
    (the run section) says whether to resume; the flat ``config`` is compared with the one the checkpoint saved
    (:func:`check_compatible`: a checkpoint records the flat config, so that is what a resumed run is held to)."""
    if not (run.resume or run.resume_if_exists):
        return None
    ckpt.sweep_incomplete()
    try:
        found = ckpt.resume_point(trusted=run.trust_checkpoint)
    except UnsafeCheckpoint as e:
        raise ConfigError(
            "resume",
            str(e) + ".",
            "Resume from a checkpoint you wrote, or start a fresh run (a new --save_path, or --overwrite).",
        ) from None
    except CheckpointError as e:
        raise ConfigError(
            "resume",
            str(e) + ".",
            "Point --ckpt_path at another run's checkpoints, or start a fresh run (a new --save_path, or --overwrite).",
        ) from None
    if found is None:
        if run.resume:
            raise ConfigError(
                "resume",
                f"no complete checkpoint under {ckpt.root}.",
                "Drop --resume to start fresh, or point --ckpt_path (or --save_path) at the run to continue.",
            )
        log.info("--resume_if_exists: no checkpoint under %s, starting fresh", ckpt.root)
        return None
    path, step, state = found
    check_compatible(config, state, path)
    return ResumePoint(path, step, state)


def check_compatible(config: Any, state: dict[str, Any], path: str) -> None:
    """Refuse a checkpoint written by a run this one cannot continue; log the settings that changed."""
    saved = state.get("essentials") or _essentials_of_old(state.get("config") or {})
    mine = essentials(config)
    for key in ESSENTIALS:
        if key in saved and saved[key] != mine[key]:
            raise ConfigError(
                "resume",
                f"the checkpoint {path} was written by {_describe(saved)}, and this is "
                f"{_describe(mine)} ({key}: {saved[key]!r} there, {mine[key]!r} here).",
                f"Continue it with the same command and layout (hybrid {saved.get('algorithm', '?')} "
                "... --resume), or start this run in a fresh --save_path.",
            )
    old = state.get("config") or {}
    changed = [
        f"{k} {old[k]!r} -> {getattr(config, k)!r}"
        for k in NOTED
        if k in old and _plain(old[k]) != _plain(getattr(config, k))
    ]
    if changed:
        log.warning("resuming %s with settings changed since it was saved: %s", path, "; ".join(changed))
    # The schedule is rebuilt from this run's settings and continued at the saved update: a decaying schedule over a
    # different number of steps puts the rate somewhere else than where the saved run left it.
    if (
        getattr(config, "lr_scheduler", None) == "cosine_with_min_lr"
        and "max_steps" in old
        and old["max_steps"] != getattr(config, "max_steps", None)
    ):
        log.warning(
            "resuming %s with --max_steps %s (was %s): the cosine decay is spread over the new length from "
            "here on, so the learning rate moves up or down at the resumed step. Keep --max_steps to continue "
            "the saved schedule exactly.",
            path,
            getattr(config, "max_steps", None),
            old["max_steps"],
        )


def _essentials_of_old(config: dict[str, Any]) -> dict[str, Any]:
    """Essentials of a checkpoint written before they were recorded, from its saved config."""
    if not config:
        return {}
    estimator = config.get("advantage_estimator")
    out: dict[str, Any] = {"uses_critic": estimator == "gae"}
    algorithms: dict[Any, str] = {"gae": "ppo", "group_norm": "grpo", "grpo": "grpo", "reinforce": "reinforce"}
    algorithm = algorithms.get(estimator)
    if algorithm:
        out["algorithm"] = algorithm
    if "zero_stage" in config:
        out["zero_stage"] = config["zero_stage"]
    return out


def _describe(e: dict[str, Any]) -> str:
    critic = "with a critic" if e.get("uses_critic") else "no critic"
    layout = (
        f", {e['actor_world_size']} actor GPU(s), "
        + ("FSDP2" if e.get("trainer") == "fsdp2" else f"ZeRO-{e['zero_stage']}")
        if "zero_stage" in e and "actor_world_size" in e
        else ""
    )
    return f"`hybrid {e.get('algorithm', '?')}` ({e.get('advantage_estimator', 'its estimator')}, {critic}{layout})"


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, str) and os.sep in value:
        return os.path.abspath(value)
    return value


def drop_steps_from(path: str, start_step: int) -> int:
    """Cut a per-step JSONL file (metrics.jsonl, timeline.jsonl) of a resumed run back to the steps before
    ``start_step``: the steps a run did after its last checkpoint are done again, and would be there twice.

    The file is cut at the first line whose ``step`` is ``start_step`` or later, or that does not parse (a line
    half-written when the run was killed); lines are in step order, one writer at a time (the run folder's lock).
    Cut in place (one ``truncate``), so a writer that has the file open for appending goes on at the new end.
    Returns the number of lines dropped."""
    import json

    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return 0
    offset = 0
    for line in data.splitlines(keepends=True):
        if line.endswith(b"\n") and not line.strip():  # a blank line: kept
            offset += len(line)
            continue
        try:
            record = json.loads(line) if line.endswith(b"\n") else None  # no newline: the write was cut short
        except ValueError:
            record = None
        step = record.get("step") if isinstance(record, dict) else None
        if not isinstance(step, (int, float)) or isinstance(step, bool) or step >= start_step:
            break
        offset += len(line)
    dropped = len(data[offset:].splitlines())
    if offset < len(data):
        os.truncate(path, offset)
        log.info("%s: dropped %d line(s) of steps from %d on (done again after the resume)", path, dropped, start_step)
    return dropped
