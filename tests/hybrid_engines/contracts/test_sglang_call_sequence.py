"""The order and arguments of the SGLang adapter's calls into ``sglang.Engine`` (0.5.16's and 0.5.23's protocol).

SGLang cannot run here, so ``RecordingEngine`` stands in for ``sglang.Engine`` (through a fake ``sglang`` module):
it records calls and answers as SGLang does (``(success, message)`` tuples, ``None`` from the memory calls, a
``.success`` object from ``flush_cache``, dicts from ``generate``); ``Engine0516`` lacks the weight-update session
methods, as 0.5.16 does. Only this file uses them; the names themselves are checked against the real package by
``test_sglang_contract.py``, and the serialized IPC buckets are read by SGLang's own code there.
"""

from __future__ import annotations

import os
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from hybrid_core.errors import ConfigError, RoleFailure
from hybrid_core.weight_sync import IpcBucketSender, TensorMeta
from hybrid_engines.hf_engine import EngineStateError
from hybrid_engines.protocol import InferenceEngine, SamplingParams


class RecordingEngine:
    """Stand-in for sglang.Engine: records (method, kwargs); fails a method named in ``fail``."""

    def __init__(self, **kwargs):
        self.kwargs, self.calls, self.fail = kwargs, [], set()

    def _record(self, name, **kw):
        self.calls.append((name, kw))
        return (name not in self.fail, f"{name} said no" if name in self.fail else "ok")

    def generate(self, input_ids, sampling_params, return_logprob):
        self.calls.append(("generate", {"n": len(input_ids), "sampling_params": sampling_params}))
        outs = []
        for ids, sp in zip(input_ids, sampling_params):
            toks = [(sum(ids) + k) % 50 for k in range(sp["max_new_tokens"])]
            meta = {"finish_reason": {"type": "length", "length": len(toks)}}
            if return_logprob:
                meta["output_token_logprobs"] = [(-0.25 * k, t, None) for k, t in enumerate(toks)]
            outs.append({"output_ids": toks, "meta_info": meta})
        return outs

    def release_memory_occupation(self, tags=None):
        self.calls.append(("release_memory_occupation", {"tags": tags}))

    def resume_memory_occupation(self, tags=None):
        self.calls.append(("resume_memory_occupation", {"tags": tags}))

    def flush_cache(self):
        self.calls.append(("flush_cache", {}))
        return SimpleNamespace(success=True, message="")

    def init_weights_update_group(self, **kw):
        return self._record("init_weights_update_group", **kw)

    def begin_weight_update(self):
        return self._record("begin_weight_update")

    def end_weight_update(self):
        return self._record("end_weight_update")

    def update_weights_from_distributed(self, **kw):
        return self._record("update_weights_from_distributed", **kw)

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.payloads = list(named_tensors)
        return self._record("update_weights_from_tensor", load_format=load_format, flush_cache=flush_cache)

    def shutdown(self):
        self.calls.append(("shutdown", {}))


class Engine0516(RecordingEngine):
    """0.5.16: no weight-update sessions (updates run without begin/end)."""

    def __getattribute__(self, name):
        if name in ("begin_weight_update", "end_weight_update"):
            raise AttributeError(name)
        return super().__getattribute__(name)


@pytest.fixture(params=["0.5.23", "0.5.16"])
def make(request, monkeypatch):
    fake = types.ModuleType("sglang")
    fake.Engine = RecordingEngine if request.param == "0.5.23" else Engine0516
    monkeypatch.setitem(sys.modules, "sglang", fake)
    monkeypatch.delenv("SGLANG_RETURN_ORIGINAL_LOGPROB", raising=False)
    from hybrid_engines.sglang_engine import SGLangEngine

    factory = lambda **kw: SGLangEngine("/nonexistent/model", **kw)  # noqa: E731
    factory.sessions = request.param == "0.5.23"
    return factory


def with_sessions(make, names):
    """The calls ``names`` as the fake version makes them (0.5.16: no begin/end)."""
    return names if make.sessions else [n for n in names if n not in ("begin_weight_update", "end_weight_update")]


def names(engine):
    return [c[0] for c in engine.engine.calls]


