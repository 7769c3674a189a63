"""Every weight sync is verified: each engine holds what the trainer sent.

Stale or half-loaded engine weights fail silently -- the run goes on, generating with the wrong model (TRL #5312:
weights stale after a sleep; verl #7495: a LoRA adapter that never arrived). So the sender computes, on the device,
one checksum per tensor piece of every bucket over the bytes it packed and sends them with the bucket; the receiver
recomputes each one over what it holds after the load -- read back from the engine's own parameter (``read_back``,
which is what catches a stale or incomplete load), else over the bytes that arrived -- and a mismatch ends the sync
with :class:`~hybrid_core.errors.WeightSyncMismatch` naming the parameter.

The checksum of a piece: its bytes as words of the tensor's element size (int8/16/32/64; bytes when a split
falls inside an element), ``sum((2k + 1) * w_k) mod 2**64``.

* A flipped byte changes one word by d != 0 (|d| < 2**32), the sum by d * (2k + 1): an odd factor, never 0 mod 2**64.
* Two swapped values (words k and j) change it by (w_j - w_k) * 2 * (k - j): at most 31 + 1 + 33 factors of two are
  needed to vanish, more than a piece of < 2**32 words has. (A byte-level weighting would miss swapping 0x0102 and
  0x0201; that is why words are whole elements.)
* Integer addition mod 2**64 is associative, so the CPU and the GPU, in any reduction order, agree exactly.

Cost: two reductions over the data (the row and column sums of a ``[rows, 512]`` view: sum(k * w_k) splits into
row index x row sums + column index x column sums), no temporary the size of the data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..errors import WeightSyncMismatch
from .meta import TensorMeta

COLUMNS = 512
_WORDS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
ReadBack = Callable[[str], "torch.Tensor | None"]
FIX = ("A byte changed between the trainer and the engine's parameters (the transport, the engine's loading code, "
       "or the hardware): report it with the run's logs. --no_verify_weight_sync turns this check off (not advised).")


def word_size(meta: TensorMeta, tensor_offset: int, nbytes: int) -> int:
    """Word size for a piece: the element size, or 1 when the piece does not start and end on element boundaries."""
    size = meta.torch_dtype.itemsize
    return size if size in _WORDS and tensor_offset % size == 0 and nbytes % size == 0 else 1


def checksum(data: torch.Tensor, itemsize: int = 1) -> torch.Tensor:
    """The checksum (a 0-d int64 tensor on ``data``'s device, not synchronized) of a flat, contiguous uint8 tensor
    read as ``itemsize``-byte words."""
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise ValueError("checksum takes a flat uint8 tensor (weight_sync.wire.tensor_bytes(tensor))")
    if data.data_ptr() % itemsize:
        data = data.clone()  # a view at an unaligned byte offset cannot be read as words
    words = data.view(_WORDS[itemsize])
    n, device = words.numel(), words.device
    rows = n // COLUMNS
    parts = []
    if rows:
        block = words[:rows * COLUMNS].view(rows, COLUMNS)
        row_w = torch.arange(0, 2 * COLUMNS * rows, 2 * COLUMNS, dtype=torch.int64, device=device)  # 2 * C * r
        parts.append((block.sum(1, dtype=torch.int64) * row_w).sum())
        parts.append((block.sum(0, dtype=torch.int64) * _column_weights(device)).sum())  # 2 * c + 1
    if n > rows * COLUMNS:
        start = rows * COLUMNS
        tail_w = torch.arange(2 * start + 1, 2 * n + 1, 2, dtype=torch.int64, device=device)
        parts.append((words[start:].to(torch.int64) * tail_w).sum())
    if not parts:
        return torch.zeros((), dtype=torch.int64, device=device)
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total


_COLUMN_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _column_weights(device: torch.device) -> torch.Tensor:
    w = _COLUMN_WEIGHTS.get(device)
    if w is None:
        w = _COLUMN_WEIGHTS[device] = torch.arange(1, 2 * COLUMNS, 2, dtype=torch.int64, device=device)
    return w


def piece_checksum(buffer: torch.Tensor, offset: int, meta: TensorMeta, tensor_offset: int,
                   nbytes: int) -> torch.Tensor:
    """The checksum of the piece at ``buffer[offset:offset + nbytes]`` (bytes ``tensor_offset``.. of ``meta``'s
    tensor)."""
    return checksum(buffer[offset:offset + nbytes], word_size(meta, tensor_offset, nbytes))


def bucket_checksums(buffer: torch.Tensor, pieces: Sequence) -> torch.Tensor:
    """One checksum per piece (``Piece``: ``bucket_offset``, ``meta``, ``tensor_offset``, ``nbytes``) packed in the
    flat uint8 ``buffer``, as one int64 tensor on its device (not synchronized)."""
    if not pieces:
        return torch.zeros(0, dtype=torch.int64, device=buffer.device)
    return torch.stack([piece_checksum(buffer, p.bucket_offset, p.meta, p.tensor_offset, p.nbytes) for p in pieces])


def loaded_bytes(name: str, received: torch.Tensor, meta: TensorMeta, read_back: ReadBack | None
                 ) -> tuple[torch.Tensor, bool]:
    """The bytes to check for a tensor after its load: the engine's own tensor of that name when ``read_back`` gives
    one of the sent dtype and size (what the engine really holds), else the bytes that arrived. Also says which."""
    from .wire import tensor_bytes

    target = read_back(name) if read_back is not None else None
    if (target is not None and target.dtype == meta.torch_dtype and target.numel() == meta.numel
            and target.is_contiguous()):
        return tensor_bytes(target), True
    if target is not None and target.numel() == meta.numel:  # loaded with a cast: the load must equal the cast
        same = _same_bits(target, received.to(target.dtype))
        return _tagged(tensor_bytes(received), same), False
    return tensor_bytes(received), False


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    from .wire import tensor_bytes

    return torch.equal(tensor_bytes(a), tensor_bytes(b))


def _tagged(data: torch.Tensor, same: bool) -> torch.Tensor:
    """``data`` itself when the cast load was right, else a copy with one byte changed (so its checksum differs)."""
    if same:
        return data
    data = data.clone()
    corrupt(data)
    return data


@dataclass(frozen=True)
class PieceCheck:
    """What one mismatch report names: the tensor, the bytes of it, the bucket and how it was read."""

    name: str
    bucket: int
    tensor_offset: int
    nbytes: int
    total_bytes: int
    read_back: bool

    def describe(self) -> str:
        part = "" if self.nbytes == self.total_bytes else \
            f" bytes {self.tensor_offset}-{self.tensor_offset + self.nbytes} of {self.total_bytes}"
        how = "the engine's parameter" if self.read_back else "the bytes received"
        return f"{self.name}{part} (bucket {self.bucket}, checked in {how})"


def mismatch_error(where: str, bad: Sequence[PieceCheck], checked: int) -> WeightSyncMismatch:
    shown = "; ".join(c.describe() for c in bad[:3]) + (f"; and {len(bad) - 3} more" if len(bad) > 3 else "")
    return WeightSyncMismatch(f"weight sync verify: {where}: {len(bad)} of {checked} tensor piece(s) differ from what "
                              f"the trainer sent: {shown}. Fix: {FIX}")


def compare(expected: Sequence[int], actual: torch.Tensor, checks: Sequence[PieceCheck], where: str) -> None:
    """Raise :class:`WeightSyncMismatch` naming every piece whose checksum differs (one host read of ``actual``)."""
    got = actual.tolist() if actual.numel() else []
    bad = [c for c, e, a in zip(checks, expected, got) if e != a]
    if len(got) != len(expected):
        raise WeightSyncMismatch(f"weight sync verify: {where}: {len(expected)} checksums sent, {len(got)} checked. "
                                 f"Fix: {FIX}")
    if bad:
        raise mismatch_error(where, bad, len(checks))


def corrupt(data: torch.Tensor) -> None:
    """Test-only fault: flip the lowest bit of the middle byte of a flat uint8 tensor (a change no value comparison
    with a tolerance would see)."""
    if data.numel():
        mid = data.numel() // 2
        data[mid:mid + 1].bitwise_xor_(1)


def as_mismatch(error: BaseException) -> WeightSyncMismatch | None:
    """``error`` as a :class:`WeightSyncMismatch` when it is one or a remote call's failure caused by one (Ray and
    vLLM's executors may hand the callee's exception on as text only); None for any other error."""
    if isinstance(error, WeightSyncMismatch):
        return error
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, WeightSyncMismatch) or "WeightSyncMismatch" in str(seen):
            text = str(error).strip()
            return WeightSyncMismatch(text.splitlines()[-1] if text else "weight sync verify failed")
        seen = seen.__cause__
    return None
