"""The trainer's forward passes: chunked log-probs equal today's full-logits computation (values and gradients),
packing gives the padded path's log-probs / entropy / values, and no full-vocabulary logits are ever allocated."""

from __future__ import annotations

import pytest
import torch

from hybrid_algos.train import models
from hybrid_algos.train.experience import Rollout
from hybrid_algos.train.tiny import tiny_model_config

PAD = 0


def _model(seed=0, vocab=None, **overrides):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_model_config(8, **({"vocab_size": vocab} if vocab else {}), **overrides)
    return models.install_token_scores(LlamaForCausalLM(cfg).eval())


def _ragged_rollout(seed=0, vocab=12, batch=6):
    g = torch.Generator().manual_seed(seed)
    prompts, completions = [], []
    for i in range(batch):
        p = torch.randint(4, vocab, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
        r = torch.randint(4, vocab, (int(torch.randint(1 if i else 0, 7, (1,), generator=g)),), generator=g).tolist()
        prompts.append([1, *p])
        completions.append([r])
    return Rollout.from_generations(prompts, completions, PAD)


def old_full_logits(model, sequences, attention_mask, response_len, temperature=1.0):
    """Today's computation (before chunking): the whole [B, T, V] logits, log-softmax, gather."""
    out = model(
        input_ids=sequences,
        attention_mask=attention_mask,
        position_ids=models.position_ids_from_mask(attention_mask),
        use_cache=False,
    )
    logits = out.logits[:, -response_len - 1 : -1].float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, sequences[:, -response_len:].unsqueeze(-1)).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("packed", [False, True])
def test_logprobs_and_entropy_equal_the_full_logits_path(temperature, packed):
    model = _model()
    ro = _ragged_rollout()
    mask = ro.action_mask.bool()
    want_lp, want_ent = old_full_logits(model, ro.sequences, ro.attention_mask, ro.response_len, temperature)
    got = models.response_token_scores(
        model,
        ro.sequences,
        ro.attention_mask,
        ro.response_len,
        temperature=temperature,
        entropy=True,
        raw=True,
        packed=packed,
        chunk_bytes=4 * 12 * 3,
    )  # 3 positions per chunk: many chunks
    assert torch.allclose(got.logprobs[mask], want_lp[mask], atol=1e-5, rtol=1e-5)
    assert torch.allclose(got.entropy[mask], want_ent[mask], atol=1e-5, rtol=1e-5)
    raw_lp, _ = old_full_logits(model, ro.sequences, ro.attention_mask, ro.response_len, 1.0)
    assert torch.allclose(got.raw_logprobs[mask], raw_lp[mask], atol=1e-5, rtol=1e-5)
    assert not got.logprobs[~mask].any()  # padding is 0, not whatever the pad tokens score


@pytest.mark.parametrize("packed", [False, True])
def test_gradients_equal_the_full_logits_path(packed):
    model_a, model_b = _model(1), _model(1)
    ro = _ragged_rollout(3)
    mask = ro.action_mask.bool()
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0))
    lp, ent = old_full_logits(model_a, ro.sequences, ro.attention_mask, ro.response_len)
    ((lp * weights)[mask].sum() + ent[mask].sum()).backward()
    got = models.response_token_scores(
        model_b, ro.sequences, ro.attention_mask, ro.response_len, entropy=True, packed=packed, chunk_bytes=4 * 12 * 2
    )
    ((got.logprobs * weights)[mask].sum() + got.entropy[mask].sum()).backward()
    for (name, pa), (_, pb) in zip(model_a.named_parameters(), model_b.named_parameters()):
        assert torch.allclose(pa.grad, pb.grad, atol=1e-5, rtol=1e-4), name


def test_packed_values_equal_padded_values():
    from transformers import LlamaForTokenClassification

    torch.manual_seed(0)
    critic = LlamaForTokenClassification(tiny_model_config(8, num_labels=1)).eval()
    ro = _ragged_rollout(5)
    mask = ro.action_mask.bool()
    padded = models.response_values(critic, ro.sequences, ro.attention_mask, ro.response_len)
    packed = models.response_values(critic, ro.sequences, ro.attention_mask, ro.response_len, packed=True)
    assert torch.allclose(padded[mask], packed[mask], atol=1e-5)


