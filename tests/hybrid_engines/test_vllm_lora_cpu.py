"""The vLLM adapter's LoRA path (adapter-only weight sync) on CPU: what it asks of vLLM, and the worker extension's
receiving of the adapter's tensors.

vLLM cannot start an engine without a GPU, so its parts are stand-ins here, and only here (the real engine runs in
``bench/lora_gpu.py``; the names used are checked against vLLM's source by the contract test,
``contracts/test_vllm_contract.py``): ``FakeLLM`` for ``vllm.LLM`` (records its arguments and each generate's
``lora_request``), and in the worker vLLM's LoRA manager and ``LoRAModel.from_lora_tensors`` as recorders. Everything
else is real: the worker extension's code, hybrid-core's gloo weight-sync group and ``WeightSender``, CPU
shared-memory IPC buckets, the checksums and the corruption fault.
"""

from __future__ import annotations

import socket
import sys
import types
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from hybrid_core.errors import RoleFailure, WeightSyncMismatch
from hybrid_core.weight_sync import IpcBucketSender, TensorMeta, WeightSender, create_sync_group
from hybrid_engines.protocol import SamplingParams
from hybrid_engines.vllm_worker import HybridWorkerExtension
from hybrid_engines.weight_sync.adapter import AdapterSpec

SPEC = AdapterSpec(rank=4, alpha=8, target_modules=("q_proj", "v_proj"))
H, BUCKET = 16, 1024


def adapter(seed: int) -> list[tuple[str, torch.Tensor]]:
    """An adapter's tensors under their wire names (PEFT's saved-adapter names), A before B per module."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for layer in range(2):
        for module in ("q_proj", "v_proj"):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            out.append((f"{prefix}.lora_A.weight", torch.randn(SPEC.rank, H, generator=g)))
            out.append((f"{prefix}.lora_B.weight", torch.randn(H, SPEC.rank, generator=g)))
    return out


class FakeMapper:
    """The model's ``hf_to_vllm_mapper``: vLLM's LoRA loading uses its unstacked variant (q_proj stays q_proj)."""

    unstacked = SimpleNamespace(name="unstacked mapper")

    def get_unstacked_mapper(self):
        return self.unstacked


class FakeModelManager:
    """Records what the worker does with vLLM's ``LRUCacheLoRAModelManager`` (the calls the contract test checks)."""

    def __init__(self, calls: list[tuple], capacity: int = 1):
        self.calls, self.capacity, self.adapters = calls, capacity, {}
        self.model = SimpleNamespace(hf_to_vllm_mapper=FakeMapper(), lora_skip_prefixes=None)
        self.supported_lora_modules = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]  # Qwen2's, as vLLM lists
        self.packed_modules_mapping = {
            "qkv_proj": ["q_proj", "k_proj", "v_proj"],
            "gate_up_proj": ["gate_proj", "up_proj"],
        }

    def __len__(self):
        return len(self.adapters)

    def remove_adapter(self, lora_id):
        self.calls.append(("remove", lora_id))
        return self.adapters.pop(lora_id, None) is not None

    def remove_oldest_adapter(self):
        oldest = next(iter(self.adapters))
        self.calls.append(("evict", oldest))
        del self.adapters[oldest]
        return True

    def add_adapter(self, lora):
        self.calls.append(("add", lora.id))
        self.adapters[lora.id] = lora
        return True

    def activate_adapter(self, lora_id):
        self.calls.append(("activate", lora_id))
        return True


class FakeLoRAManager:
    """vLLM's ``LRUCacheWorkerLoRAManager``: the attributes the worker reads, and its model manager."""

    def __init__(self):
        self.lora_config = SimpleNamespace(max_lora_rank=8, lora_dtype=torch.float32)
        self.vocab_size, self.max_position_embeddings = 100, 4096
        self.calls: list[tuple] = []
        self._adapter_manager = FakeModelManager(self.calls)

    @property
    def adapters(self):
        return self._adapter_manager.adapters


class CpuWorker(HybridWorkerExtension):
    def __init__(self):
        self.rank, self.device, self.model_config = 0, torch.device("cpu"), None
        self.model_runner = SimpleNamespace(lora_manager=FakeLoRAManager())

    def hybrid_free_bytes(self) -> int:
        return 100


class FakeLLM:
    def __init__(self, **kwargs):
        self.kwargs, self.worker, self.requests = kwargs, CpuWorker(), []
        self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(world_size=1)))

    def generate(self, prompts, sampling_params, use_tqdm, lora_request=None):
        self.requests.append(lora_request)
        step = {t: SimpleNamespace(logprob=0.0) for t in (1, 2)}
        done = SimpleNamespace(token_ids=[1, 2], logprobs=[step, step], finish_reason="stop")
        return [SimpleNamespace(outputs=[done]) for _ in prompts]

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    def reset_prefix_cache(self):
        return True


