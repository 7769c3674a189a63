"""The packed attention's pieces: sample boundaries from position ids, the per-sample loop against a plain-math
reference (GQA, scaling, sliding window, bf16), the varlen call's arguments (layout, GQA, causal / window, scale) for
the varlen_attn signatures of torch 2.10 / 2.11 / 2.12+ through a CPU stand-in of the CUDA kernel, and refusals."""

from __future__ import annotations

import pytest
import torch

from hybrid_algos.train import packed_attention as pa


# ---- boundaries -------------------------------------------------------------------------------------------------
def test_segments_from_position_ids_restarts_jumps_rows_and_length_one():
    s = pa.segments_from_position_ids(torch.tensor([[0, 1, 2, 0, 0, 1, 5]]))
    assert s.lengths == (3, 1, 2, 1) and s.cu_seqlens.tolist() == [0, 3, 4, 6, 7] and s.max_len == 3
    assert s.cu_seqlens.dtype == torch.int32
    s = pa.segments_from_position_ids(torch.tensor([[0, 1, 0], [0, 1, 2]]))  # a row start is always a boundary
    assert s.lengths == (2, 1, 3)
    s = pa.segments_from_position_ids(torch.tensor([[0]]))
    assert s.lengths == (1,) and s.cu_seqlens.tolist() == [0, 1]


def test_segments_from_lengths_and_the_cache_on_position_ids():
    s = pa.segments_from_lengths([4, 1, 2], "cpu")
    assert s.cu_seqlens.tolist() == [0, 4, 5, 7]
    with pytest.raises(ValueError, match="at least one token"):
        pa.segments_from_lengths([3, 0], "cpu")
    pos = torch.tensor([[0, 1, 2, 3, 0, 0, 1]])
    assert pa.segments_of(pos).lengths == (4, 1, 2)
    marked = pa.attach_segments(torch.tensor([[0, 1, 2]]), s)  # what model_inputs attaches wins (no recompute)
    assert pa.segments_of(marked) is s


