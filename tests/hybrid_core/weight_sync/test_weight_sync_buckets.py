"""Bucket planning: deterministic, every byte of every tensor placed exactly once, aligned, within capacity,
and the online packer (sender) agrees with plan_buckets (receivers)."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_core.errors import ConfigError
from hybrid_core.weight_sync import TensorMeta, plan_buckets
from hybrid_core.weight_sync.buckets import ALIGN, BucketPacker, layout_digest

DTYPES = ["float32", "bfloat16", "float16", "int64", "bool", "uint8"]
metas_strategy = st.lists(
    st.builds(
        lambda i, d, shape: TensorMeta(f"t{i}", d, tuple(shape)),
        st.integers(0, 10**6),
        st.sampled_from(DTYPES),
        st.lists(st.integers(0, 40), min_size=0, max_size=3),
    ),
    min_size=0,
    max_size=25,
)


@settings(max_examples=150, deadline=None)
@given(metas_strategy, st.sampled_from([1024, 1500, 4096, 10_000]), st.booleans())
def test_every_byte_is_placed_once_aligned_and_within_the_bucket(metas, bucket_bytes, split_large):
    buckets = plan_buckets(metas, bucket_bytes, split_large=split_large)
    assert [b.index for b in buckets] == list(range(len(buckets)))
    covered = {i: 0 for i in range(len(metas))}
    for b in buckets:
        assert b.pieces
        spans = sorted((p.bucket_offset, p.bucket_offset + p.nbytes) for p in b.pieces)
        assert all(hi <= lo2 for (_, hi), (lo2, _) in itertools.pairwise(spans))  # no overlap
        assert b.nbytes <= max(bucket_bytes, *(p.nbytes for p in b.pieces))
        for p in b.pieces:
            assert p.tensor_offset == covered[p.index]  # tensor bytes in stream order, contiguous
            covered[p.index] += p.nbytes
            if p.tensor_offset == 0:
                assert p.bucket_offset % ALIGN == 0  # views of any dtype start aligned
            if not split_large:
                assert p.whole
    assert [covered[i] for i in range(len(metas))] == [m.nbytes for m in metas]
    assert buckets == plan_buckets(metas, bucket_bytes, split_large=split_large)  # deterministic


@settings(max_examples=60, deadline=None)
@given(metas_strategy, st.sampled_from([1024, 4096]))
def test_the_online_packer_matches_the_plan(metas, bucket_bytes):
    packer = BucketPacker(bucket_bytes)
    pieces = [p for m in metas for p in packer.add(m)]
    assert pieces == [p for b in plan_buckets(metas, bucket_bytes) for p in b.pieces]


def test_a_tensor_larger_than_a_bucket_spans_several_and_others_share_buckets():
    metas = [
        TensorMeta("small", "float32", (10,)),
        TensorMeta("big", "float32", (900,)),
        TensorMeta("tail", "bfloat16", (3,)),
    ]
    buckets = plan_buckets(metas, 1024)
    big = [p for b in buckets for p in b.pieces if p.meta.name == "big"]
    assert len(big) == 4 and big[-1].completes and not big[0].completes
    assert buckets[0].pieces[0].meta.name == "small" and buckets[0].pieces[1].meta.name == "big"
    assert buckets[-1].pieces[-1].meta.name == "tail" and buckets[-1].pieces[0].meta.name == "big"


def test_layout_digest_changes_with_any_meta_change():
    base = plan_buckets([TensorMeta("a", "float32", (4, 4))], 1024)[0]
    for other in (
        TensorMeta("b", "float32", (4, 4)),
        TensorMeta("a", "bfloat16", (4, 4)),
        TensorMeta("a", "float32", (16,)),
    ):
        assert plan_buckets([other], 1024)[0].digest() != base.digest()
    assert layout_digest(0, base.pieces) == base.digest() != layout_digest(1, base.pieces)


def test_meta_of_a_tensor_and_bad_values():
    m = TensorMeta.of("w", torch.zeros(2, 3, dtype=torch.bfloat16))
    assert (m.dtype, m.shape, m.nbytes) == ("bfloat16", (2, 3), 12)
    with pytest.raises(ConfigError) as e:
        TensorMeta("w", "float33", (1,))
    assert e.value.field == "TensorMeta.dtype"
    with pytest.raises(ConfigError) as e:
        plan_buckets([m], 100)
    assert e.value.field == "bucket_bytes"
