"""The vLLM adapter's own logic on CPU.

vLLM cannot start an engine without a GPU, so two stand-ins are used here, and only here (the real engine is run by
``bench/engines_gpu.py`` on the GPU):

* ``FakeLLM`` replaces ``vllm.LLM`` (through a fake ``vllm`` module): it records calls and answers ``generate`` with
  a fixed rule. It drives the adapter's state machine (sleep levels, wake tags, the level-2 re-sync guard).
* ``ToyVllmModel`` replaces vLLM's model inside the worker: like vLLM's Llama it fuses ``q/k/v_proj`` into one
  ``qkv_proj`` parameter in ``load_weights`` and returns the names it loaded.

Everything else is real: the worker extension's code, hybrid-core's gloo weight-sync group, ``WeightSender`` on the
trainer side, and CPU shared-memory IPC buckets.
"""

from __future__ import annotations

import socket
import sys
import types
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from hybrid_core.errors import ConfigError, RoleFailure
from hybrid_core.weight_sync import IpcBucketSender, TensorMeta, WeightSender, create_sync_group
from hybrid_engines.hf_engine import EngineStateError
from hybrid_engines.protocol import InferenceEngine, SamplingParams
from hybrid_engines.vllm_worker import RPC_METHODS, HybridWorkerExtension

H = 8
BUCKET = 1024  # smaller than the stream: several buckets per sync


class ToyVllmModel(torch.nn.Module):
    """Stand-in for a vLLM model: fused qkv like vLLM's Llama; load_weights maps checkpoint names, returns loaded."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Parameter(torch.zeros(16, H))
        self.qkv_proj = torch.nn.Parameter(torch.zeros(3 * H, H))

    def load_weights(self, weights):
        loaded = set()
        for name, t in weights:
            if name == "embed_tokens.weight":
                self.embed.data.copy_(t)
                loaded.add("embed")
            else:
                shard = ("q_proj.weight", "k_proj.weight", "v_proj.weight").index(name)
                self.qkv_proj.data[shard * H : (shard + 1) * H].copy_(t)
                loaded.add("qkv_proj")
        return loaded


class CpuWorker(HybridWorkerExtension):
    """The worker extension on a CPU "worker" holding the toy model (vLLM's Worker provides these attributes)."""

    def __init__(self):
        self.rank, self.device, self.model_config, self.model = 0, torch.device("cpu"), None, ToyVllmModel()
        self.free = 100

    def get_model(self):
        return self.model

    def hybrid_free_bytes(self) -> int:  # the real one asks CUDA; the fake engine moves this number instead
        return self.free


def checkpoint(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (n, torch.randn(*s, generator=g))
        for n, s in [
            ("embed_tokens.weight", (16, H)),
            ("q_proj.weight", (H, H)),
            ("k_proj.weight", (H, H)),
            ("v_proj.weight", (H, H)),
        ]
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeLLM:
    """Stand-in for ``vllm.LLM``: collective_rpc runs the real worker extension on a ``CpuWorker``."""

    def __init__(self, **kwargs):
        self.kwargs, self.calls, self.worker = kwargs, [], CpuWorker()
        self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(world_size=1)))

    def generate(self, prompts, sampling_params, use_tqdm):
        self.calls.append(("generate", len(prompts)))
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        outs = []
        for p, sp in zip(prompts, params):
            assert sp.kw["n"] == 1 or sp.kw["seed"] is None  # what vLLM needs of n > 1 (children seed, seed + 1, ..)
            children = []
            for j in range(sp.kw["n"]):  # vLLM's fan-out: n children of one request
                base = sum(p["prompt_token_ids"]) + (sp.kw["seed"] or 0) % 7 + 11 * j
                ids = [(base + k) % 50 for k in range(sp.kw["max_tokens"])]
                steps = [{t: SimpleNamespace(logprob=-0.5 * k)} for k, t in enumerate(ids)]
                children.append(SimpleNamespace(token_ids=ids, logprobs=steps, finish_reason="length"))
            outs.append(SimpleNamespace(outputs=children))
        return outs

    def sleep(self, level):
        self.calls.append(("sleep", level))
        self.worker.free += 50

    def wake_up(self, tags):
        self.calls.append(("wake_up", tuple(tags)))
        self.worker.free -= 25 * len(tags)

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(("rpc", method, timeout))
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))
        return True


