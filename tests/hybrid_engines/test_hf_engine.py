"""The built-in engine generates for real: tiny random Llama / GPT-2 models, float32 on CPU, checked against direct
forward passes."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from hybrid_core.errors import ConfigError
from hybrid_engines import SamplingParams
from hybrid_engines.hf_engine import HFEngine
from hybrid_engines.registry import make_engine

VOCAB = 96


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny models run fastest single-threaded; on a shared 2-core machine, spinning OpenMP threads cost 20x."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_config(**overrides) -> LlamaConfig:
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


def tiny_model(seed: int = 0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_config(**overrides)).eval()


def tiny_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    """Absolute position embeddings: wrong position ids under left padding change its outputs (RoPE hides them)."""
    torch.manual_seed(seed)
    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=VOCAB,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=256,
            initializer_range=0.2,
            bos_token_id=None,
            eos_token_id=None,
        )
    ).eval()


def prompts_of(lengths, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


LENGTHS = [3, 9, 5, 1, 12, 7, 2, 8]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def engine(model):
    return HFEngine(model, device="cpu", max_batch_size=64)


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def any_model(request):
    return tiny_model() if request.param == "llama" else tiny_gpt2()


@torch.inference_mode()
def naive_greedy(model, prompt, steps):
    """Reference decoding: a full forward pass over the whole sequence for every token, no cache, no padding."""
    seq = list(prompt)
    for _ in range(steps):
        seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt) :]


@torch.inference_mode()
def direct_logprobs(model, prompt, completion):
    logits = model(torch.tensor([prompt + completion])).logits[0].float()
    lp = torch.log_softmax(logits, -1)[len(prompt) - 1 : len(prompt) - 1 + len(completion)]
    return lp.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def test_greedy_matches_uncached_decoding_and_is_deterministic(any_model):
    model, engine = any_model, HFEngine(any_model, device="cpu")
    prompts = prompts_of(LENGTHS)
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    first = engine.generate(prompts, params)
    again = engine.generate(prompts, params)
    for p, outs, outs2 in zip(prompts, first, again):
        assert len(outs) == 1 and outs[0].finish_reason == "length"
        assert outs[0].token_ids == naive_greedy(model, p, 12)
        assert outs[0].token_ids == outs2[0].token_ids
        assert outs[0].prompt_token_ids == p
    plain = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=12, logprobs=False))
    assert [o[0].token_ids for o in plain] == [o[0].token_ids for o in first]
    assert all(o[0].logprobs is None for o in plain)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_new_tokens=10),
        SamplingParams(temperature=0.7, top_p=0.8, top_k=20, max_new_tokens=10, n=3, seed=5),
        SamplingParams(temperature=1.3, max_new_tokens=10, n=2, seed=6, stop_token_ids=(4, 9, 17), min_new_tokens=2),
    ],
)
def test_logprobs_equal_a_direct_forward_pass(any_model, params):
    model, engine = any_model, HFEngine(any_model, device="cpu", max_batch_size=8)
    prompts = prompts_of(LENGTHS, seed=2)
    outputs = engine.generate(prompts, params)
    for p, outs in zip(prompts, outputs):
        assert len(outs) == params.n
        for o in outs:
            ref = direct_logprobs(model, p, o.token_ids)
            assert torch.allclose(torch.tensor(o.logprobs), ref, atol=1e-5, rtol=0), (p, o.token_ids)


def test_seeded_sampling_reproduces_and_ignores_batch_composition(engine):
    prompts = prompts_of(LENGTHS, seed=3)
    params = SamplingParams(temperature=1.0, max_new_tokens=16, n=2, seed=123)
    ids = lambda outs: [[o.token_ids for o in per_prompt] for per_prompt in outs]  # noqa: E731
    full = ids(engine.generate(prompts, params))
    assert full == ids(engine.generate(prompts, params))
    # alone, reversed, and chunked into micro-batches of 2 rows: the same samples per prompt
    assert ids(engine.generate([prompts[4]], params)) == [full[4]]
    assert ids(engine.generate(prompts[::-1], params)) == full[::-1]
    small = HFEngine(engine.model, device="cpu", max_batch_size=2)
    assert ids(small.generate(prompts, params)) == full
    # another seed: other samples; the n samples of one prompt differ from each other
    other = ids(engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=16, n=2, seed=124)))
    assert other != full
    assert all(a != b for a, b in full)
    # repeated prompts in one call get different samples
    twice = ids(engine.generate([prompts[0], prompts[0]], SamplingParams(temperature=1.0, max_new_tokens=16, seed=9)))
    assert twice[0] != twice[1]


def test_unseeded_calls_differ_but_follow_the_engine_seed(model):
    prompts = prompts_of([4, 6])
    params = SamplingParams(temperature=1.0, max_new_tokens=16)
    a, b = HFEngine(model, device="cpu", seed=7), HFEngine(model, device="cpu", seed=7)
    first_a, first_b = a.generate(prompts, params), b.generate(prompts, params)
    assert [o[0].token_ids for o in first_a] == [o[0].token_ids for o in first_b]
    assert [o[0].token_ids for o in a.generate(prompts, params)] != [o[0].token_ids for o in first_a]


@torch.inference_mode()
def first_token_probs(model, prompt, temperature=1.0):
    return torch.softmax(model(torch.tensor([prompt])).logits[0, -1].float() / temperature, -1)


def sample_first_tokens(engine, prompt, **kw) -> torch.Tensor:
    outs = engine.generate([prompt], SamplingParams(max_new_tokens=1, n=4000, seed=11, **kw))[0]
    return torch.tensor([o.token_ids[0] for o in outs])


def test_sampling_follows_the_model_distribution(engine, model):
    prompt = prompts_of([5], seed=4)[0]
    for temperature in (1.0, 0.5):
        probs = first_token_probs(model, prompt, temperature)
        freq = torch.bincount(sample_first_tokens(engine, prompt, temperature=temperature), minlength=VOCAB) / 4000
        assert 0.5 * (freq - probs).abs().sum() < 0.06  # total variation; ~0.03 expected from 4000 draws


def test_top_k_and_top_p_restrict_the_support(engine, model):
    prompt = prompts_of([6], seed=5)[0]
    probs = first_token_probs(model, prompt)
    top5 = set(probs.topk(5).indices.tolist())
    assert set(sample_first_tokens(engine, prompt, top_k=5).tolist()) == top5
    order = probs.argsort(descending=True)
    mass_before = probs[order].cumsum(0) - probs[order]
    nucleus = set(order[mass_before < 0.5].tolist())
    got = set(sample_first_tokens(engine, prompt, top_p=0.5).tolist())
    assert got <= nucleus and len(got) == len(nucleus)


def test_stop_tokens_min_new_tokens_and_finish_reason(engine, model):
    prompt = prompts_of([7], seed=6)[0]
    free = naive_greedy(model, prompt, 10)
    stop = free[3]
    cut = free.index(stop)
    out = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=10, stop_token_ids=(stop,)))[0][0]
    assert out.token_ids == free[: cut + 1] and out.finish_reason == "stop"
    held = engine.generate(
        [prompt], SamplingParams(temperature=0, max_new_tokens=10, stop_token_ids=(stop,), min_new_tokens=cut + 2)
    )[0][0]
    assert stop not in held.token_ids[: cut + 2]
    assert len(held.logprobs) == len(held.token_ids)
    # min_new_tokens suppresses stop tokens for sampling only: logprobs stay those of the raw model
    assert torch.allclose(torch.tensor(held.logprobs), direct_logprobs(model, prompt, held.token_ids), atol=1e-5)


def test_rows_that_stop_early_leave_the_batch_without_changing_the_others(engine, model):
    prompts = prompts_of(LENGTHS, seed=8)
    frees = [naive_greedy(model, p, 12) for p in prompts]
    stop = frees[0][1]  # stops some rows early, others never
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=(stop,)))
    for free, o in zip(frees, outs):
        expected = free[: free.index(stop) + 1] if stop in free else free
        assert o[0].token_ids == expected
        assert o[0].finish_reason == ("stop" if stop in free else "length")


def test_model_eos_stops_unless_disabled():
    model = tiny_model(seed=3)
    prompt = prompts_of([5], seed=9)[0]
    free = naive_greedy(model, prompt, 8)
    model.generation_config.eos_token_id = free[2]
    with_eos = HFEngine(model, device="cpu").generate([prompt], SamplingParams(temperature=0, max_new_tokens=8))
    assert with_eos[0][0].token_ids == free[: free.index(free[2]) + 1] and with_eos[0][0].finish_reason == "stop"
    ignoring = HFEngine(model, device="cpu", stop_at_eos=False).generate(
        [prompt], SamplingParams(temperature=0, max_new_tokens=8)
    )
    assert ignoring[0][0].token_ids == free


def test_bad_requests_name_the_field(engine):
    cases = [
        ([], "prompt_token_ids"),
        ("hello", "prompt_token_ids"),
        ([[1, 2], []], "prompt_token_ids"),
        ([[1, VOCAB]], "prompt_token_ids"),
        ([[1, -1]], "prompt_token_ids"),
    ]
    for prompts, field in cases:
        with pytest.raises(ConfigError) as e:
            engine.generate(prompts, SamplingParams())
        assert e.value.field == field
    with pytest.raises(ConfigError) as e:
        engine.generate([[1]], SamplingParams(stop_token_ids=(VOCAB + 3,)))
    assert e.value.field == "stop_token_ids"
    with pytest.raises(ConfigError) as e:
        engine.generate([[1] * 200], SamplingParams(max_new_tokens=100))
    assert e.value.field == "max_new_tokens"
    with pytest.raises(ConfigError) as e:
        HFEngine(12345)
    assert e.value.field == "model"


def test_config_built_engine_is_seeded_and_runs_in_bfloat16():
    a, b = HFEngine(tiny_config(), seed=4, device="cpu"), HFEngine(tiny_config(), seed=4, device="cpu")
    assert all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters()))
    bf = HFEngine(tiny_model(), device="cpu", dtype="bfloat16")
    assert next(bf.model.parameters()).dtype == torch.bfloat16
    prompt = prompts_of([6])[0]
    out = bf.generate([prompt], SamplingParams(temperature=0, max_new_tokens=6))[0][0]
    ref = direct_logprobs(bf.model, prompt, out.token_ids)  # logits of the bf16 model, in float32
    assert torch.allclose(torch.tensor(out.logprobs), ref, atol=0.05)


def test_a_batch_of_16_prompts_times_16_tokens_is_one_batched_decode(engine):
    """16 prompts x 16 tokens take 16 forward passes of the whole batch (one per token), not 256 (speed: bench/)."""
    prompts = prompts_of([8 + i % 5 for i in range(16)], seed=10)
    params = SamplingParams(temperature=1.0, max_new_tokens=16, seed=1)
    forwards = []
    hook = engine.model.register_forward_hook(lambda module, args, output: forwards.append(1))
    try:
        outs = engine.generate(prompts, params)
    finally:
        hook.remove()
    assert sum(len(o[0].token_ids) for o in outs) == 256
    assert len(forwards) == 16, f"{len(forwards)} forward passes for 16 tokens of 16 prompts"


def test_registry_builds_engines_and_names_missing_extras():
    eng = make_engine("hf", model=tiny_config(), device="cpu")
    assert isinstance(eng, HFEngine)
    with pytest.raises(ConfigError) as e:
        make_engine("tgi", model="x")
    assert e.value.field == "backend"
    for backend, library in (("vllm", "vllm"), ("sglang", "sglang")):
        try:
            __import__(library)
        except ImportError:
            with pytest.raises(ConfigError, match=rf"hybrid-engines\[{backend}\]"):
                make_engine(backend, model="x")


def test_importing_the_package_imports_no_backend_library():
    code = (
        "import sys, hybrid_engines; from hybrid_engines import SamplingParams, make_engine; "
        "print(sorted(m for m in ('vllm', 'sglang', 'ray', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"
