"""Big device <-> host copies, issued asynchronously in large chunks on a side stream.

On CUDA the copies run on their own stream so they neither wait behind nor block the compute stream; the side
stream first waits for the compute stream (the data must be final), and :meth:`ChunkedCopier.finish` blocks until
every chunk landed, before any memory is freed or used. On CPU the same calls are plain copies.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from .host_buffers import HostBuffer


def byte_view(storage: torch.UntypedStorage, start: int, nbytes: int) -> torch.Tensor:
    """A 1-D uint8 tensor over ``storage[start:start + nbytes]`` (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, start, (nbytes,), (1,))


class ChunkedCopier:
    """Copies byte ranges between device storages and a :class:`HostBuffer` in chunks of ``chunk_bytes``."""

    def __init__(self, device: torch.device, chunk_bytes: int):
        self.device = device
        self.chunk_bytes = chunk_bytes
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None

    def begin(self) -> None:
        """Order the side stream after all work already queued on the compute stream."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def _on_side_stream(self) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def to_host(self, src: torch.Tensor, host: HostBuffer, host_offset: int) -> None:
        """Queue ``host[host_offset:] <- src`` (``src`` a 1-D uint8 device tensor)."""
        with self._on_side_stream():
            for dst, pos in host.pieces(host_offset, src.numel()):
                self._chunks(dst, src[pos : pos + dst.numel()])

    def to_device(self, host: HostBuffer, host_offset: int, dst: torch.Tensor) -> None:
        """Queue ``dst <- host[host_offset:host_offset + dst.numel()]``."""
        with self._on_side_stream():
            for src, pos in host.pieces(host_offset, dst.numel()):
                self._chunks(dst[pos : pos + src.numel()], src)

    def _chunks(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        step = self.chunk_bytes
        for lo in range(0, src.numel(), step):
            dst[lo : lo + step].copy_(src[lo : lo + step], non_blocking=True)

    def finish(self) -> None:
        """Block until every queued chunk is done."""
        if self.stream is not None:
            self.stream.synchronize()
