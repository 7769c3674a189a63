"""An engine worker's side of the weight-sync group: receives the buckets and hands complete tensors to ``load``.

Receivers know the stream's metadata up front (the trainer sends the ``TensorMeta`` list through Ray), so they plan
the same buckets as the sender and check each bucket's announced layout before receiving it. The receive of bucket
i+1 is posted before bucket i is loaded, so the wire and the loading overlap. Tensors that span several buckets are
assembled in a staging tensor of their own.

Verification (when the sender's handshake says this sync is checked, the default): after each ``load``, every piece
the sender checked (its bucket's header says how many; the indices come with their checksums: ``sampling.py``) of
the tensors it loaded is checksummed again -- over the engine's own tensor when ``read_back(name)`` returns it (what
the engine really holds: a stale or incomplete load shows), else over the bytes received -- and compared with the
sender's checksums once the whole stream is in (so the sender is never left in a collective), raising
:class:`~hybrid_core.errors.WeightSyncMismatch` naming the parameters.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from .. import faults
from ..errors import ConfigError, WeightSyncMismatch
from ..stats import TransferStats
from .buckets import Bucket, Piece, check_bucket_bytes, plan_buckets
from .group import PendingWork, SyncGroup
from .meta import TensorMeta
from .sender import DEFAULT_BUCKET_BYTES
from .verify import FIX, PieceCheck, ReadBack, compare, corrupt, loaded_bytes, tensors_checksums, word_size
from .wire import HANDSHAKE_WORDS, HEADER_WORDS, check_handshake, check_header

LoadFn = Callable[[list[tuple[str, torch.Tensor]]], None]


class WeightReceiver:
    """Receives a stream broadcast by :class:`WeightSender` (rank 0) in the same ``group``.

    ``device``: where tensors that span buckets are assembled (default: the group's device); tensors that fit one
    bucket are handed to ``load`` as views into the bucket buffer, which is reused afterwards, so ``load`` must copy
    them (e.g. ``param.copy_(tensor)``) before it returns.
    """

    def __init__(
        self, group: SyncGroup, bucket_bytes: int = DEFAULT_BUCKET_BYTES, device: torch.device | str | None = None
    ):
        check_bucket_bytes(bucket_bytes)
        if group.rank == 0:
            raise ConfigError(
                "rank",
                "rank 0 of the sync group is the sender, not a receiver.",
                "Engine workers join with ranks 1..world_size-1.",
            )
        self.group, self.bucket_bytes = group, bucket_bytes
        self.device = torch.device(device) if device is not None else group.device
        self._buffers: list[torch.Tensor] = []
        self._verify = False  # set by each sync's handshake

    def receive(self, metas: Sequence[TensorMeta], load: LoadFn, read_back: ReadBack | None = None) -> TransferStats:
        """Receive one sync: calls ``load(pairs)`` once per bucket with the ``(name, tensor)`` pairs it completed.

        ``read_back(name)``: the engine's tensor that ``load`` filled for ``name`` (None: check what arrived)."""
        metas = list(metas)
        if not all(isinstance(m, TensorMeta) for m in metas):
            raise ConfigError("metas", "must be a list of TensorMeta.", "Build them with TensorMeta.of(name, tensor).")
        g = self.group
        plan = plan_buckets(metas, self.bucket_bytes)
        hello = torch.empty(HANDSHAKE_WORDS, dtype=torch.int64, device=g.device)
        g.broadcast(hello, what="weight sync handshake").wait()
        self._verify = check_handshake(hello, self.bucket_bytes, g.rank)
        if not self._buffers:
            self._buffers = [torch.empty(self.bucket_bytes, dtype=torch.uint8, device=g.device) for _ in range(2)]
        start = time.perf_counter()
        staging: dict[int, torch.Tensor] = {}
        pieces_of: dict[int, list[Piece]] = {}
        for bucket in plan:
            for p in bucket.pieces:
                pieces_of.setdefault(p.index, []).append(p)
        sent: list[torch.Tensor] = []  # per bucket with checks: the sender's checksums of its checked pieces
        chosen: dict[int, list[tuple[Piece, int]]] = {}  # tensor index -> (its checked piece, slot in cat(sent))
        slots = 0
        actual: list[torch.Tensor] = []
        checks: list[tuple[Piece, bool, int]] = []
        with torch.no_grad():
            pending = self._post(plan, 0)
            for i, bucket in enumerate(plan):
                current = pending
                pending = self._post(plan, i + 1)  # bucket i+1 streams in while bucket i is loaded
                for work in current[0]:
                    work.wait()
                buf = self._buffers[bucket.index % 2]
                if current[1] is not None:  # [indices of the checked pieces in this bucket, their checksums]
                    k = current[1].numel() // 2
                    sent.append(current[1][k:])
                    for j in current[1][:k].tolist():  # k small ints, once the bucket is in
                        p = bucket.pieces[j]
                        chosen.setdefault(p.index, []).append((p, slots))
                        slots += 1
                if faults.corrupt_due("receiver", "bucket", g.rank):  # HYBRID_FAULT=receiver:bucket:corrupt (tests)
                    p = bucket.pieces[0]
                    corrupt(buf[p.bucket_offset : p.bucket_offset + p.nbytes])
                ready = self._unpack(buf, bucket, staging)
                if ready:
                    load([(name, tensor) for _, name, tensor in ready])
                    datas: list[torch.Tensor] = []  # this bucket's checked bytes (a staging buffer is reused)
                    sizes: list[int] = []
                    for index, name, tensor in ready:
                        if index not in chosen:
                            continue
                        meta = pieces_of[index][0].meta
                        data, from_engine = loaded_bytes(name, tensor, meta, read_back)
                        for p, slot in chosen.pop(index):
                            datas.append(data[p.tensor_offset : p.tensor_offset + p.nbytes])
                            sizes.append(word_size(meta, p.tensor_offset, p.nbytes))
                            checks.append((p, from_engine, slot))
                    if datas:  # one fused launch for the bucket's pieces where the device has the kernel
                        actual.append(tensors_checksums(datas, sizes))
        if g.device.type == "cuda":
            torch.cuda.current_stream(g.device).synchronize()
        if self._verify:
            self._compare(sent, actual, checks)
        return TransferStats(sum(m.nbytes for m in metas), time.perf_counter() - start, "weight sync")

    def _compare(
        self, sent: list[torch.Tensor], actual: list[torch.Tensor], checks: list[tuple[Piece, bool, int]]
    ) -> None:
        """One host read of what the sender sent and of what was checked, then the comparison."""
        flat = torch.cat(sent).tolist() if sent else []
        if len(checks) != len(flat):
            raise WeightSyncMismatch(
                f"weight sync verify: weight-sync rank {self.group.rank}: {len(flat)} checksums "
                f"sent, {len(checks)} pieces checked. Fix: {FIX}"
            )
        expected = [flat[slot] for _, _, slot in checks]
        named = [
            PieceCheck(p.meta.name, p.bucket, p.tensor_offset, p.nbytes, p.meta.nbytes, engine)
            for p, engine, _ in checks
        ]
        compare(
            expected,
            torch.cat(actual) if actual else torch.zeros(0, dtype=torch.int64),
            named,
            f"weight-sync rank {self.group.rank}",
        )

    def _post(self, plan: list[Bucket], i: int) -> tuple[list[PendingWork], torch.Tensor | None]:
        """Receive bucket ``i``'s header, check it against the plan, then post its payload and checksums (nothing
        after the end)."""
        g = self.group
        header = torch.empty(HEADER_WORDS, dtype=torch.int64, device=g.device)
        g.broadcast(header, what=f"weight sync bucket {i} header").wait()
        expected = plan[i] if i < len(plan) else None
        try:
            checked = check_header(header, expected, len(plan), g.rank)
        except ConfigError:
            g.broken = "the sender's stream did not match this receiver's metadata"
            raise
        if expected is None:
            return [], None
        buf = self._buffers[expected.index % 2]
        works = [g.broadcast(buf[: expected.nbytes], what=f"weight sync bucket {expected.index}")]
        sums = None
        if checked:
            sums = torch.empty(2 * checked, dtype=torch.int64, device=g.device)
            works.append(g.broadcast(sums, what=f"weight sync bucket {expected.index} checksums"))
        return works, sums

    def _unpack(
        self, buf: torch.Tensor, bucket: Bucket, staging: dict[int, torch.Tensor]
    ) -> list[tuple[int, str, torch.Tensor]]:
        """The tensors this bucket completes, as ``(index in the stream, name, tensor)``."""
        ready: list[tuple[int, str, torch.Tensor]] = []
        async_ok = buf.device.type == "cuda" and self.device.type == "cuda"
        for p in bucket.pieces:
            data = buf[p.bucket_offset : p.bucket_offset + p.nbytes]
            if p.whole:
                ready.append((p.index, p.meta.name, _as(data, p.meta)))
                continue
            whole = staging.get(p.index)
            if whole is None:
                whole = staging[p.index] = torch.empty(p.meta.nbytes, dtype=torch.uint8, device=self.device)
            whole[p.tensor_offset : p.tensor_offset + p.nbytes].copy_(data, non_blocking=async_ok)
            if p.completes:
                ready.append((p.index, p.meta.name, _as(staging.pop(p.index), p.meta)))
        return ready

    def close(self) -> None:
        self._buffers = []


def _as(data: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    return data.view(meta.torch_dtype).view(meta.shape)
