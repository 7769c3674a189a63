"""Asynchronous training, the plain-data part: which mode a run takes, the batches generated ahead of the trainer
(every token with the weight version that sampled it), the staleness bound, and the batches' JSON form for
checkpoints. The threads and the weight-update boundary are in :mod:`.async_loop`.

Versions: the trainer's weights after ``v`` updates are version ``v``; the engines hold the version last synced to
them. With ``--async_max_staleness N`` batch ``j`` is generated with version ``max(0, j - N)`` (one-step-off with
N = 1: batch k+1 with the weights of step k's start, while step k trains), and trained on at version ``j``: a
sample is at most N versions old. Partial rollouts may finish a generation with newer weights; its oldest token
still counts.

Modes (:func:`async_mode`): ``split`` (engines on GPUs of their own), ``shared`` (engines share the trainer's GPUs and
the residency plan keeps the engine's weights and KV budget resident next to the trainer in every phase: the two
run at the same time), ``sync`` (they share GPUs but do not fit together: synchronous turns, said in the run's
notes), ``off``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from hybrid_core.errors import HybridError
from hybrid_core.mps import mps_note

from .dynamic_sampling import Sampled

if TYPE_CHECKING:
    from hybrid_core.residency.settings import ResidencySettings

    from .rollout_settings import RolloutSettings


class StalenessError(HybridError):
    """A batch older than ``--async_max_staleness`` reached the trainer (a scheduling bug: never trained on)."""


@dataclass
class Batch:
    """One step's generated rollout, waiting to be trained on."""

    step: int
    sampled: Sampled
    version: int  # the engines' weight version when its generation started
    versions: list[list[list[int]]] = field(default_factory=list)  # [prompt][sample][token] -> weight version
    start: float = 0.0  # wall-clock seconds of the generation (timeline)
    end: float = 0.0

    @property
    def oldest(self) -> int:
        return min(
            (v for per_prompt in self.versions for per_sample in per_prompt for v in per_sample), default=self.version
        )

    @property
    def newest(self) -> int:
        return max(
            (v for per_prompt in self.versions for per_sample in per_prompt for v in per_sample), default=self.version
        )


def make_batch(step: int, sampled: Sampled, version: int, start: float = 0.0, end: float = 0.0) -> Batch:
    """A batch from generated outputs; tokens whose engine marks no version get the version of the generation."""
    versions = [
        [list(o.weight_versions) if o.weight_versions is not None else [version] * len(o.token_ids) for o in outs]
        for outs in sampled.outputs
    ]
    return Batch(step, sampled, version, versions, start, end)


def check_staleness(batch: Batch, trainer_version: int, max_staleness: int) -> int:
    """The batch's staleness (versions between its oldest token and the trainer); raises past the bound."""
    age = trainer_version - batch.oldest
    if age > max_staleness:
        raise StalenessError(
            f"step {batch.step + 1}: a sample generated with weight version {batch.oldest} reached "
            f"the trainer at version {trainer_version} ({age} versions old, more than "
            f"--async_max_staleness {max_staleness}); it was not trained on."
        )
    return age


def staleness_metrics(batch: Batch, trainer_version: int) -> dict[str, float]:
    ages = [trainer_version - v for per_prompt in batch.versions for per_sample in per_prompt for v in per_sample]
    mixed = sum(1 for per_prompt in batch.versions for s in per_prompt if len(set(s)) > 1)
    return {
        "async/staleness_max": float(trainer_version - batch.oldest),
        "async/staleness_mean": sum(ages) / len(ages) if ages else float(trainer_version - batch.version),
        "async/generation_version": float(batch.version),
        "async/mixed_version_samples": float(mixed),
    }


# ---- modes ---------------------------------------------------------------------------------------------------------
def async_mode(rollout: RolloutSettings, placement: Any, residency: Any) -> tuple[str, str]:
    """(mode, why) for this run (``rollout``: the rollout section): see the module docstring."""
    if not rollout.async_train:
        return "off", ""
    if not placement.shared_gpus("rollout"):
        return "split", "asynchronous: the engines generate the next batch on their own GPUs while the trainer trains"
    if not residency.sleeps("rollout"):
        return "shared", (
            "asynchronous on shared GPUs: the residency plan keeps the engines' weights and KV cache "
            "resident next to the trainer, so the next batch is generated while this one trains; " + mps_note()
        )
    return "sync", (
        "--async_train: the engines share the trainer's GPUs and their weights and KV cache do not fit "
        "next to the trainer in every phase (the residency plan moves them), so the run takes "
        "synchronous turns"
    )