def test_server_arguments_and_raw_logprobs(make):
    e = make(enforce_eager=True, enable_prefix_caching=False, max_model_len=512)
    kw = e.engine.kwargs
    assert kw["disable_cuda_graph"] is True  # eager = CUDA graphs off (the seed project had this negated)
    # SGLang keeps 6 tokens of context_length back from every input: max_model_len is prompt + completion as vLLM's
    assert kw["disable_radix_cache"] is True and kw["context_length"] == 512 + 6 and kw["enable_memory_saver"] is True
    assert kw["model_path"] == "/nonexistent/model" and kw["mem_fraction_static"] == 0.5
    assert os.environ["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "1"
    assert isinstance(e, InferenceEngine)


def test_context_length_leaves_sglang_its_reserve_within_the_models_positions(tmp_path):
    """A 3-token prompt with max_model_len 5 (the built-in demo) failed on the GPU: SGLang took context_length 5 and
    then allowed inputs of at most -1 tokens. The reserve is added, capped by the model's own positions."""
    import json

    from hybrid_engines.sglang_engine import SGLANG_CONTEXT_RESERVE, sglang_context_length

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 256}))
    assert sglang_context_length(tmp_path, 5) == 5 + SGLANG_CONTEXT_RESERVE
    assert sglang_context_length(tmp_path, 5) - 1 - 5 > 3  # SGLang's input bound then admits the demo's prompt
    assert sglang_context_length(tmp_path, 255) == 256  # never past the positions (SGLang refuses a longer context)
    assert sglang_context_length(tmp_path, None) is None
    assert sglang_context_length("org/hub-name", 100) == 100 + SGLANG_CONTEXT_RESERVE


def test_scaled_logprobs_setting_is_refused(make, monkeypatch):
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "0")
    from hybrid_engines.sglang_engine import SGLangEngine

    with pytest.raises(ConfigError) as err:
        SGLangEngine("/nonexistent/model")
    assert err.value.field == "SGLANG_RETURN_ORIGINAL_LOGPROB"


def test_generate_sends_one_row_per_completion_and_reads_logprobs(make):
    e = make()
    out = e.generate([[1, 2], [3]], SamplingParams(n=2, max_new_tokens=3))
    call = e.engine.calls[-1][1]
    assert call["n"] == 4 and all(sp["n"] == 1 for sp in call["sampling_params"])
    assert [len(o) for o in out] == [2, 2] and out[1][0].prompt_token_ids == [3]
    assert out[0][0].logprobs == [0.0, -0.25, -0.5] and out[0][0].finish_reason == "length"


def test_seeds_need_deterministic_inference(make):
    with pytest.raises(ConfigError) as err:
        make(deterministic=False).generate([[1]], SamplingParams(seed=1))
    assert err.value.field == "seed"
    assert make(deterministic=False).engine.kwargs["enable_deterministic_inference"] is False
    e = make()  # the default: the loop's seeded sampling works
    assert e.engine.kwargs["enable_deterministic_inference"] is True
    e.generate([[1]], SamplingParams(seed=1, n=2))
    seeds = [sp["sampling_seed"] for sp in e.engine.calls[-1][1]["sampling_params"]]
    assert None not in seeds and len(set(seeds)) == 2


def test_unseeded_samples_of_one_prompt_differ_in_deterministic_mode(make):
    # SGLang's deterministic mode seeds every request without a sampling_seed with 42 (sampling_batch_info.py): the
    # n samples of a prompt would be one sequence n times, and a GRPO group of equal answers learns nothing.
    e = make()
    e.generate([[1, 2], [1, 2]], SamplingParams(n=4))
    first = [sp["sampling_seed"] for sp in e.engine.calls[-1][1]["sampling_params"]]
    assert None not in first and len(set(first)) == 8
    e.generate([[1, 2], [1, 2]], SamplingParams(n=4))
    assert not set(first) & {sp["sampling_seed"] for sp in e.engine.calls[-1][1]["sampling_params"]}
    e.generate([[1, 2]], SamplingParams(n=2, temperature=0.0))  # greedy needs no seed
    assert [sp["sampling_seed"] for sp in e.engine.calls[-1][1]["sampling_params"]] == [None, None]
    fast = make(deterministic=False)  # SGLang's own sampler draws each row from its RNG: no seed to send
    fast.generate([[1, 2]], SamplingParams(n=2))
    assert [sp["sampling_seed"] for sp in fast.engine.calls[-1][1]["sampling_params"]] == [None, None]


