"""The order and arguments of the SGLang adapter's calls into ``sglang.Engine`` (0.5.23's calling protocol).

SGLang cannot run here, so ``RecordingEngine`` stands in for ``sglang.Engine`` (through a fake ``sglang`` module):
it records calls and answers as 0.5.23 does (``(success, message)`` tuples, ``None`` from the memory calls, a
``.success`` object from ``flush_cache``, dicts from ``generate``). Only this file uses it; the names themselves are
checked against the real package by ``test_sglang_contract.py``.
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

    def update_weights_from_tensor(self, named_tensors, flush_cache):
        self.tensors = [(n, t.clone()) for n, t in named_tensors]
        return self._record("update_weights_from_tensor", flush_cache=flush_cache)

    def shutdown(self):
        self.calls.append(("shutdown", {}))


@pytest.fixture
def make(monkeypatch):
    fake = types.ModuleType("sglang")
    fake.Engine = RecordingEngine
    monkeypatch.setitem(sys.modules, "sglang", fake)
    monkeypatch.delenv("SGLANG_RETURN_ORIGINAL_LOGPROB", raising=False)
    from hybrid_engines.sglang_engine import SGLangEngine

    return lambda **kw: SGLangEngine("/nonexistent/model", **kw)


def names(engine):
    return [c[0] for c in engine.engine.calls]


def test_server_arguments_and_raw_logprobs(make):
    e = make(enforce_eager=True, enable_prefix_caching=False, max_model_len=512)
    kw = e.engine.kwargs
    assert kw["disable_cuda_graph"] is True  # eager = CUDA graphs off (the seed project had this negated)
    assert kw["disable_radix_cache"] is True and kw["context_length"] == 512 and kw["enable_memory_saver"] is True
    assert kw["model_path"] == "/nonexistent/model" and kw["mem_fraction_static"] == 0.5
    assert os.environ["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "1"
    assert isinstance(e, InferenceEngine)


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
        make().generate([[1]], SamplingParams(seed=1))
    assert err.value.field == "seed"
    e = make(deterministic=True)
    assert e.engine.kwargs["enable_deterministic_inference"] is True
    e.generate([[1]], SamplingParams(seed=1, n=2))
    seeds = [sp["sampling_seed"] for sp in e.engine.calls[-1][1]["sampling_params"]]
    assert None not in seeds and len(set(seeds)) == 2


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
    assert names(e) == ["begin_weight_update", "update_weights_from_distributed", "update_weights_from_distributed",
                        "end_weight_update", "flush_cache"]
    first = e.engine.calls[1][1]
    assert first == {"names": ["a"], "dtypes": ["bfloat16"], "shapes": [[3]], "group_name": "g", "flush_cache": False,
                     "load_format": "flattened_bucket"}
    e.generate([[1]], SamplingParams())


def test_a_failed_sglang_call_raises_and_still_closes_the_session(make):
    e = make()
    e.init_weight_update_group("10.0.0.1", 2345, 1, 2)
    e.engine.fail = {"update_weights_from_distributed"}
    with pytest.raises(RoleFailure, match="said no"):
        e.update_weights([TensorMeta("a", "float32", (2,))], bucket_bytes=1 << 20)
    assert names(e)[-1] == "end_weight_update"  # no flush: nothing new was loaded


def test_ipc_bucket_goes_to_update_weights_from_tensor(make):
    e = make()
    weights = [("a", torch.arange(6.0)), ("b", torch.ones(2, 2))]
    sender = IpcBucketSender(4096, device="cpu")
    sender.send(weights, deliver=lambda b: e.update_weights_from_ipc(b), wait=lambda _: None)
    sender.close()
    assert [n for n, _ in e.engine.tensors] == ["a", "b"] and torch.equal(e.engine.tensors[0][1], weights[0][1])
    assert names(e) == ["begin_weight_update", "update_weights_from_tensor", "end_weight_update", "flush_cache"]


def test_refusals(make):
    with pytest.raises(ConfigError) as err:
        make(weights_cpu_backup=False).sleep(1)
    assert err.value.field == "level"
    with pytest.raises(ConfigError) as err:
        make(tensor_parallel_size=2).update_weights_from_ipc(None)
    assert err.value.field == "tensor_parallel_size"
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
