"""Put a plain torch role (module + optimizer) to sleep on the host and wake it again, at PCIe speed.

How it stays fast: the first wake re-homes every tracked tensor as a view into ONE flat device buffer per dtype,
so every later sleep is "copy the flat buffer to its pinned host twin in big chunks, then ``resize_(0)`` its
storage" and every wake is "``resize_`` it back and copy in". No per-tensor work, no allocation in the loop: the
host buffers are allocated (and pinned) once, at construction, and reused every cycle.

Memory is freed by ``storage.resize_(0)`` (as FSDP does), so every alias of a storage sees it go and come back:
tied weights, views, ``.data`` handles. Re-homing a tensor into the flat buffer would leave an alias that we cannot
see (a ``w = param.data`` kept elsewhere) pointing at freed memory, so a storage that has such references is
restored in place instead, as its own "home" (found from torch's storage use count). While asleep the tensors keep
their shapes but hold no bytes; a forward pass or an optimizer step on a sleeping role raises :class:`AsleepError`.

If the set of tensors changed since the last wake (the optimizer created its state, gradients appeared or were
dropped) the next sleep copies region by region and the next wake builds a new flat buffer: correct, and only a
little slower, once.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ConfigError, HybridError
from ..stats import TransferStats
from .chunked_copy import ChunkedCopier, byte_view
from .host_buffers import HostBuffers, resolve_pin_memory
from .tracked import Region, TensorView, align_up, external_refs, group_regions, lay_out, tracked_tensors

_ALIGN = 512  # bytes; keeps every tensor in a flat buffer as aligned as the caching allocator would

#: which tensors lie where: entries (tensor id, (dtype, home index), byte offset, shape, stride)
_Signature = frozenset[tuple[Any, ...]]


class AsleepError(HybridError, RuntimeError):
    """The module or optimizer was used while its state is offloaded; call ``wake()`` first."""


@dataclass
class _Home:
    """A device storage that tracked tensors live in across cycles, and the byte spans of it that hold state.

    Normally one per dtype: the flat buffer (one span, all of it). A storage that something outside the module and
    optimizer also references is restored in place instead (its own home), so that reference stays valid.
    """

    storage: torch.UntypedStorage
    nbytes: int
    spans: list[tuple[int, int]]  # (start, nbytes) within the storage
    host_offsets: list[int] = field(default_factory=list)  # where each span sits in the host buffer


@dataclass
class _Group:
    """One dtype's homes and which tensor views they hold (to detect changes at the next sleep)."""

    homes: list[_Home]
    signature: _Signature