def async_pins(
    rollout: RolloutSettings, residency: ResidencySettings, shared_roles: set[str], sleeping: set[str]
) -> dict[tuple[str, str], str] | None:
    """The pins that ask the planner to keep the engines resident next to the trainer (async on shared GPUs), or
    None when there is nothing to ask (no async, engines on GPUs of their own, or the user asked them to sleep)."""
    if not rollout.async_train or "rollout" not in shared_roles or "rollout" in sleeping:
        return None
    user = residency.state_pins()
    if any(user.get(("rollout", s), "resident") != "resident" for s in ("weights", "kv_cache")):
        return None
    return {("rollout", "weights"): "resident", ("rollout", "kv_cache"): "resident"}


# ---- checkpoints: the queue as JSON --------------------------------------------------------------------------------
def batch_to_json(batch: Batch, prompt_index: dict[int, int]) -> dict[str, Any]:
    """Plain data (no pickle): prompts by their index in the run's prompt set, outputs as lists."""
    s = batch.sampled
    return {
        "step": batch.step,
        "version": batch.version,
        "versions": batch.versions,
        "start": batch.start,
        "end": batch.end,
        "prompts": [prompt_index[id(p)] for p in s.prompts],
        "outputs": [
            [
                {
                    "prompt_token_ids": list(o.prompt_token_ids),
                    "token_ids": list(o.token_ids),
                    "logprobs": None if o.logprobs is None else [float(x) for x in o.logprobs],
                    "finish_reason": o.finish_reason,
                    "extra": _plain_extra(o.extra),
                }
                for o in outs
            ]
            for outs in s.outputs
        ],
        "scores": None if s.scores is None else [float(x) for x in s.scores.tolist()],
        "metrics": {k: float(v) for k, v in s.metrics.items()},
    }


def _plain_extra(extra: dict[str, Any]) -> dict[str, Any]:
    """An output's ``extra`` as JSON: it carries what training needs besides the tokens (a multi-turn sample's
    ``action_mask``, which keeps the environment's tokens out of the loss), so it must come back on ``--resume``."""
    out: dict[str, Any] = {}
    for key, value in (extra or {}).items():
        if isinstance(value, torch.Tensor):
            value = value.tolist()
        try:
            json.dumps(value)
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"generation output extra[{key!r}] ({type(value).__name__}) cannot go into the "
                f"checkpoint's JSON queue: give it plain data (numbers, strings, lists)."
            ) from e
        out[str(key)] = value
    return out


def batch_from_json(data: dict[str, Any], prompts: Sequence[Any]) -> Batch:
    from hybrid_engines.protocol import GenerationOutput

    from .checkpoint import CheckpointError

    try:
        ps = [prompts[int(i)] for i in data["prompts"]]
        outputs = [
            [
                GenerationOutput(
                    prompt_token_ids=[int(t) for t in o["prompt_token_ids"]],
                    token_ids=[int(t) for t in o["token_ids"]],
                    logprobs=None if o["logprobs"] is None else [float(x) for x in o["logprobs"]],
                    finish_reason=str(o["finish_reason"]),
                    extra=dict(o.get("extra") or {}),
                    weight_versions=[int(v) for v in vs],
                )
                for o, vs in zip(outs, vers, strict=True)
            ]
            for outs, vers in zip(data["outputs"], data["versions"], strict=True)
        ]
        scores = None if data["scores"] is None else torch.tensor(data["scores"], dtype=torch.float32)
        sampled = Sampled(ps, outputs, scores, {str(k): float(v) for k, v in data["metrics"].items()})
        versions = [[[int(v) for v in s] for s in p] for p in data["versions"]]
        return Batch(
            int(data["step"]), sampled, int(data["version"]), versions, float(data["start"]), float(data["end"])
        )
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise CheckpointError(
            f"the checkpoint's queue of generated batches is damaged ({type(e).__name__}: {e}). "
            "Fix: resume from an earlier checkpoint (delete this one), or start fresh."
        ) from None
