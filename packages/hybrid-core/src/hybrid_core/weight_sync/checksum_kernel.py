"""The weight-sync checksum (``verify.py``'s definition) of many pieces of one buffer in one GPU kernel (Triton).

Why a kernel of its own: a full check used to cost ~60-120 us of launches and Python per tensor piece on each side
(an H200 checked 147 tensors, 1.9 GB, in ~18 ms at 106 GB/s, while one 537 MB buffer took 0.4 ms): the bytes were
never the cost, the number of small operations was. Here one launch checksums every piece of a buffer, whatever
their number. Each program reads one block of ``BLOCK`` words of one piece (a table says which piece and which
word the block starts at), builds every word's value ``V_k`` (its bytes as balanced base-256 digits) and sums,
exactly in int64 (wrapping: everything is mod 2**64)::

    S0 = sum_j V_j,  S1 = sum_j j * V_j,  part = (2 * k0 + 1) * S0 + 2 * S1      (k0: the block's first word)

so that the sum of its blocks' parts is ``sum_k (2k + 1) V_k``, the piece's checksum (each block adds its part to
its piece's total atomically: integer adds are exact in any order). The tables depend only on the layout, which is
the same every sync: built once, kept on the device.
``verify.checksum_path`` uses this only after a self-test on the device agrees with the definition; where Triton is
missing or the test fails, the other paths give the same values.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

BLOCK = 2048  # words per program
#: Words of 1 and 2 bytes are summed in int32, row by row of a block seen as [BLOCK // COLS, COLS]: int64 products
#: and sums cost the GPU several instructions each (the all-int64 kernel read ~1 TB/s of an H200's ~4.8), and these
#: cannot overflow: |V| <= 2**15 + 2**8 < 2**16, so a row's sum of V < 2**23 and of c * V (c < COLS) < 2**30. Only
#: the rows' totals go to int64: sum_j j V_j = sum_r (r * COLS * rowsum_r + sum_c c V_rc).
COLS = 128
#: tables kept, least recently used first out. A sync uses one layout per bucket in full mode and one or two per
#: sampled group (PERIOD of them), times the word sizes in use: ~80 at 7B with 512 MB buckets. A bound below what a
#: run cycles through evicts every table before its next use (64 did at 7B: verification cost 35 % of the sync), so
#: it is set far above, and the tables' device bytes are bounded too (a 512 MB bucket's are ~1.5 MB).
_MAX_LAYOUTS = 1024
_MAX_LAYOUT_BYTES = 1 << 30


def available() -> bool:
    """Triton imports and there is a CUDA device to run on."""
    if not torch.cuda.is_available():
        return False
    try:
        import triton
        import triton.language  # noqa: F401
    except Exception:  # missing, or a build that cannot load here
        return False
    return True


_KERNELS: dict[str, Any] = {}


def _kernel(kind: str) -> Any:
    """``"words"``: the pieces start on a word boundary, each word is loaded whole (the fast kernel); ``"bytes"``: any
    offset, byte by byte (a receiver's concatenation of mixed word sizes can put a piece anywhere)."""
    if not _KERNELS:
        _KERNELS.update(_build())
    return _KERNELS[kind]


def _build() -> dict[str, Any]:
    import triton
    import triton.language as tl

    # no annotations but tl.constexpr: Triton reads them, and may not see this module's globals
    # (mypy.ini lets this module's kernel be untyped)
    @triton.jit
    def pieces_checksum_bytes(
        x_ptr, out_ptr, block_piece, block_word, piece_offset, piece_words, S: tl.constexpr, BLOCK: tl.constexpr
    ):
        pid = tl.program_id(0)
        piece = tl.load(block_piece + pid)
        k0 = tl.load(block_word + pid)  # int64: byte offsets pass 2**31 in large buffers
        base = tl.load(piece_offset + piece)
        n_words = tl.load(piece_words + piece)
        j = tl.arange(0, BLOCK)
        k = k0 + j
        lane = tl.arange(0, S)
        offs = base + k[:, None] * S + lane[None, :]
        b = tl.load(x_ptr + offs, mask=(k < n_words)[:, None], other=0).to(tl.int64)
        v = tl.sum(b << (lane[None, :].to(tl.int64) * 8), axis=1)  # V_k: signed bytes, base 256
        s0 = tl.sum(v, axis=0)
        s1 = tl.sum(v * j.to(tl.int64), axis=0)
        tl.atomic_add(out_ptr + piece, (2 * k0 + 1) * s0 + 2 * s1)  # integer adds: exact in any order

    @triton.jit
    def pieces_checksum_words(
        w_ptr,
        out_ptr,
        block_piece,
        block_word,
        piece_offset,
        piece_words,
        S: tl.constexpr,
        BLOCK: tl.constexpr,
        COLS: tl.constexpr,
    ):
        # w_ptr: the buffer as S-byte signed integers. Loading whole words (coalesced, vectorised) instead of S
        # strided bytes is what makes the check cheap: the byte kernel ran at ~0.4 TB/s on an H200.
        pid = tl.program_id(0)
        piece = tl.load(block_piece + pid)
        k0 = tl.load(block_word + pid)
        base = tl.load(piece_offset + piece) // S  # the piece's first word (its byte offset is a multiple of S)
        n_words = tl.load(piece_words + piece)
        # w reads the top byte signed and the lower ones unsigned; V_k reads every byte signed: a lower byte >= 128
        # is 256 less, i.e. it takes one from the byte above it (a jit helper for this would be out of the kernels'
        # sight here: Triton looks called functions up in the module's globals, and this module imports it lazily)
        if S <= 2:  # see COLS: per-row sums in int32, only the BLOCK // COLS row totals in int64
            r = tl.arange(0, BLOCK // COLS)
            c = tl.arange(0, COLS)
            k = k0 + (r[:, None] * COLS + c[None, :])
            w = tl.load(w_ptr + base + k, mask=k < n_words, other=0).to(tl.int32)  # sign-extended
            v = w
            for i in tl.static_range(S - 1):
                v -= ((w >> (8 * i + 7)) & 1) << (8 * i + 8)
            rows = tl.sum(v, axis=1).to(tl.int64)
            weighted = tl.sum(v * c[None, :], axis=1).to(tl.int64)
            s0 = tl.sum(rows, axis=0)
            s1 = tl.sum((r * COLS).to(tl.int64) * rows + weighted, axis=0)
        else:
            j = tl.arange(0, BLOCK)
            k = k0 + j
            w = tl.load(w_ptr + base + k, mask=k < n_words, other=0).to(tl.int64)  # sign-extended
            v = w
            for i in tl.static_range(S - 1):
                v -= ((w >> (8 * i + 7)) & 1) << (8 * i + 8)
            s0 = tl.sum(v, axis=0)
            s1 = tl.sum(v * j.to(tl.int64), axis=0)
        tl.atomic_add(out_ptr + piece, (2 * k0 + 1) * s0 + 2 * s1)  # integer adds: exact in any order

    @triton.jit
    def tensors_checksum_words(
        addresses,
        out_ptr,
        block_piece,
        block_word,
        piece_words,
        S: tl.constexpr,
        BLOCK: tl.constexpr,
        COLS: tl.constexpr,
    ):
        # pieces in separate tensors: a table of their addresses instead of offsets into one buffer (the receiver
        # checks the engine's own tensors where they are, without copying them into one buffer first)
        pid = tl.program_id(0)
        piece = tl.load(block_piece + pid)
        k0 = tl.load(block_word + pid)
        address = tl.load(addresses + piece)
        if S == 1:
            w_ptr = address.to(tl.pointer_type(tl.int8))
        elif S == 2:
            w_ptr = address.to(tl.pointer_type(tl.int16))
        elif S == 4:
            w_ptr = address.to(tl.pointer_type(tl.int32))
        else:
            w_ptr = address.to(tl.pointer_type(tl.int64))
        n_words = tl.load(piece_words + piece)
        if S <= 2:  # as in pieces_checksum_words
            r = tl.arange(0, BLOCK // COLS)
            c = tl.arange(0, COLS)
            k = k0 + (r[:, None] * COLS + c[None, :])
            w = tl.load(w_ptr + k, mask=k < n_words, other=0).to(tl.int32)
            v = w
            for i in tl.static_range(S - 1):
                v -= ((w >> (8 * i + 7)) & 1) << (8 * i + 8)
            rows = tl.sum(v, axis=1).to(tl.int64)
            weighted = tl.sum(v * c[None, :], axis=1).to(tl.int64)
            s0 = tl.sum(rows, axis=0)
            s1 = tl.sum((r * COLS).to(tl.int64) * rows + weighted, axis=0)
        else:
            j = tl.arange(0, BLOCK)
            k = k0 + j
            w = tl.load(w_ptr + k, mask=k < n_words, other=0).to(tl.int64)
            v = w  # as in pieces_checksum_words
            for i in tl.static_range(S - 1):
                v -= ((w >> (8 * i + 7)) & 1) << (8 * i + 8)
            s0 = tl.sum(v, axis=0)
            s1 = tl.sum(v * j.to(tl.int64), axis=0)
        tl.atomic_add(out_ptr + piece, (2 * k0 + 1) * s0 + 2 * s1)

    return {"bytes": pieces_checksum_bytes, "words": pieces_checksum_words, "tensors": tensors_checksum_words}


#: the buffer read as whole words of each size (the word kernel's view)
_WORD_DTYPES = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


_LAYOUTS: OrderedDict[tuple[Any, ...], tuple[tuple[torch.Tensor, ...], bool]] = OrderedDict()


def _layout(
    device: torch.device, offsets: Sequence[int], nbytes: Sequence[int], s: int
) -> tuple[tuple[torch.Tensor, ...], bool]:
    """The kernel's tables for this layout, and whether every piece starts on a word boundary (both cached)."""
    key = (device, s, tuple(offsets), tuple(nbytes))
    layout = _LAYOUTS.get(key)
    if layout is not None:
        _LAYOUTS.move_to_end(key)
    else:
        words = torch.tensor([n // s for n in nbytes], dtype=torch.int64)
        blocks = torch.clamp((words + BLOCK - 1) // BLOCK, min=1)  # an empty piece still gets its (zero) block
        block_piece = torch.repeat_interleave(torch.arange(len(nbytes)), blocks)
        first = torch.cumsum(blocks, 0) - blocks
        block_word = (torch.arange(int(blocks.sum())) - first[block_piece]) * BLOCK
        tables = (
            block_piece.to(device=device, dtype=torch.int32),
            block_word.to(device),
            torch.tensor(list(offsets), dtype=torch.int64).to(device),
            words.to(device),
        )
        layout = _LAYOUTS[key] = (tables, all(o % s == 0 for o in offsets))
        while len(_LAYOUTS) > 1 and (len(_LAYOUTS) > _MAX_LAYOUTS or _layout_bytes() > _MAX_LAYOUT_BYTES):
            _LAYOUTS.popitem(last=False)
    return layout


def _layout_bytes() -> int:
    return sum(t.numel() * t.element_size() for tables, _ in _LAYOUTS.values() for t in tables)


def piece_checksums(buffer: torch.Tensor, offsets: Sequence[int], nbytes: Sequence[int], s: int) -> torch.Tensor:
    """The checksums (int64 [len(offsets)] on the buffer's device, not synchronized) of the pieces
    ``buffer[offsets[i]:offsets[i] + nbytes[i]]`` of a flat int8 CUDA tensor, each read as ``s``-byte words (every
    ``nbytes[i]`` a multiple of ``s``): two launches (zeros, the kernel), whatever the number of pieces."""
    (block_piece, block_word, piece_offset, piece_words), on_words = _layout(buffer.device, offsets, nbytes, s)
    out = torch.zeros(len(offsets), dtype=torch.int64, device=buffer.device)
    grid = (block_piece.numel(),)
    # the buckets' pieces always start on a word boundary (64-byte placement): whole words load at full bandwidth
    if on_words and buffer.data_ptr() % s == 0 and buffer.numel() % s == 0:
        words = buffer.view(_WORD_DTYPES[s])
        _kernel("words")[grid](
            words, out, block_piece, block_word, piece_offset, piece_words, S=s, BLOCK=BLOCK, COLS=COLS
        )
    else:
        _kernel("bytes")[grid](buffer, out, block_piece, block_word, piece_offset, piece_words, S=s, BLOCK=BLOCK)
    return out


def checksum(b: torch.Tensor, itemsize: int) -> torch.Tensor:
    """The checksum (0-d int64 on ``b``'s device, not synchronized) of a flat int8 CUDA tensor of whole
    ``itemsize``-byte words."""
    return piece_checksums(b, [0], [b.numel()], itemsize)[0]


def tensors_checksums(datas: Sequence[torch.Tensor], s: int) -> torch.Tensor:
    """The checksums (int64 [len(datas)], not synchronized) of flat int8/uint8 CUDA tensors of one device, each read
    as ``s``-byte words (every length a multiple of ``s``, every address too: a tensor's own bytes always are), in
    place: two launches whatever their number, no copy. The tensors' addresses are part of the cached layout (an
    engine's parameters keep theirs from sync to sync)."""
    addresses = [d.data_ptr() for d in datas]
    nbytes = [d.numel() for d in datas]
    if any(a % s for a in addresses):
        raise ValueError(f"tensors_checksums: a tensor's address is not a multiple of its word size {s}")
    (block_piece, block_word, piece_address, piece_words), _ = _layout(datas[0].device, addresses, nbytes, s)
    out = torch.zeros(len(datas), dtype=torch.int64, device=datas[0].device)
    grid = (block_piece.numel(),)
    _kernel("tensors")[grid](piece_address, out, block_piece, block_word, piece_words, S=s, BLOCK=BLOCK, COLS=COLS)
    return out
