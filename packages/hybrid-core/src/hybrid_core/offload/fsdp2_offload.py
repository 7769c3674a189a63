"""Put an FSDP2 role (``fully_shard`` module + torch optimizer) to sleep state by state, and wake it again.

FSDP2 keeps each parameter's local shard, its gradient shard and the optimizer's moments as plain tensors inside
DTensors. Each state (``"params"``, ``"grads"``, ``"optimizer"``) is moved as whole storages: every distinct storage
behind those local tensors is copied into one flat host buffer per state (pinned when the build can pin, allocated
once and reused every cycle), then freed with ``storage.resize_(0)``; reload resizes each storage back and copies
its bytes in. Whole storages, not just the views' extents: FSDP2 pads each shard to an even size and its all-gather
reads the padding too. Restoring in place keeps every alias valid (FSDP2's padded shard buffer, the DTensor's local
view, the optimizer's keys), so nothing is re-pointed and the round trip is bit-identical. Gathered (unsharded)
parameters are not state: they are freed first (``reshard()``), as FSDP2 makes them again at the next forward. While
the parameters are away a forward raises :class:`~.torch_offload.AsleepError` (the guard runs before FSDP2's own
pre-forward hook, which would gather from freed shards), as does a training forward while the gradients are and an
optimizer step while any state is; a no-gradient pass needs the parameters only. Weight export and checkpoints need
a reload first.

The same contract as :class:`~hybrid_core.offload.deepspeed_offload.DeepSpeedOffloader`: ``offload(states)`` /
``reload(states)`` for the residency owner, ``sleep()`` / ``wake()`` for everything at once.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError, HybridError
from ..stats import TransferStats
from .chunked_copy import ChunkedCopier, byte_view
from .host_buffers import HostBuffers, resolve_pin_memory
from .torch_offload import AsleepError
from .tracked import align_up

STATES = ("params", "grads", "optimizer")
_ALIGN = 512  # bytes between storages in the host buffer, as aligned as the caching allocator would place them


@dataclass
class _Away:
    """One state's storages while they are on the host: each storage, its size, and where it sits in the buffer."""

    storages: list[tuple[torch.UntypedStorage, int, int]]  # (storage, nbytes, host offset)

    @property
    def nbytes(self) -> int:
        return sum(n for _, n, _ in self.storages)


