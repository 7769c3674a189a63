"""How a run's weights reach its engines, decided once before Ray starts: the one place the sync path is chosen.

:func:`choose_sync` answers, from the run's sync section (:class:`~.settings.SyncSettings`), its engines' backend
and its placement plan, everything the sync needs to know up front:
the path (``ipc`` for engines on the trainer's GPUs, ``broadcast`` for engines on GPUs of their own), the engine's
own transport (the trainer's side of the wire format its receiving code speaks) and the broadcast group's backend
(nccl or gloo) -- or a :class:`~hybrid_core.errors.ConfigError` naming why this run cannot sync (as ``sync.<field>``
/ ``engine.backend``: the training config says them in its flags' words). The notes said at start
(:func:`sync_backend_note`, :func:`verify_note`; in the CLI's words, as the run prints them) and the ``--dry-run``
line (:func:`describe_sync`) read the same answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hybrid_core.errors import ConfigError

from ..registry import engine_spec
from .settings import SyncSettings
from .transport import WeightTransport

if TYPE_CHECKING:
    from hybrid_core.placement import PlacementPlan


@dataclass(frozen=True)
class SyncChoice:
    """One run's weight-sync decision (:func:`choose_sync`)."""

    mode: str  # "ipc" | "broadcast"
    transport: WeightTransport  # the trainer's side: the engine's own wire format (``weight_transport()``)
    group_backend: str  # the broadcast group's backend here: the asked one with CUDA, gloo without (ipc: no group)


def choose_sync(
    settings: SyncSettings,
    backend: str,
    plan: PlacementPlan,
    *,
    trainer_role: str = "actor",
    engine_role: str = "rollout",
) -> SyncChoice:
    """The path, the transport and the group backend for engines of ``backend`` (the registry's name) on this plan,
    or a :class:`ConfigError` naming why the run cannot sync.

    ``auto`` is ipc when every engine worker shares a GPU with exactly one trainer rank (colocated, any TP), else
    broadcast. Refused: a path the engine's transport does not serve, an engine placement the engine cannot take,
    and broadcast over NCCL with an engine worker on the trainer rank 0's GPU (NCCL refuses two ranks of one group
    on a GPU)."""
    mode = settings.validate().transport
    cls = engine_spec(backend)
    trainer = plan.roles[trainer_role].workers
    engines = plan.roles[engine_role]
    trainer_gpus = [g for w in trainer for g in w.gpus]
    engine_gpus = [g for w in engines.workers for g in w.gpus]
    shared = (
        all(len(w.gpus) == 1 for w in trainer)
        and len(set(trainer_gpus)) == len(trainer_gpus)
        and sorted(engine_gpus) == sorted(trainer_gpus)
    )
    refusal = getattr(cls, "placement_refusal", None)
    problem = refusal(tp=engines.tp, shares_gpus=bool(set(engine_gpus) & set(trainer_gpus))) if refusal else None
    if problem:
        raise ConfigError(
            "engine.backend",
            f"engine.backend {backend} cannot run this placement: {problem}.",
            "Use engine.backend vllm for this placement, or tensor-parallel size 1.",
        )
    if mode == "auto":
        mode = "ipc" if shared else "broadcast"
    elif mode == "ipc" and not shared:
        raise ConfigError(
            "sync.transport",
            "the ipc path needs the engines' GPUs to be exactly the actor's GPUs, "
            "one actor rank and one engine worker on each.",
            "Use sync.transport broadcast (or auto).",
        )
    elif mode == "broadcast" and set(engine_gpus) & set(trainer[0].gpus) and _uses_nccl(settings, cls):
        raise ConfigError(
            "sync.transport",
            "the broadcast path over NCCL puts actor rank 0 and the engine workers in "
            "one group, and an engine worker shares rank 0's GPU: NCCL refuses two ranks on one GPU.",
            "Use sync.transport auto (ipc for colocated engines), or put the engines on their own GPUs.",
        )
    transport = cls.weight_transport()
    problem = transport.refusal(mode, tp=engines.tp)
    if problem:
        raise ConfigError(
            "sync.transport",
            f"engine.backend {backend}: {problem}.",
            "Use another sync.transport path or placement, or engine.backend vllm.",
        )
    return SyncChoice(mode, transport, sync_backend(settings))


def describe_sync(settings: SyncSettings, backend: str, plan: PlacementPlan) -> str:
    """One line for ``--dry-run``: the path, the wire format and the group backend (raises like the chooser)."""
    choice = choose_sync(settings, backend, plan)
    over = f" over {group_backend(settings)} (gloo on a machine without CUDA)" if choice.mode == "broadcast" else ""
    return f"{choice.transport.describe(choice.mode)}{over}"


def sync_backend_note(settings: SyncSettings, mode: str) -> str | None:
    """What an explicit ``--vllm_sync_backend`` does on the path chosen (``mode``), when it is not what it says: the
    ipc path has no collective group, so the backend of one is not used. NCCL could not carry it anyway: actor rank
    0 and the engine on its GPU would be two ranks of one group on one GPU, which NCCL refuses (the chooser refuses
    ``--weight_sync broadcast`` over NCCL there). OpenRLHF does the same with ``--vllm_sync_backend nccl
    --colocate_all_models``: CUDA IPC. None when the flag is unset (the default) or means what it says."""
    asked = settings.group_backend
    if asked is None or mode != "ipc":
        return None
    why = (
        f"--vllm_sync_backend {asked}: not used: the engines share the actor's GPUs, so the weights go to them by "
        "CUDA IPC (shared memory without CUDA), with no collective group (as OpenRLHF does with "
        "--colocate_all_models)"
    )
    if asked == "nccl":
        return (
            f"{why}; NCCL cannot hold actor rank 0 and the engine on its GPU in one group (two ranks on one GPU). "
            "To broadcast anyway: --weight_sync broadcast --vllm_sync_backend gloo (through host memory, slower)."
        )
    return f"{why}. To broadcast over {asked} anyway: --weight_sync broadcast (slower)."


def verify_note(settings: SyncSettings, backend: str) -> str | None:
    """What ``settings.verify`` (sampled by default) cannot do for engines of ``backend``, said at start; None where
    every sync is checked. SGLang receives in its own code and format, with no checksums to compare."""
    if settings.verify == "off":
        return "--verify_weight_sync off: the engines' weights are not checked against the trainer's after each sync"
    transport = engine_spec(backend).weight_transport()
    if getattr(transport, "verifies", False):
        return None
    return (
        f"--backend {backend}: weight syncs are not verified: the engine receives them in its own code "
        f"and format ({transport.name}), which carries no checksums; the built-in (hf) and vLLM engines are "
        "checked after every sync"
    )


def group_backend(settings: SyncSettings) -> str:
    """The broadcast group's backend asked for: ``settings.group_backend``, nccl when unset (OpenRLHF's default)."""
    return settings.group_backend or "nccl"


def sync_backend(settings: SyncSettings) -> str:
    """The broadcast group's backend here: ``settings.group_backend`` (default nccl) with CUDA, gloo without."""
    import torch

    return group_backend(settings) if torch.cuda.is_available() else "gloo"


def _uses_nccl(settings: SyncSettings, engine_cls: type) -> bool:
    """NCCL is what the group will use: asked for, and the engines need a GPU (the built-in engine on a machine
    without CUDA syncs over gloo)."""
    if group_backend(settings) != "nccl":
        return False
    if getattr(engine_cls, "NEEDS_GPU", False):
        return True
    import torch

    return torch.cuda.is_available()