def test_seeded_rows_keep_their_reproducible_seeds_in_deterministic_mode(make):
    e = make()
    e.generate([[1, 2]], SamplingParams(n=3, seed=7))
    once = [sp["sampling_seed"] for sp in e.engine.calls[-1][1]["sampling_params"]]
    e.generate([[1, 2]], SamplingParams(n=3, seed=7))
    assert [sp["sampling_seed"] for sp in e.engine.calls[-1][1]["sampling_params"]] == once


def test_sleep_and_wake_map_to_sglang_memory_tags(make):
    e = make()
    e.sleep(1)
    assert e.engine.calls[-1] == ("release_memory_occupation", {"tags": ["weights", "kv_cache", "cuda_graph"]})
    with pytest.raises(EngineStateError, match="asleep"):
        e.generate([[1]], SamplingParams())
    e.wake_up(["weights"])
    assert e.engine.calls[-1] == ("resume_memory_occupation", {"tags": ["weights"]})
    with pytest.raises(EngineStateError, match="KV cache"):
        e.generate([[1]], SamplingParams())
    e.wake_up()
    assert e.engine.calls[-1] == ("resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})
    e.generate([[1]], SamplingParams())  # level 1 kept the weights (CPU backup)


def test_level_two_requires_a_weight_update_inside_a_session(make):
    e = make()
    e.init_weight_update_group("10.0.0.1", 2345, 1, 2, group_name="g")
    metas = [TensorMeta("a", "bfloat16", (3,)), TensorMeta("b", "float32", (2,))]  # 6 bytes: b opens a bucket
    e.sleep(2)
    e.wake_up()
    with pytest.raises(EngineStateError, match="discarded"):
        e.generate([[1]], SamplingParams())
    del e.engine.calls[:]
    e.update_weights(metas, bucket_bytes=1 << 20)
    assert names(e) == with_sessions(
        make,
        [
            "begin_weight_update",
            "update_weights_from_distributed",
            "update_weights_from_distributed",
            "end_weight_update",
            "flush_cache",
        ],
    )
    first = next(kw for name, kw in e.engine.calls if name == "update_weights_from_distributed")
    assert first == {
        "names": ["a"],
        "dtypes": ["bfloat16"],
        "shapes": [[3]],
        "group_name": "g",
        "flush_cache": False,
        "load_format": "flattened_bucket",
    }
    e.generate([[1]], SamplingParams())


def test_a_failed_sglang_call_raises_and_still_closes_the_session(make):
    e = make()
    e.init_weight_update_group("10.0.0.1", 2345, 1, 2)
    e.engine.fail = {"update_weights_from_distributed"}
    with pytest.raises(RoleFailure, match="said no"):
        e.update_weights([TensorMeta("a", "float32", (2,))], bucket_bytes=1 << 20)
    assert names(e)[-1] == with_sessions(make, ["update_weights_from_distributed", "end_weight_update"])[-1]
    assert "flush_cache" not in names(e)  # nothing new was loaded


def _read_payload(data: bytes):
    """What SGLang's scheduler gets from one serialized bucket (here with the plain unpickler; the contract test
    reads it with SGLang's own allow-listing one)."""
    import pickle

    obj = pickle.loads(data)
    flat = obj["flattened_tensor"]
    return {m.name: flat[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape) for m in obj["metadata"]}


def test_ipc_sync_is_one_session_of_serialized_flattened_buckets(make):
    from hybrid_engines.weight_sync.sglang import SGLangIpcPayload, SGLangTransport

    e = make()
    g = torch.Generator().manual_seed(0)
    weights = [
        ("a", torch.randn(6, generator=g)),
        ("b", torch.randn(40, 40, generator=g).to(torch.bfloat16)),
        ("c", torch.randn(30, 30, generator=g)),
    ]
    transport = SGLangTransport()
    got, deliveries = {}, []

    def deliver(bucket):
        payload = transport.encode_ipc([bucket])  # in the trainer process: SGLang's form, one payload per TP rank
        assert isinstance(payload, SGLangIpcPayload) and len(payload.data) == 1
        deliveries.append(payload)
        e.update_weights_from_ipc(payload)
        got.update({n: t.clone() for n, t in _read_payload(e.engine.payloads[0]).items()})
        if not payload.last:  # mid-sync the engine refuses to generate
            with pytest.raises(EngineStateError, match="in progress"):
                e.generate([[1]], SamplingParams())

    sender = IpcBucketSender(4096, device="cpu")  # a + b (3264 B with alignment) fit, c (3600 B) opens bucket 2
    sender.send(weights, deliver=deliver, wait=lambda _: None)
    sender.close()
    assert [p.names for p in deliveries] == [("a", "b"), ("c",)] and deliveries[-1].last
    for name, tensor in weights:
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor)
    loads = [kw for n, kw in e.engine.calls if n == "update_weights_from_tensor"]
    assert loads == [{"load_format": "flattened_bucket", "flush_cache": False}] * 2
    assert names(e) == with_sessions(
        make, ["begin_weight_update", *["update_weights_from_tensor"] * 2, "end_weight_update", "flush_cache"]
    )
    e.generate([[1]], SamplingParams())


