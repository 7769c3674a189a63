"""Every weight sync is verified: each engine holds what the trainer sent.

Stale or half-loaded engine weights fail silently -- the run goes on, generating with the wrong model (TRL #5312:
weights stale after a sleep; verl #7495: a LoRA adapter that never arrived). So the sender computes, on the device,
one checksum per checked tensor piece of a bucket over the bytes it packed and sends them with the bucket; the
receiver recomputes each one over what it holds after the load -- read back from the engine's own parameter
(``read_back``, which is what catches a stale or incomplete load), else over the bytes that arrived -- and a mismatch
ends the sync with :class:`~hybrid_core.errors.WeightSyncMismatch` naming the parameter. Which pieces a sync checks
(all of them, or a rotating sample) is ``sampling.py``'s.

The checksum of a piece of ``n`` bytes read as words of ``s`` bytes (the element size, 1 when a split falls inside an
element), with b_p the byte at position p read as a signed int8 (-128..127)::

    C = sum_p G(p) * b_p  mod 2**64,   G(p) = (2 * (p // s) + 1) * 256**(p % s)

i.e. ``sum_k (2k + 1) * V_k`` over the words, V_k = sum_i 256**i * b_{k,i} being the word's bytes as balanced base-256
digits (a one-to-one encoding of the word: different bytes, different V).

Guarantees (s in 1, 2, 4, 8; a difference d of two bytes has |d| <= 255, so at most 7 factors of two):

* A changed byte (any new value, not only a flipped bit) at p changes C by d * G(p); G(p) = odd * 2**(8i) with
  i = p % s < s, so d * G(p) has at most 7 + 8 * (s - 1) <= 63 factors of two: never 0 mod 2**64.
* Two unequal bytes swapped (positions p != q) change C by (b_q - b_p) * (G(p) - G(q)). Same i: G(p) - G(q) =
  256**i * 2 * (k_p - k_q), at most 8i + 1 + log2(n) factors of two; different i: the two terms have different
  powers of two, so the difference has exactly 8 * min(i_p, i_q) <= 8 * (s - 1). Both stay < 64 - 7 for s = 1
  and s = 2 at any size below 2**47 bytes, s = 4 below 2**32 words: caught.
* Two unequal words swapped (k != j) change C by (V_j - V_k) * 2 * (k - j): at most (8s - 1) + 1 + log2(k - j)
  factors of two: < 64 for s <= 4 (pieces below 2**32 words). Words of 8 bytes are covered for single changes only
  (no 64-bit linear sum can see every swap of two 64-bit words).
* Integer addition and multiplication mod 2**64 do not depend on the order of a reduction, so every path below, on
  the CPU or the GPU, gives the same value (tests check them against each other and against Python integers).

How it is computed: on a CUDA device with Triton, every checked piece of a buffer in one fused kernel
(``checksum_kernel.py``; ``bucket_checksums`` / ``tensors_checksums``, the latter copying separate tensors into one
buffer first), after a self-test against the definition. Otherwise (``checksum``, per piece): the piece's bytes as
an int8 matrix ``[rows, ROW]`` times a fixed int8 matrix ``W_s`` ``[ROW, 8..24]`` (``torch._int_mm``: one pass over
the data on the tensor cores, exact int32 results; the columns hold, per byte lane i < s, the lane's row sum and its
sums weighted by the word index's two base-128 digits), then one element-wise product with a weight table ``[rows,
ncols]`` (int64) and one sum: three kernels per piece. The rest (pieces shorter than FAST_MIN_ROWS rows, and a tail
of < ROW bytes) uses the definition directly in int64 over a cached G. If ``_int_mm`` is missing, raises, or
disagrees with the definition in a one-time self-test on a device, that device uses row/column reductions giving the
same matrix (``"reduce"``, slower): a failing fast path never skips a check. :func:`checksum_path` says which path
a device uses.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import WeightSyncMismatch
from . import checksum_kernel
from .buckets import Piece
from .meta import TensorMeta

ROW = 4096  # bytes per row of the matrix view (a multiple of every word size; int32 sums stay below 2**27)
FAST_MIN_ROWS = 17  # torch._int_mm's limit: more than 16 rows (its k = ROW and n are multiples of 8, as it needs)
SMALL = FAST_MIN_ROWS * ROW  # shorter pieces (and tails) are summed by the definition over a cached G
_SIZES = (1, 2, 4, 8)
ReadBack = Callable[[str], "torch.Tensor | None"]
FIX = (
    "A byte changed between the trainer and the engine's parameters (the transport, the engine's loading code, "
    "or the hardware): report it with the run's logs. sync.verify off turns this check off (not advised)."
)
_log = logging.getLogger(__name__)


def word_size(meta: TensorMeta, tensor_offset: int, nbytes: int) -> int:
    """Word size for a piece: the element size, or 1 when the piece does not start and end on element boundaries."""
    size = meta.torch_dtype.itemsize
    return size if size in _SIZES and tensor_offset % size == 0 and nbytes % size == 0 else 1


def _wrap(v: int) -> int:
    """A Python integer mod 2**64 as a signed 64-bit value."""
    v %= 1 << 64
    return v - (1 << 64) if v >= 1 << 63 else v


# ---- constant tables, per device and word size ---------------------------------------------------------------------
_TABLES: dict[tuple[Any, ...], torch.Tensor] = {}


def _table(key: tuple[Any, ...], build: Callable[[], torch.Tensor]) -> torch.Tensor:
    t = _TABLES.get(key)
    if t is None:
        t = _TABLES[key] = build()
    return t


def _columns(s: int) -> int:
    return -(-3 * s // 8) * 8


def _w_matrix(device: torch.device, s: int, column_major: bool = False) -> torch.Tensor:
    """W_s [ROW, ncols] int8: for byte column c (lane i = c % s, word index q = c // s in the row), column i is 1,
    column s + i is q % 128, column 2s + i is q // 128 (q < ROW / s <= 4096: two base-128 digits); the rest 0."""

    def build() -> torch.Tensor:
        c = torch.arange(ROW)
        i, q = c % s, c // s
        w = torch.zeros(ROW, _columns(s), dtype=torch.int8)
        w[c, i] = 1
        w[c, s + i] = (q % 128).to(torch.int8)
        w[c, 2 * s + i] = (q // 128).to(torch.int8)
        w = w.to(device)
        return w.t().contiguous().t() if column_major else w

    return _table(("W", device, s, column_major), build)


def _row_weights(device: torch.device, s: int, rows: int) -> torch.Tensor:
    """[rows, ncols] int64: what M = block @ W_s is multiplied by, element-wise, before the sum. Row r's total is
    sum_i 256**i * ((2 * r * ROW / s + 1) * A_i + 2 * B_i) with A_i the lane's byte sum, B_i = lo_i + 128 * hi_i its
    word-index-weighted sum: exactly sum over the row of G(p) * b_p (p = r * ROW + c, p // s = r * ROW / s + q)."""
    have = _TABLES.get(("R", device, s))
    if have is not None and have.shape[0] >= rows:
        return have[:rows]
    size = 1 << max(rows - 1, 1).bit_length()  # grown by powers of two: few rebuilds, at most 2x the need
    alpha = [0] * _columns(s)
    beta = [0] * _columns(s)
    for i in range(s):
        alpha[i], beta[i] = _wrap(256**i * 2 * (ROW // s)), 256**i
        beta[s + i], beta[2 * s + i] = _wrap(2 * 256**i), _wrap(256 * 256**i)
    r = torch.arange(size, dtype=torch.int64, device=device).unsqueeze(1)
    table = r * torch.tensor(alpha, dtype=torch.int64, device=device) + torch.tensor(
        beta, dtype=torch.int64, device=device
    )
    _TABLES[("R", device, s)] = table
    return table[:rows]


def _g(device: torch.device, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """G(p) for p < SMALL, and the lane factor 256**(p % s) (G(p + start) = G(p) + 2 * start / s * lane(p))."""

    def build_g() -> torch.Tensor:
        p = torch.arange(SMALL, dtype=torch.int64)
        return ((2 * (p // s) + 1) * _lane(s, p)).to(device)

    return _table(("G", device, s), build_g), _table(("L", device, s), lambda: _lane(s, torch.arange(SMALL)).to(device))


def _lane(s: int, p: torch.Tensor) -> torch.Tensor:
    lanes = torch.tensor([_wrap(256**i) for i in range(s)], dtype=torch.int64)
    return lanes[p % s]


# ---- the paths ----------------------------------------------------------------------------------------------------
def _direct(b: torch.Tensor, s: int, start: int = 0) -> torch.Tensor:
    """sum G(start + t) * b_t for a flat int8 ``b`` of < SMALL bytes (``start``: a multiple of s)."""
    g, lane = _g(b.device, s)
    n = b.numel()
    weights = g[:n] if not start else g[:n] + _wrap(2 * (start // s)) * lane[:n]
    return (b * weights).sum()


def _m_int_mm(block: torch.Tensor, s: int) -> torch.Tensor:
    return torch._int_mm(block, _w_matrix(block.device, s, _COLUMN_MAJOR.get(block.device, False)))


def _m_reduce(block: torch.Tensor, s: int) -> torch.Tensor:
    """The same M as ``block @ W_s`` from reductions (any device), a few thousand rows at a time."""
    rows = block.shape[0]
    m = torch.zeros(rows, _columns(s), dtype=torch.int64, device=block.device)
    q = torch.arange(ROW // s, dtype=torch.int32, device=block.device).view(1, -1, 1)
    lo, hi = q % 128, q // 128
    for r0 in range(0, rows, 4096):
        part = block[r0 : r0 + 4096].view(-1, ROW // s, s)
        m[r0 : r0 + 4096, :s] = part.sum(1, dtype=torch.int64)
        m[r0 : r0 + 4096, s : 2 * s] = (part * lo).sum(1, dtype=torch.int64)
        m[r0 : r0 + 4096, 2 * s : 3 * s] = (part * hi).sum(1, dtype=torch.int64)
    return m


_M_PATHS = {"int_mm": _m_int_mm, "reduce": _m_reduce}
_PATH: dict[torch.device, str] = {}  # the M path each device uses (decided by a self-test at first use)
_COLUMN_MAJOR: dict[torch.device, bool] = {}


def checksum_path(device: torch.device | str) -> str:
    """Which path computes the checksums of large pieces on ``device``: "triton" (one fused kernel, CUDA), "int_mm"
    (torch._int_mm) or "reduce"."""
    device = torch.device(device)
    path = _PATH.get(device)
    if path is None:
        path = _PATH[device] = _self_test(device)
    return path


def _self_test(device: torch.device) -> str:
    """The fastest path on this device that gives the definition's value on a fixed random buffer for every word
    size: "triton" (CUDA, ``checksum_kernel.py``), else "int_mm", else "reduce" (logged)."""
    g = torch.Generator().manual_seed(34)
    data = torch.randint(-128, 128, ((FAST_MIN_ROWS + 3) * ROW + 8,), generator=g, dtype=torch.int8).to(device)
    if device.type == "cuda" and checksum_kernel.available():
        try:
            # odd lengths and offsets too: the kernel masks its last block and reads unaligned bytes
            cases = [(data, s) for s in _SIZES] + [(data[1:-7], s) for s in _SIZES] + [(data[:5], 1)]
            for byte in (-128, 127, -1):  # the largest word values of every size: the int32 sums' bounds
                cases += [(torch.full((64 * 1024,), byte, dtype=torch.int8, device=device), s) for s in _SIZES]
            single = all(int(checksum_kernel.checksum(d, s)) == _definition(d, s) for d, s in cases)
            offsets, sizes = (1, 4096 + 3, 40000), (4096, 16 * 4099, 8)  # several pieces of one buffer, one launch
            many = checksum_kernel.piece_checksums(data, offsets, sizes, 1).tolist() == [
                _definition(data[o : o + n], 1) for o, n in zip(offsets, sizes)
            ]
            for s in _SIZES:  # pieces on word boundaries: the whole-word kernel (what buckets use)
                aligned = (0, 64 * s, 8192 * s)
                lengths = (64 * s, 4099 * s, 8 * s)
                many = many and checksum_kernel.piece_checksums(data, aligned, lengths, s).tolist() == [
                    _definition(data[o : o + n], s) for o, n in zip(aligned, lengths)
                ]
            for s in _SIZES:  # pieces in separate tensors, read in place (the receiver's engine tensors)
                parts = [data[o : o + n].clone() for o, n in ((0, 64 * s), (64 * s, 4099 * s), (8192 * s, 8 * s))]
                parts.append(torch.full((4099 * s,), -128, dtype=torch.int8, device=device))
                many = many and checksum_kernel.tensors_checksums(parts, s).tolist() == [
                    _definition(part, s) for part in parts
                ]
            if single and many:
                return "triton"
            _log.warning("weight sync verify: the Triton checksum disagrees with the definition on %s", device)
        except Exception as e:  # a Triton that cannot compile for this GPU
            _log.warning(
                "weight sync verify: the Triton checksum cannot run on %s (%s: %s)", device, type(e).__name__, e
            )
    data = data[: (FAST_MIN_ROWS + 3) * ROW]
    block = data.view(-1, ROW)
    why = ""
    for column_major in (False, True):
        _COLUMN_MAJOR[device] = column_major
        try:
            if all(
                _combine(_m_int_mm(block, s), s) == _combine(_m_reduce(block, s), s) == _definition(data, s)
                for s in _SIZES
            ):
                return "int_mm"
            why = "it disagrees with the definition"
        except Exception as e:  # missing on this build, or refused for this device/layout
            why = f"{type(e).__name__}: {e}"
    _log.warning(
        "weight sync verify: torch._int_mm cannot be used on %s (%s); checksums use reductions (slower, same values)",
        device,
        why,
    )
    return "reduce"


def _combine(m: torch.Tensor, s: int) -> int:
    return int((m * _row_weights(m.device, s, m.shape[0])).sum())


def _definition(data: torch.Tensor, s: int) -> int:
    """The definition over a cached G, SMALL bytes at a time (no matrix involved: what the self-test compares with;
    the tests compare it with Python integers)."""
    return _wrap(sum(int(_direct(data[i : i + SMALL], s, i)) for i in range(0, data.numel(), SMALL)))


def checksum(data: torch.Tensor, itemsize: int = 1) -> torch.Tensor:
    """The checksum (a 0-d int64 tensor on ``data``'s device, not synchronized) of a flat, contiguous uint8 tensor
    read as ``itemsize``-byte words (see the module's docstring)."""
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise ValueError("checksum takes a flat uint8 tensor (weight_sync.wire.tensor_bytes(tensor))")
    if itemsize not in _SIZES:
        raise ValueError(f"itemsize must be one of {_SIZES}, got {itemsize}")
    b = data.view(torch.int8)
    n = b.numel()
    if b.is_cuda and checksum_path(b.device) == "triton":
        return checksum_kernel.checksum(b, itemsize)
    if n < SMALL:
        return _direct(b, itemsize) if n else torch.zeros((), dtype=torch.int64, device=b.device)
    rows = n // ROW
    block = b[: rows * ROW].view(rows, ROW)
    path = checksum_path(b.device)
    if path == "int_mm" and block.data_ptr() % 16:
        path = "reduce"  # cuBLAS wants aligned rows; a view at an odd offset takes the other path
    try:
        m = _M_PATHS[path](block, itemsize)
    except Exception as e:
        if path == "reduce":
            raise
        _log.warning(
            "weight sync verify: torch._int_mm failed on %s (%s: %s); using reductions from now on",
            b.device,
            type(e).__name__,
            e,
        )
        _PATH[b.device] = "reduce"
        m = _m_reduce(block, itemsize)
    total = (m * _row_weights(b.device, itemsize, rows)).sum()
    if n > rows * ROW:
        total = total + _direct(b[rows * ROW :], itemsize, rows * ROW)
    return total


def bucket_checksums(buffer: torch.Tensor, pieces: Sequence[Piece]) -> torch.Tensor:
    """One checksum per piece (``Piece``: ``bucket_offset``, ``meta``, ``tensor_offset``, ``nbytes``) packed in the
    flat uint8 ``buffer``, as one int64 tensor on its device (not synchronized)."""
    if not pieces:
        return torch.zeros(0, dtype=torch.int64, device=buffer.device)
    sizes = [word_size(p.meta, p.tensor_offset, p.nbytes) for p in pieces]
    return _many(buffer, [p.bucket_offset for p in pieces], [p.nbytes for p in pieces], sizes)


def tensors_checksums(datas: Sequence[torch.Tensor], sizes: Sequence[int]) -> torch.Tensor:
    """One checksum per flat uint8 tensor ``datas[i]`` read as ``sizes[i]``-byte words, as one int64 tensor (not
    synchronized). On the fused kernel's devices the tensors are read where they are (a table of their addresses:
    one launch per word size, no copy), so the number of tensors costs no launches."""
    if not datas:
        return torch.zeros(0, dtype=torch.int64)
    device = datas[0].device
    if device.type == "cuda" and checksum_path(device) == "triton":
        if all(d.data_ptr() % s == 0 and d.numel() % s == 0 for d, s in zip(datas, sizes)):
            return _by_size(sizes, lambda which, s: checksum_kernel.tensors_checksums([datas[i] for i in which], s))
        offsets = [0]  # a piece cut inside an element (word size 1 is always aligned: not reached for it)
        for d in datas[:-1]:
            offsets.append(offsets[-1] + d.numel())
        return _many(torch.cat([d.view(torch.uint8) for d in datas]), offsets, [d.numel() for d in datas], sizes)
    return torch.stack([checksum(d, s) for d, s in zip(datas, sizes)])


def _by_size(sizes: Sequence[int], run: Callable[[list[int], int], torch.Tensor]) -> torch.Tensor:
    """``run(indices, s)`` for each word size s in use (one launch each), the results put back in ``sizes``' order."""
    kinds = sorted(set(sizes))
    if len(kinds) == 1:
        return run(list(range(len(sizes))), kinds[0])
    parts, order = [], []
    for s in kinds:
        which = [i for i, w in enumerate(sizes) if w == s]
        parts.append(run(which, s))
        order += which
    merged = torch.cat(parts)
    back = [0] * len(order)
    for place, i in enumerate(order):
        back[i] = place
    return merged[torch.tensor(back, device=merged.device)]


def _many(buffer: torch.Tensor, offsets: Sequence[int], nbytes: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    """The checksums of the pieces ``buffer[offsets[i]:][:nbytes[i]]`` (word sizes ``sizes``): one fused launch per
    word size where the device runs the kernel, else one checksum per piece."""
    b = buffer.view(torch.int8)
    if not (b.is_cuda and checksum_path(b.device) == "triton"):
        return torch.stack([checksum(buffer[o : o + n], s) for o, n, s in zip(offsets, nbytes, sizes)])
    return _by_size(
        sizes,
        lambda which, s: checksum_kernel.piece_checksums(b, [offsets[i] for i in which], [nbytes[i] for i in which], s),
    )


def loaded_bytes(
    name: str, received: torch.Tensor, meta: TensorMeta, read_back: ReadBack | None
) -> tuple[torch.Tensor, bool]:
    """The bytes to check for a tensor after its load: the engine's own tensor of that name when ``read_back`` gives
    one of the sent dtype and size (what the engine really holds), else the bytes that arrived. Also says which."""
    from .wire import tensor_bytes

    target = read_back(name) if read_back is not None else None
    if (
        target is not None
        and target.dtype == meta.torch_dtype
        and target.numel() == meta.numel
        and target.is_contiguous()
    ):
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
        part = (
            ""
            if self.nbytes == self.total_bytes
            else f" bytes {self.tensor_offset}-{self.tensor_offset + self.nbytes} of {self.total_bytes}"
        )
        how = "the engine's parameter" if self.read_back else "the bytes received"
        return f"{self.name}{part} (bucket {self.bucket}, checked in {how})"


def mismatch_error(where: str, bad: Sequence[PieceCheck], checked: int) -> WeightSyncMismatch:
    shown = "; ".join(c.describe() for c in bad[:3]) + (f"; and {len(bad) - 3} more" if len(bad) > 3 else "")
    return WeightSyncMismatch(
        f"weight sync verify: {where}: {len(bad)} of {checked} tensor piece(s) differ from what "
        f"the trainer sent: {shown}. Fix: {FIX}"
    )


def compare(expected: Sequence[int], actual: torch.Tensor, checks: Sequence[PieceCheck], where: str) -> None:
    """Raise :class:`WeightSyncMismatch` naming every piece whose checksum differs (one host read of ``actual``)."""
    got = actual.tolist() if actual.numel() else []
    bad = [c for c, e, a in zip(checks, expected, got) if e != a]
    if len(got) != len(expected):
        raise WeightSyncMismatch(
            f"weight sync verify: {where}: {len(expected)} checksums sent, {len(got)} checked. Fix: {FIX}"
        )
    if bad:
        raise mismatch_error(where, bad, len(checks))


def corrupt(data: torch.Tensor) -> None:
    """Test-only fault: flip the lowest bit of the middle byte of a flat uint8 tensor (a change no value comparison
    with a tolerance would see)."""
    if data.numel():
        mid = data.numel() // 2
        data[mid : mid + 1].bitwise_xor_(1)


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