# ---- kernels ----------------------------------------------------------------------------------------------------
def reference(q, k, v, lengths, scale, window=None):
    """Plain math, sample by sample: softmax(q k^T * scale + causal/window mask) v, KV heads repeated."""
    _B, H, _N, _D = q.shape
    k, v = (t.repeat_interleave(H // t.shape[1], dim=1).float() for t in (k, v))
    q = q.float()
    out, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        start += n
        s = q[:, :, sl] @ k[:, :, sl].transpose(-1, -2) * scale
        i = torch.arange(n)
        keep = i[None, :] <= i[:, None]
        if window is not None:
            keep &= i[None, :] > i[:, None] - window
        out.append(torch.softmax(s.masked_fill(~keep, float("-inf")), -1) @ v[:, :, sl])
    return torch.cat(out, 2).transpose(1, 2)  # [B, N, H, D]


def qkv(lengths, dtype=torch.float32, hq=4, hkv=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    return (
        torch.randn(1, hq, n, d, generator=g).to(dtype),
        torch.randn(1, hkv, n, d, generator=g).to(dtype),
        torch.randn(1, hkv, n, d, generator=g).to(dtype),
    )


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [None, 3])
def test_segment_loop_equals_per_sample_math(dtype, tol, window):
    lengths = [5, 1, 7, 2]
    q, k, v = qkv(lengths, dtype)
    seg = pa.segments_from_lengths(lengths, "cpu")
    got = pa.segment_attention(q, k, v, seg, 0.3, 0.0, window)
    want = reference(q, k, v, lengths, 0.3, window)
    assert got.shape == (1, sum(lengths), 4, 8) and got.dtype == dtype
    assert torch.allclose(got.float(), want, atol=tol, rtol=tol)


def fake_varlen(signature: str):
    """A CPU stand-in of torch.nn.attention.varlen.varlen_attn with the signature of a given torch version, built
    on the plain-math reference: checks what our call passes (layout [T, H, D], cu_seqlens, causal, scale, GQA)."""
    seen = {}

    def run(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, causal=False, window=(-1, -1), gqa=False):
        assert q.dim() == 3 and q.is_contiguous() and cu_q is cu_k and cu_q.dtype == torch.int32
        lengths = (cu_q[1:] - cu_q[:-1]).tolist()
        assert max_q == max_k == max(lengths)
        if k.shape[1] != q.shape[1]:
            assert gqa, "GQA heads passed to a varlen_attn that cannot take them"
        if window != (-1, -1):
            assert window[1] == 0
            causal = True
        assert causal, "the packed attention must be causal"
        seen.update(scale=scale, window=window, kv_heads=k.shape[1])
        w = None if window[0] < 0 else window[0] + 1
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        return reference(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], lengths, scale, w)[
            0
        ].to(q.dtype)

    if signature == "2.10":

        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
            return run(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal=is_causal)
    elif signature == "2.11":

        def varlen_attn(
            query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
        ):
            return run(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window=tuple(window_size))
    else:

        def varlen_attn(
            query,
            key,
            value,
            cu_seq_q,
            cu_seq_k,
            max_q,
            max_k,
            *,
            return_aux=None,
            scale=None,
            window_size=(-1, -1),
            enable_gqa=False,
            seqused_k=None,
            block_table=None,
            num_splits=None,
        ):
            return run(
                query,
                key,
                value,
                cu_seq_q,
                cu_seq_k,
                max_q,
                max_k,
                scale=scale,
                window=tuple(window_size),
                gqa=enable_gqa,
            )

    return varlen_attn, seen


# 2.10's varlen_attn has no window_size: varlen_unsupported sends sliding-window calls to the loop there
@pytest.mark.parametrize("signature,window", [("2.10", None), ("2.11", None), ("2.11", 3), ("2.12", None), ("2.12", 3)])
def test_varlen_call_matches_the_math_for_each_varlen_attn_signature(monkeypatch, signature, window):
    fn, seen = fake_varlen(signature)
    import inspect

    monkeypatch.setattr(pa, "_varlen_fn", lambda: (fn, frozenset(inspect.signature(fn).parameters)))
    lengths = [6, 1, 4]
    q, k, v = qkv(lengths, seed=1)
    got = pa.varlen_attention(q, k, v, pa.segments_from_lengths(lengths, "cpu"), 0.2, window)
    assert torch.allclose(got, reference(q, k, v, lengths, 0.2, window), atol=1e-5)
    assert seen["kv_heads"] == (2 if signature == "2.12" else 4)  # native GQA where the signature has it
    assert seen["window"] == ((-1, -1) if signature == "2.10" else (-1, 0) if window is None else (window - 1, 0))


def test_varlen_is_refused_where_it_cannot_run(monkeypatch):
    q, k, v = qkv([2, 3])
    reason = pa.varlen_unsupported(q, k, v, 0.0, None)
    assert reason  # CPU here (or a torch without varlen_attn): the loop runs instead
    monkeypatch.setenv(pa.ENV, "varlen")
    seg = pa.segments_from_lengths([2, 3], "cpu")
    pos = pa.attach_segments(torch.tensor([[0, 1, 0, 1, 2]]), seg)
    module = torch.nn.Module()
    with pytest.raises(RuntimeError, match=r"HYBRID_PACKED_ATTENTION=varlen: .*auto"):
        pa.packed_attention_forward(module, q, k, v, None, position_ids=pos)
    monkeypatch.setenv(pa.ENV, "nonsense")
    with pytest.raises(ValueError, match="expected one of auto, varlen, segments, sdpa-mask"):
        pa.mode()


def test_softcap_is_refused_with_a_message():
    q, k, v = qkv([2, 3])
    pos = torch.tensor([[0, 1, 0, 1, 2]])
    with pytest.raises(ValueError, match=r"soft-caps its attention logits.*without --packing_samples"):
        pa.packed_attention_forward(torch.nn.Module(), q, k, v, None, position_ids=pos, softcap=30.0)
    from transformers import LlamaForCausalLM

    from hybrid_algos.train.tiny import tiny_model_config

    cfg = tiny_model_config(8)
    cfg.attn_logit_softcapping = 30.0
    with pytest.raises(ValueError, match=r"attn_logit_softcapping=30.0"):
        pa.install(LlamaForCausalLM(cfg))


def test_dropout_is_applied_in_training():
    lengths = [4, 3]
    q, k, v = qkv(lengths)
    seg = pa.segments_from_lengths(lengths, "cpu")
    torch.manual_seed(0)
    a = pa.segment_attention(q, k, v, seg, None, 0.5, None)
    assert not torch.allclose(a, pa.segment_attention(q, k, v, seg, None, 0.0, None))


@pytest.mark.parametrize("chosen", ["auto", "segments"])
def test_the_loop_runs_when_asked_or_when_varlen_cannot(monkeypatch, chosen):
    fn, seen = fake_varlen("2.12")  # even with a varlen_attn that would run, "segments" must not call it
    import inspect

    monkeypatch.setattr(pa, "_varlen_fn", lambda: (fn, frozenset(inspect.signature(fn).parameters)))
    monkeypatch.setenv(pa.ENV, chosen)
    lengths = [3, 1, 2]
    q, k, v = qkv(lengths)
    pos = pa.attach_segments(torch.tensor([[0, 1, 2, 0, 0, 1]]), pa.segments_from_lengths(lengths, "cpu"))
    before = dict(pa.CALLS)
    out, weights = pa.packed_attention_forward(torch.nn.Module(), q, k, v, None, scaling=0.4, position_ids=pos)
    assert weights is None and not seen  # auto: the stand-in is not CUDA, so varlen_unsupported says no
    assert pa.CALLS["segments"] == before.get("segments", 0) + 1
    assert torch.allclose(out, reference(q, k, v, lengths, 0.4), atol=1e-5)
