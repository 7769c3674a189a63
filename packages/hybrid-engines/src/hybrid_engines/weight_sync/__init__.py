"""Getting a trainer's new weights into its engines after each update, in the engines' own wire format.

Two paths, chosen once before Ray starts by :func:`~.choice.choose_sync` (from the run's settings and placement
plan), the one function that also picks the engine's transport and the group backend:

* ``ipc`` -- engines share the trainer's GPUs (colocated): each trainer rank packs flat buckets on its own GPU and
  hands them to the engine on that GPU; no copy leaves the device (shared memory on CPU). A TP > 1 engine spans
  several trainer ranks' GPUs: those ranks hand each bucket over together, one per GPU.
* ``broadcast`` -- engines on GPUs of their own: a torch.distributed group (trainer rank 0 + every engine worker)
  over NCCL (gloo on CPU) carries the buckets; ZeRO-3 shards are gathered one parameter at a time on the way.

Either way the trainer side is the engine's :class:`~.transport.WeightTransport` (``engine_spec(backend)
.weight_transport()``): an engine that receives SGLang's format gets SGLang's sender (:mod:`.sglang`).

Modules: :mod:`.settings` (the run's sync section, :class:`~.settings.SyncSettings`), :mod:`.choice` (which path,
before Ray), :mod:`.driver` (:class:`WeightSync` on the driver, :class:`TrainerWeightSource` mixed into the trainer's
workers), :mod:`.transport` (hybrid-core's wire format, the trainer's side), :mod:`.sglang` (SGLang's),
:mod:`.adapter` (under LoRA: the adapter alone each sync where the engines take it, else merged weights). The
wire-level pieces (buckets, sender / receiver, checksums) are ``hybrid_core.weight_sync``'s.
"""

from __future__ import annotations

from .choice import (
    SyncChoice,
    choose_sync,
    describe_sync,
    group_backend,
    sync_backend,
    sync_backend_note,
    verify_note,
)
from .driver import TrainerWeightSource, WeightSync
from .settings import TRANSPORTS, SyncSettings
from .transport import WeightTransport

__all__ = [
    "TRANSPORTS",
    "SyncChoice",
    "SyncSettings",
    "TrainerWeightSource",
    "WeightSync",
    "WeightTransport",
    "choose_sync",
    "describe_sync",
    "group_backend",
    "sync_backend",
    "sync_backend_note",
    "verify_note",
]