class FSDP2Offloader:
    """Moves an FSDP2 module's parameter shards (and its buffers), gradient shards and optimizer state to host
    memory and back, state by state.

    ``pin_memory``: ``None`` pins exactly when the torch build can. ``chunk_bytes``: size of each asynchronous copy.
    ``device``: whose tensors are managed (default: that of the first parameter's local shard).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        pin_memory: bool | None = None,
        chunk_bytes: int = 256 << 20,
        device: torch.device | str | None = None,
    ):
        if chunk_bytes <= 0:
            raise ConfigError("chunk_bytes", f"must be positive, got {chunk_bytes}.", "Use e.g. 256 << 20.")
        self.module, self.optimizer = module, optimizer
        self.device = torch.device(device) if device is not None else _first_local(module).device
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.pin_memory = self.device.type == "cuda" and resolve_pin_memory(pin_memory)
        self._host = {s: HostBuffers(pin_memory=self.pin_memory) for s in STATES}
        self._copier = ChunkedCopier(self.device, chunk_bytes)
        self._away: dict[str, _Away] = {}
        self.host_alloc = TransferStats(0, 0.0, "host buffers")  # allocating / pinning, timed apart from transfers
        self._hooks = self._install_guards()

    # ---- public ----------------------------------------------------------------------------------------------------
    @property
    def asleep(self) -> bool:
        return bool(self._away)

    @property
    def offloaded(self) -> tuple[str, ...]:
        return tuple(self._away)

    def device_bytes(self, states: Sequence[str] = STATES) -> int:
        """Bytes of device storage the named states hold now (0 for a state that is offloaded); frees the gathered
        copies of parameters first, as an offload would."""
        return sum(s.nbytes() for s in self._storages(_checked(states)))

    def host_bytes(self) -> int:
        """Host memory held for offloaded state (allocated at the first offload, reused every cycle)."""
        return sum(h.nbytes() for h in self._host.values())

    def sleep(self) -> TransferStats:
        return self.offload(STATES)

    def wake(self) -> TransferStats:
        return self.reload()

    def offload(self, states: Sequence[str]) -> TransferStats:
        """Copy the named states to host memory and free their device storage; states already away are skipped."""
        todo = [s for s in _checked(states) if s not in self._away]
        if not todo:
            return TransferStats(0, 0.0, "fsdp2 offload")
        taken: set[int] = set()  # a storage is moved once; those of states already away are empty and skipped
        chosen: dict[str, list[torch.UntypedStorage]] = {}
        for state in todo:
            chosen[state] = [s for s in self._storages([state]) if s.data_ptr() not in taken]
            taken.update(s.data_ptr() for s in chosen[state])
            if not all(s.resizable() for s in chosen[state]):  # refused before anything moved
                raise HybridError(
                    f"FSDP2 offload: a storage of the {state} cannot be freed in place (it is shared outside torch, "
                    "e.g. through .numpy()); clone such tensors instead of sharing their memory."
                )
        plans: dict[str, _Away] = {}
        for state, storages in chosen.items():
            entries, total = [], 0
            for s in storages:
                entries.append((s, s.nbytes(), total))
                total = align_up(total + s.nbytes(), _ALIGN)
            self._host[state].ensure(torch.uint8, total)  # pinned once, at the first offload; not a transfer
            plans[state] = _Away(entries)
        self.host_alloc = TransferStats(
            sum(h.alloc_bytes for h in self._host.values()),
            sum(h.alloc_seconds for h in self._host.values()),
            "host buffers",
        )
        start = time.perf_counter()
        self._copier.begin()
        for state, away in plans.items():
            host = self._host[state].buffers[torch.uint8]
            for s, n, off in away.storages:
                self._copier.to_host(byte_view(s, 0, n), host, off)
        self._copier.finish()  # every byte is on the host before any storage is freed
        for away in plans.values():
            for s, _, _ in away.storages:
                s.resize_(0)
        self._away.update(plans)
        self._empty_cache()
        moved = sum(a.nbytes for a in plans.values())
        return TransferStats(moved, time.perf_counter() - start, "fsdp2 offload " + "+".join(todo))

    def reload(self, states: Sequence[str] | None = None) -> TransferStats:
        """Bring the named offloaded states back (default: all of them) into the very storages they left."""
        todo = [s for s in (_checked(states) if states is not None else STATES) if s in self._away]
        if not todo:
            return TransferStats(0, 0.0, "fsdp2 reload")
        start = time.perf_counter()
        self._copier.begin()
        for state in todo:
            host = self._host[state].buffers[torch.uint8]
            for s, n, off in self._away[state].storages:
                s.resize_(n)
                self._copier.to_device(host, off, byte_view(s, 0, n))
        self._copier.finish()
        moved = sum(self._away.pop(state).nbytes for state in todo)
        return TransferStats(moved, time.perf_counter() - start, "fsdp2 reload " + "+".join(todo))

    def close(self) -> None:
        """Remove the guards and release the host buffers (reload first if the state is still needed)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for host in self._host.values():
            host.buffers.clear()

    # ---- internals -------------------------------------------------------------------------------------------------
    def _storages(self, states: Sequence[str]) -> list[torch.UntypedStorage]:
        """The distinct non-empty device storages behind the named states' local tensors, in a stable order."""
        # after a forward without backward FSDP2 keeps the root unit gathered, its parameters plain tensors: the
        # gathered copies are not state (FSDP2 makes them again), so free them and count and move only the shards
        _reshard(self.module)
        out: list[torch.UntypedStorage] = []
        seen: set[int] = set()
        for state in states:
            for t in self._locals(state):
                if t.device != self.device:
                    continue
                s = t.untyped_storage()
                if s.nbytes() > 0 and s.data_ptr() not in seen:
                    seen.add(s.data_ptr())
                    out.append(s)
        return out

    def _locals(self, state: str) -> Iterator[torch.Tensor]:
        if state == "params":
            yield from (_local(p) for p in self.module.parameters())
            yield from self.module.buffers()  # e.g. rotary inv_freq: FSDP2 leaves buffers unsharded
        elif state == "grads":
            yield from (_local(p.grad) for p in self.module.parameters() if p.grad is not None)
        elif self.optimizer is not None:
            for per_param in self.optimizer.state.values():
                for v in per_param.values():
                    # 0-dim entries are step counters: torch keeps them on the host unless capturable
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        yield _local(v)

    def _empty_cache(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _install_guards(self) -> list[Any]:  # torch's RemovableHandles
        def refuse(needed: Sequence[str]) -> None:
            away = [s for s in needed if s in self._away]
            if away:
                raise AsleepError(f"the role's {'+'.join(away)} are offloaded: reload() before using it.")

        def before_forward(module: torch.nn.Module, *_args: object) -> None:
            # a no-gradient pass (log-probs, values) needs the parameters only, as under DeepSpeed; a training
            # forward's backward would accumulate into the freed gradient shards
            refuse(("params", "grads") if torch.is_grad_enabled() and module.training else ("params",))

        # first of all pre-forward hooks: FSDP2's own would all-gather from the freed shards
        hooks = [self.module.register_forward_pre_hook(before_forward, prepend=True)]
        if self.optimizer is not None:
            hooks.append(self.optimizer.register_step_pre_hook(lambda *_a, **_k: refuse(STATES)))
        return hooks


def _checked(states: Sequence[str]) -> list[str]:
    unknown = [s for s in states if s not in STATES]
    if unknown:
        raise ConfigError("states", f"FSDP2 roles hold {', '.join(STATES)}, not {unknown}.")
    return list(states)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own shard of a DTensor (the tensor itself otherwise), sharing its storage."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t
    with torch.no_grad():
        return t.to_local()


def _reshard(module: torch.nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _first_local(module: torch.nn.Module) -> torch.Tensor:
    for p in module.parameters():
        return _local(p)
    raise ConfigError("module", "has no parameters, so the device to offload from is unknown.", "Pass device=...")
