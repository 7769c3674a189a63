"""Which tensors a role holds on its device, and how they lie in their storages.

A role's state is: the module's parameters and *all* its buffers (non-persistent ones such as Llama's rotary
``inv_freq`` included, which a state-dict round trip would lose), the gradients, the optimizer's own parameters
(e.g. fp32 master copies of bf16 weights) and every tensor in the optimizer's per-parameter state.

Tensors can alias (views, tied weights, flat buffers), so the unit moved is a *region*: the merged byte extents
that the tracked tensors cover in one storage. Moving regions instead of tensors keeps aliasing intact.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch


def tracked_tensors(
    module: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None, device: torch.device
) -> list[torch.Tensor]:
    """Every distinct tensor object of the role on ``device``, in a stable order (params, buffers, grads, state)."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()

    def add(t: object) -> None:
        if isinstance(t, torch.Tensor) and t.device == device and id(t) not in seen:
            seen.add(id(t))
            out.append(t)

    params: list[torch.Tensor] = []
    if module is not None:
        params.extend(module.parameters())
    if optimizer is not None:
        params.extend(p for group in optimizer.param_groups for p in group["params"])
    for p in params:
        add(p)
    if module is not None:
        for b in module.buffers():
            add(b)
    for p in params:
        add(p.grad)
    if optimizer is not None:
        for p in params:
            for value in optimizer.state.get(p, {}).values():
                for t in value if isinstance(value, (list, tuple)) else (value,):
                    add(t)
    return out


def byte_extent(t: torch.Tensor) -> tuple[int, int]:
    """``[start, end)`` in bytes of the part of its storage that ``t`` can reach."""
    item = t.element_size()
    start = t.storage_offset() * item
    if t.numel() == 0:
        return start, start
    span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return start, start + span * item


@dataclass(frozen=True)
class TensorView:
    """A tracked tensor and where it lies in its storage, recorded before the storage is freed."""

    tensor: torch.Tensor
    start: int  # byte offset in the storage
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorView:
        return cls(t, byte_extent(t)[0], tuple(t.shape), tuple(t.stride()))


@dataclass
class Region:
    """A byte range of one storage and the tracked tensors inside it (``start`` is absolute in the storage)."""

    storage: torch.UntypedStorage
    start: int
    end: int
    views: list[TensorView] = field(default_factory=list)
    offset: int = 0  # where the range goes in a flat buffer (set by the layout)
    storage_nbytes: int = 0  # the storage's size when grouped, to restore it in place

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def group_regions(tensors: Iterable[torch.Tensor]) -> dict[torch.dtype, list[Region]]:
    """Merge the tensors' extents per storage into regions, grouped by the dtype of each storage's first tensor."""
    by_storage: dict[int, list[torch.Tensor]] = {}
    storage_of: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or t.numel() == 0:
            continue
        key = storage.data_ptr()
        by_storage.setdefault(key, []).append(t)
        storage_of.setdefault(key, storage)
    groups: dict[torch.dtype, list[Region]] = {}
    for key, ts in by_storage.items():
        regions: list[Region] = []
        for t in sorted(ts, key=lambda t: byte_extent(t)[0]):
            lo, hi = byte_extent(t)
            if regions and lo <= regions[-1].end:  # overlaps or touches the previous extent: one region
                regions[-1].end = max(regions[-1].end, hi)
                regions[-1].views.append(TensorView.of(t))
            else:
                regions.append(
                    Region(storage_of[key], lo, hi, [TensorView.of(t)], storage_nbytes=storage_of[key].nbytes())
                )
        groups.setdefault(ts[0].dtype, []).extend(regions)
    return groups


def align_up(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def lay_out(regions: list[Region], alignment: int, offset: int = 0) -> int:
    """Give each region an aligned offset in a flat buffer (from ``offset``); returns the buffer's size in bytes."""
    for r in regions:
        # keep the region's position modulo the alignment so element alignment inside it is preserved
        offset = align_up(offset, alignment) + r.start % alignment
        r.offset = offset
        offset += r.nbytes
    return align_up(offset, alignment)


def external_refs(storage: torch.UntypedStorage, regions: list[Region]) -> int:
    """How many references to ``storage`` exist besides the regions' tracked tensors and our one storage handle.

    Those are aliases we cannot see (e.g. ``w = param.data`` kept somewhere): such a storage must be restored in
    place, not re-homed, or they would be left pointing at freed memory. 0 when torch cannot tell.
    """
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return 0
    tensors = {id(v.tensor) for r in regions for v in r.views}
    uses: int = use_count(storage._cdata)
    return max(uses - len(tensors) - 1, 0)