@pytest.fixture
def engine(monkeypatch):
    built: list[dict] = []

    class LoRAModel:
        @classmethod
        def from_lora_tensors(cls, **kw):
            built.append(kw)
            # vLLM's parse_fine_tuned_lora_name of PEFT's names: the module's name, one entry per A/B pair
            loras = {n.removeprefix("base_model.model.").rsplit(".", 2)[0]: None for n in kw["tensors"]}
            return SimpleNamespace(id=kw["lora_model_id"], tensors=dict(kw["tensors"]), loras=loras, kw=kw)

    class PEFTHelper:
        @classmethod
        def from_dict(cls, config):
            return SimpleNamespace(config=config, validate_legal=lambda lora_config: None)

    modules = {
        "vllm": types.ModuleType("vllm"),
        "vllm.lora": types.ModuleType("vllm.lora"),
        "vllm.lora.lora_model": types.ModuleType("vllm.lora.lora_model"),
        "vllm.lora.peft_helper": types.ModuleType("vllm.lora.peft_helper"),
        "vllm.lora.request": types.ModuleType("vllm.lora.request"),
    }
    modules["vllm"].LLM = FakeLLM
    modules["vllm"].SamplingParams = lambda **kw: SimpleNamespace(kw=kw)
    modules["vllm.lora.lora_model"].LoRAModel = LoRAModel
    modules["vllm.lora.peft_helper"].PEFTHelper = PEFTHelper
    modules["vllm.lora.request"].LoRARequest = lambda **kw: SimpleNamespace(**kw)
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    from hybrid_engines.vllm_engine import VLLMEngine

    engine = VLLMEngine("/nonexistent/model", enforce_eager=True, lora=SPEC)
    engine.built = built
    return engine


def broadcast(engine, tensors):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    metas = [TensorMeta.of(n, t) for n, t in tensors]
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(engine.init_weight_update_group, "127.0.0.1", port, 1, 2, backend="gloo", timeout_s=30)
        group = create_sync_group("127.0.0.1", port, 0, 2, backend="gloo", timeout_s=30)
        joined.result(timeout=60)
        got = pool.submit(engine.update_weights, metas, bucket_bytes=BUCKET)
        sent = WeightSender(group, BUCKET).send(tensors)
        try:
            return sent, got.result(timeout=60)
        finally:
            group.close()


def ipc(engine, tensors):
    sender = IpcBucketSender(bucket_bytes=BUCKET, device="cpu")
    try:
        return sender.send(tensors, deliver=engine.update_weights_from_ipc, wait=lambda done: None)
    finally:
        sender.close()


def test_the_engine_is_built_for_the_runs_adapter():
    from hybrid_engines.adapter import EnginePlan, EngineSettings
    from hybrid_engines.vllm_engine import VLLMEngine, vllm_max_lora_rank

    kwargs = VLLMEngine.engine_kwargs(EngineSettings(backend="vllm"), EnginePlan("/m", lora=SPEC))
    assert kwargs["lora"] == SPEC
    assert [vllm_max_lora_rank(r) for r in (1, 4, 8, 16, 24, 300, 512)] == [1, 8, 8, 16, 32, 320, 512]
    assert VLLMEngine.adapter_refusal(SPEC) is None and "512" in VLLMEngine.adapter_refusal(AdapterSpec(600, 1, "x"))


def test_an_adapter_sync_becomes_vllms_adapter_by_tensor_and_every_generate_then_names_it(engine):
    kw = engine.llm.kwargs
    assert (kw["enable_lora"], kw["max_lora_rank"], kw["max_loras"]) == (True, 8, 1)
    params = SamplingParams(temperature=0.0, max_new_tokens=2)
    engine.generate([[1, 2]], params)
    assert engine.llm.requests == [None]  # before the first sync the engine serves the base (B = 0: the policy)
    first = adapter(1)
    sent, got = broadcast(engine, first)
    assert got.bytes == sent.bytes == sum(t.numel() * t.element_size() for _, t in first)
    (call,) = engine.built
    assert call["peft_helper"].config == {**SPEC.peft_config(), "vllm_max_position_embeddings": 4096}
    assert call["lora_model_id"] == 1
    assert call["device"] == "cpu" and call["dtype"] == torch.float32 and call["model_vocab_size"] == 100
    # vLLM's _load_adapter's mapper: q_proj/v_proj kept for add_adapter to pack into qkv_proj's slices
    assert call["weights_mapper"] is FakeMapper.unstacked and call["skip_prefixes"] is None
    assert all(torch.equal(call["tensors"][n], t) for n, t in first) and len(call["tensors"]) == len(first)
    engine.generate([[1, 2]], params)
    request = engine.llm.requests[-1]
    assert (request.lora_int_id, request.lora_name) == (1, "hybrid-policy")
    second = adapter(2)  # the next sync, by IPC: the same id, the old adapter replaced
    stats = ipc(engine, second)
    assert stats.bytes == sent.bytes
    manager = engine.llm.worker.model_runner.lora_manager
    assert manager.calls == [("remove", 1), ("add", 1), ("activate", 1)] * 2  # LRUCacheWorkerLoRAManager's order
    assert all(torch.equal(manager.adapters[1].tensors[n], t) for n, t in second)
    engine.generate([[1, 2]], params)
    assert engine.llm.requests[-1].lora_int_id == 1