@pytest.fixture
def engine(monkeypatch):
    fake_vllm = types.ModuleType("vllm")
    fake_vllm.LLM = FakeLLM
    fake_vllm.SamplingParams = lambda **kw: SimpleNamespace(kw=kw)
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm)
    for key in ("VLLM_USE_FLASHINFER_SAMPLER", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        monkeypatch.delenv(key, raising=False)
    from hybrid_engines.vllm_engine import VLLMEngine

    return VLLMEngine("/nonexistent/model", enforce_eager=True, rpc_timeout_s=42.0)


def sync(engine, weights, rank_offset: int = 1):
    """The trainer (rank 0, this thread) sends ``weights`` while the engine receives (worker thread)."""
    port = free_port()
    metas = [TensorMeta.of(n, t) for n, t in weights]
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(
            engine.init_weight_update_group, "127.0.0.1", port, rank_offset, 2, backend="gloo", timeout_s=30
        )
        group = create_sync_group("127.0.0.1", port, 0, 2, backend="gloo", timeout_s=30)
        joined.result(timeout=60)
        got = pool.submit(engine.update_weights, metas, bucket_bytes=BUCKET)
        sent = WeightSender(group, BUCKET).send(weights)
        stats = got.result(timeout=60)
    group.close()
    return sent, stats


def test_engine_is_built_with_the_worker_extension_raw_logprobs_and_env_defaults(engine):
    kw = engine.llm.kwargs
    module, cls = kw["worker_extension_cls"].rsplit(".", 1)
    assert getattr(__import__(module, fromlist=[cls]), cls) is HybridWorkerExtension
    assert kw["logprobs_mode"] == "raw_logprobs" and kw["enable_sleep_mode"] is True
    assert "distributed_executor_backend" not in kw  # TP = 1 runs in-process
    import os

    assert os.environ["VLLM_USE_FLASHINFER_SAMPLER"] == "0" and os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert isinstance(engine, InferenceEngine)


def test_generate_maps_rows_back_to_prompts_with_the_sampled_tokens_logprobs(engine):
    out = engine.generate([[1, 2], [3]], SamplingParams(n=2, seed=4, max_new_tokens=3, temperature=0.9))
    assert [len(o) for o in out] == [2, 2]
    for prompt, per_prompt in zip([[1, 2], [3]], out):
        for o in per_prompt:
            assert o.prompt_token_ids == prompt and len(o.token_ids) == 3 and o.logprobs == [0.0, -0.5, -1.0]
    assert out[0][0].token_ids != out[1][0].token_ids  # prompt order kept
    greedy = engine.generate([[1, 2]], SamplingParams(temperature=0.0, n=2, max_new_tokens=2, logprobs=False))
    assert greedy[0][0].token_ids == greedy[0][1].token_ids and greedy[0][0].logprobs is None


def test_unseeded_sampling_is_one_request_per_prompt_and_seeded_or_greedy_one_per_sample(engine):
    prompts = [[1, 2], [3], [4, 4]]
    out = engine.generate(prompts, SamplingParams(n=3, max_new_tokens=2, temperature=0.8))
    assert engine.llm.calls[-1] == ("generate", 3)  # vLLM fans each prompt out into its n samples
    assert [len(o) for o in out] == [3, 3, 3]
    for prompt, per_prompt in zip(prompts, out):
        assert all(o.prompt_token_ids == prompt and o.logprobs == [0.0, -0.5] for o in per_prompt)
        assert len({tuple(o.token_ids) for o in per_prompt}) == 3  # each child is its own sample
    engine.generate(prompts, SamplingParams(n=3, max_new_tokens=2, seed=5))
    assert engine.llm.calls[-1] == ("generate", 9)  # seeded: a request (and a seed) per sample
    engine.generate(prompts, SamplingParams(n=3, max_new_tokens=2, temperature=0.0))
    assert engine.llm.calls[-1] == ("generate", 9)  # greedy n > 1: vLLM refuses it as one request
    no_lp = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=2, logprobs=False))
    assert all(o.logprobs is None for per_prompt in no_lp for o in per_prompt)


def test_a_prompt_missing_samples_fails_loudly(engine, monkeypatch):
    real = engine.llm.generate

    def short(prompts, sampling_params, use_tqdm):
        outs = real(prompts, sampling_params, use_tqdm)
        outs[0].outputs.pop()
        return outs

    monkeypatch.setattr(engine.llm, "generate", short)
    with pytest.raises(RoleFailure, match="came back with 1 samples, not n=2"):
        engine.generate([[1], [2]], SamplingParams(n=2, max_new_tokens=2))


def test_weights_arrive_through_the_worker_into_the_fused_parameter(engine):
    weights = checkpoint(1)
    sent, stats = sync(engine, weights)
    model = engine.llm.worker.model
    assert torch.equal(model.embed, weights[0][1])
    assert torch.equal(model.qkv_proj, torch.cat([t for _, t in weights[1:]]))
    assert stats.bytes == sent.bytes == sum(t.numel() * 4 for _, t in weights)
    assert engine.llm.calls[-1] == ("reset_prefix_cache",)
    assert ("rpc", "hybrid_receive_weights", 42.0) in engine.llm.calls  # every collective_rpc carries the timeout


