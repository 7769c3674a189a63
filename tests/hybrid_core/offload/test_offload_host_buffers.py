"""Host buffers: power-of-two segments (exact under torch's rounding pinned allocator), ranges split at segment
borders, allocated once and reused."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_core.offload.host_buffers import HostBuffer, HostBuffers, can_pin_memory, resolve_pin_memory, segment_sizes

MiB = 1 << 20


@given(st.integers(min_value=1, max_value=40 << 30))
def test_segments_are_powers_of_two_covering_the_size_to_2_mib(n):
    sizes = segment_sizes(n)
    assert all(s & (s - 1) == 0 and 2 * MiB <= s <= 1 << 30 for s in sizes)
    assert n <= sum(sizes) < n + 2 * MiB
    assert sizes == sorted(sizes, reverse=True)


_BUF = HostBuffer(14 * MiB - 5, pin_memory=False)
_FLAT = torch.randint(0, 256, (_BUF.capacity,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
for _seg, _part in zip(_BUF.segments, _FLAT.split([s.numel() for s in _BUF.segments])):
    _seg.copy_(_part)


def test_segments_are_exact_powers_of_two_of_the_rounded_size():
    assert [s.numel() for s in _BUF.segments] == [8 * MiB, 4 * MiB, 2 * MiB]


@settings(max_examples=40, deadline=None)
@given(st.integers(min_value=0, max_value=15 * MiB), st.integers(min_value=0, max_value=9 * MiB))
def test_pieces_cover_a_range_exactly_once_across_segments(offset, length):
    if offset + length > _BUF.capacity:
        with pytest.raises(IndexError):
            list(_BUF.pieces(offset, length))
        return
    got = torch.zeros(length, dtype=torch.uint8)
    covered = 0
    for view, pos in _BUF.pieces(offset, length):
        got[pos : pos + view.numel()] = view
        covered += view.numel()
    assert covered == length
    assert torch.equal(got, _FLAT[offset : offset + length])


def test_cpu_only_torch_cannot_pin_and_falls_back_quietly():
    if torch.cuda.is_available():
        pytest.skip(
            "this machine can pin, so there is no fallback to check; pinned buffers are exercised by the "
            "other tests here and by bench/offload.py on the GPU"
        )
    assert not can_pin_memory()
    assert resolve_pin_memory(None) is False and resolve_pin_memory(True) is False


def test_buffers_are_reused_until_outgrown():
    bufs = HostBuffers(pin_memory=False)
    a = bufs.ensure(torch.float32, 3 * MiB)
    assert bufs.ensure(torch.float32, 4 * MiB) is a  # 3 MiB rounds to 4 MiB of segments: still fits
    assert bufs.ensure(torch.bfloat16, MiB) is not a
    before = bufs.alloc_bytes
    b = bufs.ensure(torch.float32, 5 * MiB)
    assert b is not a and b.capacity >= 5 * MiB and bufs.alloc_bytes == before + b.capacity