def test_a_corrupted_adapter_bucket_ends_the_sync_naming_the_tensor(engine, monkeypatch):
    from collections import Counter

    from hybrid_core import faults

    monkeypatch.setattr(faults, "_calls", Counter())  # this process's fault count starts here
    monkeypatch.setenv("HYBRID_FAULT", "receiver:bucket:corrupt:2")
    with pytest.raises((WeightSyncMismatch, RoleFailure)) as e:
        ipc(engine, adapter(1))
    assert ".lora_" in str(e.value) and "differ from what the trainer sent" in str(e.value)
    assert engine.built == []  # no adapter was made of it
    assert engine.llm.worker.model_runner.lora_manager.adapters == {}


def test_an_adapter_that_does_not_pair_up_or_changes_modules_is_refused(engine):
    tensors = adapter(1)
    with pytest.raises(RuntimeError, match="unpaired") as e:
        ipc(engine, tensors[:-1])  # the last B left out
    assert "v_proj.lora_A.weight" in str(e.value)
    ipc(engine, tensors)
    other = [(n.replace("v_proj", "k_proj"), t) for n, t in adapter(2)]
    with pytest.raises(RuntimeError, match="unlike the last sync"):
        ipc(engine, other)


def test_a_full_adapter_cache_gives_up_its_oldest_as_vllms_own_add_adapter_does(engine):
    manager = engine.llm.worker.model_runner.lora_manager
    manager.adapters[7] = SimpleNamespace(id=7)  # another adapter fills the cache (max_cpu_loras = 1)
    ipc(engine, adapter(1))
    assert manager.calls == [("remove", 1), ("evict", 7), ("add", 1), ("activate", 1)]
    assert set(manager.adapters) == {1}


def test_an_adapter_naming_modules_vllm_has_no_layer_for_is_refused(engine):
    other = [(n.replace("self_attn.v_proj", "self_attn.rotary"), t) for n, t in adapter(1)]
    with pytest.raises(RuntimeError, match="no LoRA layer for") as e:
        ipc(engine, other)
    assert "model.layers.0.self_attn.rotary" in str(e.value)
    assert engine.llm.worker.model_runner.lora_manager.calls == []  # nothing removed or added


def test_vllms_expected_lora_modules_take_the_parts_of_packed_modules_and_not_the_packed_name():
    """``_load_adapter``'s expected names: an adapter's ``qkv_proj`` (what the model's loading mapper makes of
    ``q_proj``, the IndexError in the merged layer's ``set_lora``) is not one of them; its parts are."""
    from hybrid_engines.vllm_worker import _unexpected_lora_modules

    supported = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    layer = "model.layers.0"
    parts = [f"{layer}.self_attn.{m}" for m in ("q_proj", "k_proj", "v_proj", "o_proj")]
    parts += [f"{layer}.mlp.{m}" for m in ("gate_proj", "up_proj", "down_proj")]
    assert _unexpected_lora_modules(parts, supported, packed) == []
    fused = [f"{layer}.self_attn.qkv_proj", f"{layer}.mlp.gate_up_proj", f"{layer}.mlp.down_proj"]
    assert _unexpected_lora_modules(fused, supported, packed) == sorted(fused[:2])
    # MoE experts: the suffix from ".experts" on is checked, as from_local_checkpoint checks it
    moe = {"experts": ["experts.0.gate_proj", "experts.0.down_proj"]}
    names = [f"{layer}.mlp.experts.0.gate_proj", f"{layer}.mlp.experts.1.gate_proj", f"{layer}.mlp.experts.base_layer"]
    assert _unexpected_lora_modules(names, ["experts"], moe) == [names[1]]