def test_level_two_sleep_refuses_to_generate_until_every_parameter_is_reloaded(engine):
    prompts, params = [[1, 2]], SamplingParams(max_new_tokens=2)
    stats = engine.sleep(2)
    assert stats.bytes == 50 and ("sleep", 2) in engine.llm.calls
    with pytest.raises(EngineStateError, match="asleep"):
        engine.generate(prompts, params)
    engine.wake_up(["weights"])
    with pytest.raises(EngineStateError, match="KV cache"):
        engine.generate(prompts, params)
    engine.wake_up(["kv_cache"])
    assert [c for c in engine.llm.calls if c[0] == "wake_up"] == [("wake_up", ("weights",)), ("wake_up", ("kv_cache",))]
    with pytest.raises(EngineStateError, match="2 parameter"):
        engine.generate(prompts, params)
    sync(engine, checkpoint(2)[:1])  # only the embedding: qkv still missing
    with pytest.raises(EngineStateError, match="qkv_proj"):
        engine.generate(prompts, params)
    sync(engine, checkpoint(2)[1:])
    assert len(engine.generate(prompts, params)[0]) == 1


def test_level_one_sleep_keeps_weights_and_wake_is_per_tag(engine):
    engine.sleep(1)
    engine.sleep(1)  # already asleep: nothing more to do
    assert [c for c in engine.llm.calls if c[0] == "sleep"] == [("sleep", 1)]
    stats = engine.wake_up()
    assert stats.bytes == 50
    assert engine.generate([[1]], SamplingParams(max_new_tokens=1))[0][0].token_ids
    engine.wake_up()  # awake: nothing to wake
    assert [c for c in engine.llm.calls if c[0] == "wake_up"] == [("wake_up", ("weights", "kv_cache"))]


def test_sleeping_while_half_awake_wakes_first_so_the_level_holds(engine):
    engine.sleep(1)
    engine.wake_up(["weights"])
    engine.sleep(2)
    assert [c for c in engine.llm.calls if c[0] in ("sleep", "wake_up")][-2:] == [
        ("wake_up", ("kv_cache",)),
        ("sleep", 2),
    ]


def test_ipc_buckets_load_through_the_worker(engine):
    weights = checkpoint(3)
    results = []
    sender = IpcBucketSender(BUCKET, device="cpu")
    stats = sender.send(
        weights, deliver=lambda b: results.append(engine.update_weights_from_ipc(b)), wait=lambda _: None
    )
    sender.close()
    model = engine.llm.worker.model
    assert torch.equal(model.qkv_proj, torch.cat([t for _, t in weights[1:]]))
    assert sum(r.bytes for r in results) == stats.bytes
    assert len(results) >= 2
    # the prefix cache goes once per sync, with the delivery marked last (WeightSync no longer resets it after)
    resets = [i for i, c in enumerate(engine.llm.calls) if c == ("reset_prefix_cache",)]
    assert len(resets) == 1 and resets[0] == len(engine.llm.calls) - 1


def test_a_bucket_from_another_gpu_is_refused(engine):
    weights = checkpoint(4)
    sender = IpcBucketSender(BUCKET, device="cpu")
    with pytest.raises(RuntimeError, match="exactly one IPC bucket"):
        sender.send(
            weights,
            deliver=lambda b: engine.update_weights_from_ipc(
                [SimpleNamespace(handle=SimpleNamespace(device_uuid="GPU-other"))]
            ),
            wait=lambda _: None,
        )
    sender.close()


def test_state_errors_and_bad_arguments(engine):
    with pytest.raises(EngineStateError, match="init_weight_update_group"):
        engine.update_weights([], bucket_bytes=BUCKET)
    with pytest.raises(ConfigError) as e:
        engine.init_weight_update_group("127.0.0.1", 1234, 0, 2)
    assert e.value.field == "rank_offset"
    for bad in ({"level": 3},):
        with pytest.raises(ConfigError):
            engine.sleep(**bad)
    with pytest.raises(ConfigError):
        engine.wake_up(["weights", "cuda_graph"])
    engine.shutdown()
    with pytest.raises(EngineStateError, match="shut down"):
        engine.generate([[1]], SamplingParams())


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"weight_loading": "fast"}, "weight_loading"),
        ({"tensor_parallel_size": 2, "bundle_indices": [0]}, "bundle_indices"),
        ({"tensor_parallel_size": 2, "bundle_indices": [1, 1]}, "bundle_indices"),
    ],
)
def test_bad_constructor_arguments_fail_before_vllm_is_imported(kwargs, field, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # importing vllm would fail: the check must come first
    from hybrid_engines.vllm_engine import VLLMEngine

    with pytest.raises(ConfigError) as e:
        VLLMEngine("m", **kwargs)
    assert e.value.field == field


def test_worker_methods_all_carry_the_hybrid_prefix():
    public = {n for n in dir(HybridWorkerExtension) if not n.startswith("__")}
    assert set(RPC_METHODS) <= public
    assert all(n.startswith(("hybrid_", "_hybrid_")) for n in public)  # vLLM refuses names its Worker already has