def test_a_hybrid_core_ipc_bucket_is_encoded_by_the_engine_too(make):
    e = make()
    sender = IpcBucketSender(4096, device="cpu")
    weights = [("a", torch.arange(6.0)), ("b", torch.ones(2, 2))]
    got = {}

    def deliver(bucket):  # the scheduler maps the trainer's buffer during the call, as SGLang's does
        e.update_weights_from_ipc(bucket)
        got.update({n: t.clone() for n, t in _read_payload(e.engine.payloads[0]).items()})

    sender.send(weights, deliver=deliver, wait=lambda _: None)
    sender.close()
    assert all(torch.equal(got[n], t) for n, t in weights)


def test_a_failed_ipc_load_closes_the_session_and_keeps_the_weights_unsynced(make):
    from hybrid_engines.weight_sync.sglang import SGLangTransport

    e = make()
    e.sleep(2)
    e.wake_up()
    e.engine.fail = {"update_weights_from_tensor"}
    sender = IpcBucketSender(4096, device="cpu")
    with pytest.raises(RoleFailure, match="said no"):
        sender.send(
            [("a", torch.ones(3))],
            deliver=lambda b: e.update_weights_from_ipc(SGLangTransport().encode_ipc([b])),
            wait=lambda _: None,
        )
    sender.close()
    assert "flush_cache" not in names(e)[-2:]
    with pytest.raises(EngineStateError, match="discarded"):
        e.generate([[1]], SamplingParams())


def test_refusals(make):
    with pytest.raises(ConfigError) as err:
        make(weights_cpu_backup=False).sleep(1)
    assert err.value.field == "level"
    with pytest.raises(ConfigError) as err:
        make(tensor_parallel_size=2).update_weights_from_ipc(None)
    assert err.value.field == "tensor_parallel_size"
    from hybrid_engines.sglang_engine import SGLangEngine

    assert (
        SGLangEngine.placement_refusal(tp=2, shares_gpus=False)
        and SGLangEngine.placement_refusal(tp=1, shares_gpus=True) is None
    )
    with pytest.raises(ConfigError) as err:
        make(stop_at_eos=False).generate([[1]], SamplingParams(stop_token_ids=(3,)))
    assert err.value.field == "stop_token_ids"
    with pytest.raises(ConfigError) as err:
        make().init_weight_update_group("h", 1, 1, 1)
    assert err.value.field == "rank_offset"
    with pytest.raises(ConfigError) as err:  # SGLang's RayEngine cannot share a GPU with another role
        make(tensor_parallel_size=2, placement_group=object(), bundle_indices=[0, 1], gpus_per_worker=0.5)
    assert err.value.field == "gpus_per_worker"
    e = make()
    e.shutdown()
    e.shutdown()
    assert names(e) == ["shutdown"]
    with pytest.raises(EngineStateError, match="shut down"):
        e.generate([[1]], SamplingParams())
