"""StateOffloader on CPU (device="cpu": the "device" storages are really freed) with a real tiny Llama.

Checked: storages hold no bytes while asleep (params, all buffers incl. the non-persistent rotary inv_freq, grads,
Adam state); outputs are bit-exact after waking; a training step after a cycle equals one without it; the fast
steady state (one flat buffer per dtype, host buffers reused) is reached; aliases survive; misuse is refused.
"""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hybrid_core.errors import ConfigError
from hybrid_core.offload import AsleepError, Sleepable, StateOffloader


def tiny_llama(tie: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )
    return LlamaForCausalLM(cfg).eval()


TOKENS = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))


def train_step(model, opt) -> float:
    opt.zero_grad()
    loss = model(TOKENS, labels=TOKENS).loss
    loss.backward()
    opt.step()
    return loss.item()


def state_tensors(model, opt):
    out = list(model.parameters()) + list(model.buffers())
    out += [p.grad for p in model.parameters() if p.grad is not None]
    out += [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return out


def pair():
    """The same model and AdamW twice: one will sleep, the reference never does."""
    model = tiny_llama()
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    return model, opt, ref, ref_opt


def test_asleep_holds_no_storage_and_wakes_bit_exact_including_inv_freq():
    model, opt, ref, ref_opt = pair()
    train_step(model, opt), train_step(ref, ref_opt)
    assert "model.rotary_emb.inv_freq" in dict(model.named_buffers())
    assert "model.rotary_emb.inv_freq" not in model.state_dict()  # non-persistent: a state-dict trip would lose it
    off = StateOffloader(model, opt)
    assert isinstance(off, Sleepable)
    stats = off.sleep()
    assert off.asleep and stats.bytes >= off.device_bytes() * 0.9 and stats.seconds > 0 and stats.gbps > 0
    held = state_tensors(model, opt)
    assert len(held) > 3 * len(list(model.parameters()))  # params, buffers, grads, exp_avg, exp_avg_sq, step
    assert all(t.untyped_storage().nbytes() == 0 for t in held)
    with pytest.raises(AsleepError):
        model(TOKENS)
    with pytest.raises(AsleepError):
        opt.step()
    woke = off.wake()
    assert not off.asleep and woke.bytes >= stats.bytes
    with torch.no_grad():
        assert torch.equal(model(TOKENS).logits, ref(TOKENS).logits)
    for a, b in zip(state_tensors(model, opt), state_tensors(ref, ref_opt)):
        assert torch.equal(a, b)


def test_training_after_cycles_equals_training_without_them():
    model, opt, ref, ref_opt = pair()
    off = StateOffloader(model, opt)  # before the first step: Adam state is created later and handled then
    losses, ref_losses = [], []
    for _ in range(4):
        off.sleep()
        off.wake()
        losses.append(train_step(model, opt))
        ref_losses.append(train_step(ref, ref_opt))
    assert losses == ref_losses
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def test_steady_state_is_one_flat_buffer_per_dtype_and_reuses_host_memory():
    model = tiny_llama().to(torch.bfloat16)
    master = [p.detach().float().clone().requires_grad_() for p in model.parameters()]  # mixed precision
    opt = torch.optim.AdamW(master, lr=1e-2)
    for p in master:
        p.grad = torch.randn_like(p)
    opt.step()
    opt.zero_grad()
    off = StateOffloader(model, opt, chunk_bytes=4096)  # small chunks: many chunked copies per buffer
    first_alloc = off.host_alloc.bytes
    assert first_alloc > 0
    off.sleep(), off.wake()
    ptrs = {(t.dtype, t.untyped_storage().data_ptr()) for t in state_tensors(model, opt) if t.dim() > 0}
    assert {dtype for dtype, _ in ptrs} == {torch.bfloat16, torch.float32}
    assert len(ptrs) == 2  # every tensor of a dtype is a view into that dtype's one flat buffer
    before = [t.clone() for t in state_tensors(model, opt)]
    groups = dict(off._groups)
    slept, woke = off.sleep().bytes, off.wake().bytes
    assert off._groups == groups and all(off._groups[d] is g for d, g in groups.items())  # fast path: no re-layout
    assert slept == woke == off.device_bytes()
    assert off._host.alloc_bytes == first_alloc  # nothing allocated after construction
    for a, b in zip(before, state_tensors(model, opt)):
        assert torch.equal(a, b)


def test_gradients_survive_and_aliases_see_the_memory_come_back():
    model = tiny_llama(tie=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model(TOKENS, labels=TOKENS).loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    alias = model.lm_head.weight.data  # another tensor object on the same storage
    off = StateOffloader(model)
    for cycle in range(3):  # the first cycle re-homes tensors into the flat buffer, later ones take the fast path
        off.sleep()
        assert alias.untyped_storage().nbytes() == 0
        off.wake()
        assert torch.equal(alias, weights["model.embed_tokens.weight"])
        for n, p in model.named_parameters():
            assert torch.equal(p, weights[n]) and torch.equal(p.grad, grads[n])
        if cycle == 0:
            group = off._groups[torch.float32]
        assert off._groups[torch.float32] is group
    # the aliased storage was restored in place (its own home), everything else went into the flat buffer
    assert len(group.homes) == 2 and group.homes[1].storage.data_ptr() == alias.data_ptr()
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_dropped_gradients_are_not_restored_and_layout_adapts():
    model, opt, ref, _ref_opt = pair()
    off = StateOffloader(model, opt)
    model(TOKENS, labels=TOKENS).loss.backward()
    off.sleep(), off.wake()
    with_grads = off.device_bytes()
    opt.zero_grad(set_to_none=True)
    off.sleep(), off.wake()
    assert off.device_bytes() < with_grads
    assert all(p.grad is None for p in model.parameters())
    with torch.no_grad():
        assert torch.equal(model(TOKENS).logits, ref(TOKENS).logits)


def test_sleep_and_wake_twice_are_no_ops():
    model = tiny_llama()
    off = StateOffloader(model)
    assert off.wake().bytes == 0
    assert off.sleep().bytes > 0 and off.sleep().bytes == 0
    assert off.wake().bytes > 0 and off.wake().bytes == 0


def test_bad_arguments_name_the_field():
    with pytest.raises(ConfigError) as e:
        StateOffloader()
    assert e.value.field == "StateOffloader"
    with pytest.raises(ConfigError) as e:
        StateOffloader(tiny_llama(), chunk_bytes=0)
    assert e.value.field == "chunk_bytes"
    with pytest.raises(ConfigError) as e:
        StateOffloader(torch.nn.ReLU())
    assert e.value.field == "module"
