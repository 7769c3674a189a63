"""Host memory that offloaded state lands in: flat, allocated once, pinned when the torch build can pin.

A :class:`HostBuffer` is one logical flat byte range. It is stored as a few power-of-two *segments* because torch's
pinned-memory allocator rounds every request up to a power of two: a single 11.4 GB pinned tensor would really take
16 GB of locked host memory, while 8 + 2 + 1 + 0.25 + ... GB segments take exactly what is asked (to 2 MiB).
Callers see byte offsets into the flat range; :meth:`HostBuffer.pieces` splits a range at segment borders.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

# Segments are at most this large and at least _MIN_SEGMENT (sizes are rounded up to it).
_MAX_SEGMENT = 1 << 30
_MIN_SEGMENT = 2 << 20


def can_pin_memory() -> bool:
    """Whether this torch build can allocate page-locked host memory (CPU-only builds cannot)."""
    if not torch.cuda.is_available():
        return False
    try:
        torch.empty(1, dtype=torch.uint8, pin_memory=True)
    except RuntimeError:
        return False
    return True


def resolve_pin_memory(pin_memory: bool | None) -> bool:
    """``None`` means pin exactly when possible; ``True`` on a build that cannot pin falls back with no error."""
    if pin_memory is None or pin_memory:
        return can_pin_memory()
    return False


def segment_sizes(nbytes: int) -> list[int]:
    """Power-of-two pieces, largest first, that add up to ``nbytes`` rounded up to 2 MiB."""
    total = -(-nbytes // _MIN_SEGMENT) * _MIN_SEGMENT
    sizes = [_MAX_SEGMENT] * (total // _MAX_SEGMENT)
    rest = total % _MAX_SEGMENT
    bit = _MAX_SEGMENT >> 1
    while rest:
        if rest & bit:
            sizes.append(bit)
            rest -= bit
        bit >>= 1
    return sizes


class HostBuffer:
    """A flat host byte range of a fixed capacity, made of pinned (or plain) power-of-two segments."""

    def __init__(self, nbytes: int, *, pin_memory: bool):
        start = time.perf_counter()
        self.pinned = pin_memory
        self.segments: list[torch.Tensor] = [
            torch.empty(size, dtype=torch.uint8, pin_memory=pin_memory) for size in segment_sizes(nbytes)
        ]
        self.capacity = sum(s.numel() for s in self.segments)
        self.alloc_seconds = time.perf_counter() - start

    def pieces(self, offset: int, nbytes: int) -> Iterator[tuple[torch.Tensor, int]]:
        """``(host view, position within the requested range)`` pairs covering ``[offset, offset + nbytes)``."""
        if offset < 0 or offset + nbytes > self.capacity:
            raise IndexError(
                f"host range [{offset}, {offset + nbytes}) is outside the buffer (capacity {self.capacity})"
            )
        seg_start = 0
        done = 0
        for seg in self.segments:
            seg_end = seg_start + seg.numel()
            lo, hi = max(offset + done, seg_start), min(offset + nbytes, seg_end)
            if lo < hi:
                yield seg[lo - seg_start : hi - seg_start], lo - offset
                done = hi - offset
            if done == nbytes:
                return
            seg_start = seg_end


class HostBuffers:
    """One :class:`HostBuffer` per dtype group, grown only when the state outgrows it (then reported)."""

    def __init__(self, *, pin_memory: bool):
        self.pin_memory = pin_memory
        self.buffers: dict[torch.dtype, HostBuffer] = {}
        self.alloc_seconds = 0.0  # total time spent allocating / pinning, reported apart from transfers
        self.alloc_bytes = 0

    def ensure(self, dtype: torch.dtype, nbytes: int) -> HostBuffer:
        """The buffer for ``dtype``, reallocated only if it is smaller than ``nbytes``."""
        buf = self.buffers.get(dtype)
        if buf is None or buf.capacity < nbytes:
            self.buffers.pop(dtype, None)  # drop the old one first so both are never held at once
            buf = HostBuffer(nbytes, pin_memory=self.pin_memory)
            self.buffers[dtype] = buf
            self.alloc_seconds += buf.alloc_seconds
            self.alloc_bytes += buf.capacity
        return buf

    def nbytes(self) -> int:
        return sum(b.capacity for b in self.buffers.values())
