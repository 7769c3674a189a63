"""An engine worker's side of the weight-sync group: receives the buckets and hands complete tensors to ``load``.

Receivers know the stream's metadata up front (the trainer sends the ``TensorMeta`` list through Ray), so they plan
the same buckets as the sender and check each bucket's announced layout before receiving it. The receive of bucket
i+1 is posted before bucket i is loaded, so the wire and the loading overlap. Tensors that span several buckets are
assembled in a staging tensor of their own.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from ..errors import ConfigError
from ..stats import TransferStats
from .buckets import Bucket, check_bucket_bytes, plan_buckets
from .group import PendingWork, SyncGroup
from .meta import TensorMeta
from .sender import DEFAULT_BUCKET_BYTES
from .wire import check_handshake, check_header

LoadFn = Callable[[list[tuple[str, torch.Tensor]]], None]


class WeightReceiver:
    """Receives a stream broadcast by :class:`WeightSender` (rank 0) in the same ``group``.

    ``device``: where tensors that span buckets are assembled (default: the group's device); tensors that fit one
    bucket are handed to ``load`` as views into the bucket buffer, which is reused afterwards, so ``load`` must copy
    them (e.g. ``param.copy_(tensor)``) before it returns.
    """

    def __init__(self, group: SyncGroup, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 device: torch.device | str | None = None):
        check_bucket_bytes(bucket_bytes)
        if group.rank == 0:
            raise ConfigError("rank", "rank 0 of the sync group is the sender, not a receiver.",
                              "Engine workers join with ranks 1..world_size-1.")
        self.group, self.bucket_bytes = group, bucket_bytes
        self.device = torch.device(device) if device is not None else group.device
        self._buffers: list[torch.Tensor] = []

    def receive(self, metas: Sequence[TensorMeta], load: LoadFn) -> TransferStats:
        """Receive one sync: calls ``load(pairs)`` once per bucket with the ``(name, tensor)`` pairs it completed."""
        metas = list(metas)
        if not all(isinstance(m, TensorMeta) for m in metas):
            raise ConfigError("metas", "must be a list of TensorMeta.", "Build them with TensorMeta.of(name, tensor).")
        g = self.group
        plan = plan_buckets(metas, self.bucket_bytes)
        hello = torch.empty(3, dtype=torch.int64, device=g.device)
        g.broadcast(hello, what="weight sync handshake").wait()
        check_handshake(hello, self.bucket_bytes, g.rank)
        if not self._buffers:
            self._buffers = [torch.empty(self.bucket_bytes, dtype=torch.uint8, device=g.device) for _ in range(2)]
        start = time.perf_counter()
        staging: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            pending = self._post(plan, 0)
            for i, bucket in enumerate(plan):
                current = pending
                pending = self._post(plan, i + 1)  # bucket i+1 streams in while bucket i is loaded
                current.wait()
                ready = self._unpack(self._buffers[bucket.index % 2], bucket, staging)
                if ready:
                    load(ready)
        if g.device.type == "cuda":
            torch.cuda.current_stream(g.device).synchronize()
        return TransferStats(sum(m.nbytes for m in metas), time.perf_counter() - start, "weight sync")

    def _post(self, plan: list[Bucket], i: int) -> PendingWork | None:
        """Receive bucket ``i``'s header, check it against the plan, then post its payload (None after the end)."""
        g = self.group
        header = torch.empty(3, dtype=torch.int64, device=g.device)
        g.broadcast(header, what=f"weight sync bucket {i} header").wait()
        expected = plan[i] if i < len(plan) else None
        try:
            check_header(header, expected, len(plan), g.rank)
        except ConfigError:
            g.broken = "the sender's stream did not match this receiver's metadata"
            raise
        if expected is None:
            return None
        buf = self._buffers[expected.index % 2]
        return g.broadcast(buf[:expected.nbytes], what=f"weight sync bucket {expected.index}")

    def _unpack(self, buf: torch.Tensor, bucket: Bucket, staging: dict[int, torch.Tensor]):
        ready: list[tuple[str, torch.Tensor]] = []
        async_ok = buf.device.type == "cuda" and self.device.type == "cuda"
        for p in bucket.pieces:
            data = buf[p.bucket_offset:p.bucket_offset + p.nbytes]
            if p.whole:
                ready.append((p.meta.name, _as(data, p.meta)))
                continue
            whole = staging.get(p.index)
            if whole is None:
                whole = staging[p.index] = torch.empty(p.meta.nbytes, dtype=torch.uint8, device=self.device)
            whole[p.tensor_offset:p.tensor_offset + p.nbytes].copy_(data, non_blocking=async_ok)
            if p.completes:
                ready.append((p.meta.name, _as(staging.pop(p.index), p.meta)))
        return ready

    def close(self) -> None:
        self._buffers = []


def _as(data: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    return data.view(meta.torch_dtype).view(meta.shape)