class StateOffloader:
    """Moves a module's parameters, buffers and gradients and an optimizer's parameters and state to host and back.

    ``module`` and/or ``optimizer``: what to manage (at least one). ``pin_memory``: ``None`` pins exactly when the
    torch build can (CPU-only builds cannot). ``chunk_bytes``: size of each asynchronous copy. ``device``: the device
    whose tensors are managed (default: that of the first parameter). Host memory for the state that exists now is
    allocated at construction (``host_alloc`` says how long it took); state created later (e.g. Adam moments after
    the first step) gets host memory at its first sleep.
    """

    def __init__(
        self,
        module: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        pin_memory: bool | None = None,
        chunk_bytes: int = 256 << 20,
        device: torch.device | str | None = None,
    ):
        if module is None and optimizer is None:
            raise ConfigError(
                "StateOffloader", "got neither a module nor an optimizer.", "Pass the module, the optimizer, or both."
            )
        if chunk_bytes <= 0:
            raise ConfigError("chunk_bytes", f"must be positive, got {chunk_bytes}.", "Use e.g. 256 << 20.")
        self.module, self.optimizer = module, optimizer
        self.device = torch.device(device) if device is not None else _first_param_device(module, optimizer)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.pin_memory = self.device.type == "cuda" and resolve_pin_memory(pin_memory)
        self._host = HostBuffers(pin_memory=self.pin_memory)
        self._copier = ChunkedCopier(self.device, chunk_bytes)
        self._groups: dict[torch.dtype, _Group] = {}
        self._pending: dict[torch.dtype, tuple[list[Region], int]] = {}  # regions moved by a per-region sleep
        self._asleep = False
        for dtype, regions in group_regions(self._tracked()).items():
            self._host.ensure(dtype, lay_out(regions, _ALIGN))
        self.host_alloc = TransferStats(self._host.alloc_bytes, self._host.alloc_seconds, "host buffers")
        self._hooks = self._install_guards()

    # ---- public ----------------------------------------------------------------------------------------------------
    @property
    def asleep(self) -> bool:
        return self._asleep

    def device_bytes(self) -> int:
        """Bytes of device state this offloader manages (as laid out at the last sleep/wake, else as it is now)."""
        if self._groups or self._pending:
            homes = sum(sum(n for _, n in h.spans) for g in self._groups.values() for h in g.homes)
            return homes + sum(r.nbytes for regions, _ in self._pending.values() for r in regions)
        return sum(r.nbytes for rs in group_regions(self._tracked()).values() for r in rs)

    def host_bytes(self) -> int:
        """Host memory held for the offloaded state (allocated once, reused every cycle)."""
        return self._host.nbytes()

    def sleep(self) -> TransferStats:
        """Copy the state to host and free its device memory. A no-op (0 bytes) when already asleep."""
        if self._asleep:
            return TransferStats(0, 0.0, "sleep")
        start = time.perf_counter()
        moved = 0
        tracked = self._tracked()
        self._copier.begin()
        if self._unchanged(tracked):  # steady state: skip the region analysis entirely
            for dtype, group in self._groups.items():
                moved += self._homes_to_host(dtype, group.homes)
        else:
            regions_by_dtype = group_regions(tracked)
            for dtype, regions in regions_by_dtype.items():
                known = self._groups.get(dtype)
                if known is not None and _signature(regions, dtype, known.homes) == known.signature:
                    moved += self._homes_to_host(dtype, known.homes)
                else:  # first sleep, or the tensors changed: copy region by region, re-home at wake
                    self._groups.pop(dtype, None)
                    total = lay_out(regions, _ALIGN)
                    host = self._host.ensure(dtype, total)
                    for r in regions:
                        self._copier.to_host(byte_view(r.storage, r.start, r.nbytes), host, r.offset)
                        moved += r.nbytes
                    self._pending[dtype] = (regions, total)
            for dtype in set(self._groups) - set(regions_by_dtype):
                del self._groups[dtype]  # every tensor of that dtype is gone: nothing to restore
        self._copier.finish()
        for group in self._groups.values():
            for home in group.homes:
                home.storage.resize_(0)
        for regions, _ in self._pending.values():
            _free(regions)
        self._empty_cache()
        self._asleep = True
        return TransferStats(moved, time.perf_counter() - start, "sleep")

    def wake(self) -> TransferStats:
        """Copy the state back to the device; the module and optimizer then work exactly as before ``sleep()``."""
        if not self._asleep:
            return TransferStats(0, 0.0, "wake")
        start = time.perf_counter()
        moved = 0
        self._copier.begin()
        for dtype, group in self._groups.items():
            host = self._host.buffers[dtype]
            for home in group.homes:
                home.storage.resize_(home.nbytes)
                for (lo, n), off in zip(home.spans, home.host_offsets):
                    self._copier.to_device(host, off, byte_view(home.storage, lo, n))
                    moved += n
        rehomed = []
        for dtype, (regions, _) in self._pending.items():
            group, flat_regions, flat = self._restore_regions(dtype, regions)
            moved += sum(r.nbytes for r in regions)
            self._groups[dtype] = group
            rehomed.append((flat, flat_regions))
        self._pending = {}
        for flat, flat_regions in rehomed:  # metadata only; the copies above are still running
            _point_into(flat, flat_regions)
        self._copier.finish()
        self._asleep = False
        return TransferStats(moved, time.perf_counter() - start, "wake")

    # ---- the residency owner's names: a plain torch role moves as one piece ----------------------------------------
    def offload(self, states: Sequence[str] = ("params",)) -> TransferStats:
        """Everything this offloader manages leaves together (``states`` names it, e.g. a frozen model's "params")."""
        return self.sleep()

    def reload(self, states: Sequence[str] | None = None) -> TransferStats:
        return self.wake()

    def close(self) -> None:
        """Remove the guards and release the host buffers (wake first if the state is still needed)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._host.buffers.clear()

    # ---- internals -------------------------------------------------------------------------------------------------
    def _tracked(self) -> list[torch.Tensor]:
        return tracked_tensors(self.module, self.optimizer, self.device)

    def _unchanged(self, tracked: list[torch.Tensor]) -> bool:
        """True when every tracked tensor lies exactly where the last wake put it (and no other tensor appeared)."""
        if not self._groups or self._pending:
            return False
        home_of = {h.storage.data_ptr(): (dtype, i) for dtype, g in self._groups.items() for i, h in enumerate(g.homes)}
        expected: _Signature = frozenset().union(*(g.signature for g in self._groups.values()))
        seen: set[tuple[Any, ...]] = set()
        for t in tracked:
            storage = t.untyped_storage()
            if t.numel() == 0 or storage.nbytes() == 0:
                continue
            home = home_of.get(storage.data_ptr())
            if home is None:
                return False
            seen.add((id(t), home, t.data_ptr() - storage.data_ptr(), tuple(t.shape), tuple(t.stride())))
        return seen == expected

    def _homes_to_host(self, dtype: torch.dtype, homes: list[_Home]) -> int:
        """Steady state: a few big copies (the flat buffer, plus any storage restored in place)."""
        total = 0
        for home in homes:
            home.host_offsets = []
            for _, n in home.spans:
                home.host_offsets.append(total)
                total = align_up(total + n, _ALIGN)
        host = self._host.ensure(dtype, total)
        moved = 0
        for home in homes:
            for (lo, n), off in zip(home.spans, home.host_offsets):
                self._copier.to_host(byte_view(home.storage, lo, n), host, off)
                moved += n
        return moved

    def _restore_regions(
        self, dtype: torch.dtype, regions: list[Region]
    ) -> tuple[_Group, list[Region], torch.UntypedStorage | None]:
        """After a per-region sleep: regions go into one new flat buffer, except those of storages that something
        else also references, which are restored in place. Queues the copies; returns the new group."""
        host = self._host.buffers[dtype]
        by_storage: dict[int, list[Region]] = {}
        for r in regions:
            by_storage.setdefault(id(r.storage), []).append(r)
        homes: list[_Home] = []
        flat_regions: list[Region] = []
        # (view, home index counting the flat buffer as 0) of storages restored in place
        sig: list[tuple[TensorView, int]] = []
        for rs in by_storage.values():
            storage = rs[0].storage
            if _resizable(storage) and external_refs(storage, rs) > 0:
                storage.resize_(rs[0].storage_nbytes)
                for r in rs:
                    self._copier.to_device(host, r.offset, byte_view(storage, r.start, r.nbytes))
                    sig.extend((v, len(homes) + 1) for v in r.views)
                homes.append(_Home(storage, rs[0].storage_nbytes, [(r.start, r.nbytes) for r in rs]))
            else:
                flat_regions.extend(rs)
        flat = None
        if flat_regions:
            host_offsets = [r.offset for r in flat_regions]
            total = lay_out(flat_regions, _ALIGN)  # now offsets in the new flat buffer
            flat = torch.empty(total, dtype=torch.uint8, device=self.device).untyped_storage()
            for r, off in zip(flat_regions, host_offsets):
                self._copier.to_device(host, off, byte_view(flat, r.offset, r.nbytes))
            homes.insert(0, _Home(flat, total, [(0, total)]))
        shift = 0 if flat is not None else 1  # without a flat buffer the kept homes are numbered from 0
        signature = frozenset((id(v.tensor), (dtype, home - shift), v.start, v.shape, v.stride) for v, home in sig)
        signature |= frozenset(
            (id(v.tensor), (dtype, 0), r.offset + v.start - r.start, v.shape, v.stride)
            for r in flat_regions
            for v in r.views
        )
        return _Group(homes, signature), flat_regions, flat

    def _empty_cache(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _install_guards(self) -> list[Any]:  # torch's RemovableHandles
        def refuse(*_args: object, **_kwargs: object) -> None:
            if self._asleep:
                raise AsleepError("the role's state is offloaded (asleep): call wake() before using it.")

        hooks = []
        if self.module is not None:
            hooks.append(self.module.register_forward_pre_hook(refuse))
        if self.optimizer is not None:
            hooks.append(self.optimizer.register_step_pre_hook(refuse))
        return hooks


def _signature(regions: list[Region], dtype: torch.dtype, homes: list[_Home]) -> _Signature | None:
    """Which tensors lie where: (id, (dtype, home), byte offset, shape, stride); None if one is outside the homes."""
    home_of = {h.storage.data_ptr(): (dtype, i) for i, h in enumerate(homes)}
    sig: list[tuple[Any, ...]] = []
    for r in regions:
        home = home_of.get(r.storage.data_ptr())
        if home is None:
            return None
        sig.extend((id(v.tensor), home, v.start, v.shape, v.stride) for v in r.views)
    return frozenset(sig)


def _resizable(storage: torch.UntypedStorage) -> bool:
    return bool(getattr(storage, "resizable", lambda: True)())


def _free(regions: list[Region]) -> None:
    """Release the regions' storages; every alias of them sees the memory go."""
    for r in regions:
        if r.storage.nbytes() == 0:
            continue
        try:
            r.storage.resize_(0)
        except RuntimeError:  # storages that torch did not allocate (e.g. from_blob) cannot resize: detach the views
            with torch.no_grad():
                for v in r.views:
                    v.tensor.set_(torch.empty(0, dtype=v.tensor.dtype, device=v.tensor.device))


def _point_into(storage: torch.UntypedStorage, regions: list[Region]) -> None:
    """Make every tracked tensor a view into ``storage`` at its region's new offset (same shape and strides)."""
    with torch.no_grad():
        for r in regions:
            for v in r.views:
                byte_offset = r.offset + v.start - r.start
                v.tensor.set_(storage, byte_offset // v.tensor.element_size(), v.shape, v.stride)


def _first_param_device(module: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None) -> torch.device:
    params = list(module.parameters()) if module is not None else []
    if optimizer is not None:
        params += [p for g in optimizer.param_groups for p in g["params"]]
    if not params:
        raise ConfigError(
            "module", "has no parameters, so the device to offload from is unknown.", "Pass device=... explicitly."
        )
    return params[0].device