def test_no_full_vocabulary_logits_are_allocated(monkeypatch):
    """A large vocabulary: the biggest float32 tensor the head produces is one chunk, not [B, R, V]."""
    vocab = 4096
    model = _model(vocab=vocab)
    ro = _ragged_rollout(7, vocab=vocab, batch=8)
    head = model.get_output_embeddings()
    seen = []
    head.register_forward_hook(lambda m, i, o: seen.append(o.numel() // vocab))  # positions scored at once
    chunk_bytes = 4 * vocab * 5
    models.response_token_scores(
        model, ro.sequences, ro.attention_mask, ro.response_len, packed=True, chunk_bytes=chunk_bytes
    )
    tokens = int(ro.action_mask.sum())
    chunks = -(-tokens // 5)
    assert tokens > 5 and max(seen) <= 5 and sum(seen[-chunks:]) == tokens


def test_unknown_output_transform_falls_back_to_full_logits(caplog):
    model = _model(2)
    original = model.forward

    def scaled(*args, token_scores=None, **kwargs):  # an architecture that scales its logits after the head
        out = original(*args, token_scores=token_scores, **kwargs)
        if token_scores is None:
            out.logits = out.logits * 3.0
        return out

    model.forward = scaled
    ro = _ragged_rollout(1)
    got = models.response_logprobs(model, ro.sequences, ro.attention_mask, ro.response_len)
    assert model._hybrid_chunked_ok is False and "differ" in caplog.text
    full = original(
        input_ids=ro.sequences,
        attention_mask=ro.attention_mask,
        position_ids=models.position_ids_from_mask(ro.attention_mask),
    ).logits[:, -ro.response_len - 1 : -1]
    want = torch.log_softmax(full.float() * 3.0, -1).gather(-1, ro.sequences[:, -ro.response_len :, None])[..., 0]
    mask = ro.action_mask.bool()
    assert torch.allclose(got[mask], want[mask], atol=1e-5)


# ---- the packed attention (hybrid_algos.train.packed_attention) -------------------------------------------------
def _arch_model(arch: str, dtype=torch.float32, seed=0, head: str = "lm"):
    """Tiny Llama / Qwen2 (GQA: 4 query heads, 2 KV heads); ``qwen2-sliding`` has a 3-token window in layer 1."""
    import transformers

    from hybrid_algos.train.tiny import tiny_vocab

    torch.manual_seed(seed)
    common = dict(
        vocab_size=len(tiny_vocab(8)),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
        tie_word_embeddings=False,
        num_labels=1,
    )
    if arch == "llama":
        cfg, family = transformers.LlamaConfig(**common), "Llama"
    else:
        window = dict(use_sliding_window=True, sliding_window=3, max_window_layers=1) if arch == "qwen2-sliding" else {}
        cfg, family = transformers.Qwen2Config(**common, **window), "Qwen2"
    cls = getattr(transformers, f"{family}For{'CausalLM' if head == 'lm' else 'TokenClassification'}")
    model = cls(cfg).to(dtype).eval()
    assert model.config._attn_implementation == "sdpa"
    return models.install_token_scores(model) if head == "lm" else model


class _AttentionSpy:
    """Every SDPA call's query length and mask, and whether transformers built an sdpa mask."""

    def __init__(self, monkeypatch):
        from transformers import masking_utils

        self.q_lens, self.masks, self.sdpa_masks = [], [], 0
        sdpa, build = torch.nn.functional.scaled_dot_product_attention, masking_utils.sdpa_mask

        def spy_sdpa(q, k, v, attn_mask=None, *args, **kwargs):
            self.q_lens.append(q.shape[-2])
            self.masks.append(None if attn_mask is None else tuple(attn_mask.shape))
            return sdpa(q, k, v, attn_mask, *args, **kwargs)

        def spy_mask(*args, **kwargs):
            self.sdpa_masks += 1
            return build(*args, **kwargs)

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy_sdpa)
        monkeypatch.setattr(masking_utils, "sdpa_mask", spy_mask)

    def reset(self):
        self.q_lens, self.masks, self.sdpa_masks = [], [], 0


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen2-sliding"])
def test_packed_attention_gives_the_padded_logprobs_without_crossing_samples(monkeypatch, arch, dtype, tol):
    from hybrid_algos.train import packed_attention

    monkeypatch.delenv(packed_attention.ENV, raising=False)
    model = _arch_model(arch, dtype)
    ro = _ragged_rollout(11, batch=7)
    mask = ro.action_mask.bool()
    padded = models.response_token_scores(model, ro.sequences, ro.attention_mask, ro.response_len, entropy=True)
    spy = _AttentionSpy(monkeypatch)
    before = packed_attention.CALLS["segments"]
    packed = models.response_token_scores(
        model, ro.sequences, ro.attention_mask, ro.response_len, entropy=True, packed=True
    )
    assert model.config._attn_implementation == packed_attention.NAME
    assert packed_attention.CALLS["segments"] - before >= 2  # both layers of the packed forward took the loop
    lengths = ro.attention_mask.sum(-1)
    assert spy.sdpa_masks == 0  # no mask built for the packed row, let alone an N x N one
    assert max(spy.q_lens) <= int(lengths.max()) < int(lengths.sum())  # never attended across a whole packed row
    window_masks = {m for m in spy.masks if m is not None}
    assert all(m[-1] == m[-2] <= int(lengths.max()) for m in window_masks)  # at most one sample's window mask
    assert bool(window_masks) == (arch == "qwen2-sliding" and int(lengths.max()) > 3)
    assert torch.allclose(packed.logprobs[mask], padded.logprobs[mask], atol=tol, rtol=tol)
    assert torch.allclose(packed.entropy[mask], padded.entropy[mask], atol=tol, rtol=tol)
    spy.reset()  # the padded path of the switched model: transformers' mask and sdpa, results unchanged
    again = models.response_token_scores(model, ro.sequences, ro.attention_mask, ro.response_len, entropy=True)
    assert spy.sdpa_masks >= 1 and torch.equal(again.logprobs, padded.logprobs)


@pytest.mark.parametrize(
    "arch,checkpointing", [("llama", False), ("llama", True), ("qwen2", False), ("qwen2-sliding", True)]
)
def test_packed_attention_gradients_and_values_equal_the_padded_path(arch, checkpointing):
    """Gradient checkpointing recomputes each layer in the backward pass: it must attend the same way again."""
    from hybrid_algos.train import packed_attention

    ro = _ragged_rollout(4, batch=6)
    mask = ro.action_mask.bool()
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))
    grads = []
    for packed in (False, True):
        model = _arch_model(arch, seed=3)
        model.train()  # dropout is 0 in these configs; training mode must not change the path
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        lp = models.response_logprobs(model, ro.sequences, ro.attention_mask, ro.response_len, packed=packed)
        (lp * weights)[mask].sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert model.config._attn_implementation == packed_attention.NAME
    for name, g in grads[0].items():
        assert torch.allclose(g, grads[1][name], atol=1e-5, rtol=1e-4), name
    critic = _arch_model(arch, seed=5, head="values")
    before = packed_attention.CALLS["segments"]
    padded = models.response_values(critic, ro.sequences, ro.attention_mask, ro.response_len)
    packed = models.response_values(critic, ro.sequences, ro.attention_mask, ro.response_len, packed=True)
    assert packed_attention.CALLS["segments"] > before and critic.config._attn_implementation == packed_attention.NAME
    assert torch.allclose(padded[mask], packed[mask], atol=1e-5)


def test_packed_attention_can_be_switched_off_for_comparison(monkeypatch):
    """HYBRID_PACKED_ATTENTION=sdpa-mask keeps transformers' dense block-diagonal mask (the bench's baseline)."""
    from hybrid_algos.train import packed_attention

    monkeypatch.setenv(packed_attention.ENV, "sdpa-mask")
    model = _arch_model("llama")
    ro = _ragged_rollout(2)
    spy = _AttentionSpy(monkeypatch)
    models.response_logprobs(model, ro.sequences, ro.attention_mask, ro.response_len, packed=True)
    n = int(ro.attention_mask.sum())
    assert model.config._attn_implementation == "sdpa" and (1, 1, n, n) in spy.masks  # the N x N mask, as before
