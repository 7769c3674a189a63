"""What the vLLM read-back (``hybrid_engines.vllm_read_back``) relies on, in the installed vLLM (read against 0.26.0):
the classes and loader it recognises by module and name, the attribute names and slicing rules of the fused layers,
Qwen2/Llama's stacking, and -- on real vLLM layers built on the CPU (the TP group stubbed to one rank) and loaded by
vLLM's own ``AutoWeightsLoader`` -- that every read-back holds the sent tensor's bytes. Run with
``hatch run vllm-contract:test``.
"""

from __future__ import annotations

import importlib
import inspect

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (optional env: hatch run vllm-contract:test)")

import torch  # noqa: E402

from hybrid_core.weight_sync import TensorMeta  # noqa: E402
from hybrid_engines import vllm_read_back as rb  # noqa: E402

pytestmark = pytest.mark.contract


def test_the_layers_and_loader_recognised_are_vllms_by_module_and_name():
    for module_name, names in rb.LAYERS.items():
        module = importlib.import_module(module_name)
        for name in names:
            cls = getattr(module, name)
            assert (cls.__module__, cls.__name__) == (module_name, name)
            loaders = [m for m in rb.LOADER_METHODS if callable(getattr(cls, m, None))]
            assert loaders, f"{name} has none of {rb.LOADER_METHODS}"
    from vllm.model_executor.layers.linear import WEIGHT_LOADER_V2_SUPPORTED, UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    assert {UnquantizedLinearMethod.__name__, UnquantizedEmbeddingMethod.__name__} == set(rb.UNQUANTIZED)
    assert "UnquantizedLinearMethod" in WEIGHT_LOADER_V2_SUPPORTED
    assert (default_weight_loader.__module__, default_weight_loader.__name__) == rb.DEFAULT_LOADER
    from vllm.model_executor.models.utils import AutoWeightsLoader

    # a parameter without a loader is loaded by default_weight_loader
    assert 'getattr(param, "weight_loader", default_weight_loader)' in inspect.getsource(AutoWeightsLoader._load_param)


def test_the_fused_layers_attributes_and_slicing_rules():
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

    init = inspect.getsource(QKVParallelLinear.__init__)
    for attr in ("self.num_heads =", "self.num_kv_heads =", "self.head_size =", "self.v_head_size ="):
        assert attr in init, f"QKVParallelLinear no longer sets {attr}"
    assert callable(QKVParallelLinear._get_shard_offset_mapping) and callable(QKVParallelLinear._get_shard_size_mapping)
    v2 = inspect.getsource(QKVParallelLinear.weight_loader_v2)
    assert "self._get_shard_offset_mapping(loaded_shard_id)" in v2 and "self._get_shard_size_mapping(" in v2
    v1 = inspect.getsource(QKVParallelLinear.weight_loader)  # the bias's loader: the same rows
    assert "shard_offset = (self.num_heads + self.num_kv_heads) * self.head_size" in v1
    assert "shard_size = self.num_kv_heads * self.v_head_size" in v1
    merged = inspect.getsource(MergedColumnParallelLinear.weight_loader_v2)
    assert (
        "shard_offset = sum(self.output_sizes[:loaded_shard_id])" in merged
        and "shard_offset //= self.tp_size" in merged
    )
    heads = type("Heads", (), {"num_heads": 4, "num_kv_heads": 2, "head_size": 8, "v_head_size": 8})()
    assert [QKVParallelLinear._get_shard_offset_mapping(heads, s) for s in ("q", "k", "v", "total")] == [0, 32, 48, 64]
    assert [QKVParallelLinear._get_shard_size_mapping(heads, s) for s in ("q", "k", "v")] == [32, 16, 16]
    from vllm.config.parallel import ParallelConfig
    from vllm.v1.worker.worker_base import WorkerBase

    assert "self.parallel_config = " in inspect.getsource(WorkerBase.__init__)
    assert "tensor_parallel_size" in ParallelConfig.__dataclass_fields__ or hasattr(
        ParallelConfig, "tensor_parallel_size"
    )
    from vllm.model_executor.model_loader.reload import layerwise

    # a layer not yet processed by layerwise reload has a wrapped loader (not the layer's own method)
    assert "def online_process_loader(" in inspect.getsource(layerwise)


def test_qwen2_and_llama_stack_as_the_read_back_inverts():
    from vllm.model_executor.models.llama import LlamaForCausalLM
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

    for model in (Qwen2ForCausalLM, LlamaForCausalLM):
        mapper = model.hf_to_vllm_mapper
        assert dict(mapper.orig_to_new_stacked) == dict(rb.DEFAULT_STACKED)
        for hf in ("model.layers.3.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight"):
            assert mapper._map_name_with_shard(hf) == rb._stack(hf, mapper.orig_to_new_stacked)


def test_real_vllm_layers_loaded_by_vllm_read_back_the_bytes_sent(monkeypatch):
    from vllm.model_executor import parameter
    from vllm.model_executor.layers import linear, vocab_parallel_embedding
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
    from vllm.model_executor.models.utils import AutoWeightsLoader

    for module in (parameter, linear, vocab_parallel_embedding):  # one TP rank, without a process group
        monkeypatch.setattr(module, "get_tensor_model_parallel_rank", lambda: 0)
        monkeypatch.setattr(module, "get_tensor_model_parallel_world_size", lambda: 1)
    hidden, heads, kv, size, inter, vocab = 32, 4, 2, 8, 48, 128
    dtype = torch.float32

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv_proj = linear.QKVParallelLinear(hidden, size, heads, kv, bias=True, params_dtype=dtype)
            self.o_proj = linear.RowParallelLinear(heads * size, hidden, bias=False, params_dtype=dtype)

    class Mlp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = linear.MergedColumnParallelLinear(hidden, [inter] * 2, bias=False, params_dtype=dtype)
            self.down_proj = linear.RowParallelLinear(inter, hidden, bias=False, params_dtype=dtype)

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn, self.mlp = Attention(), Mlp()
            self.input_layernorm = torch.nn.Module()
            self.input_layernorm.weight = torch.nn.Parameter(torch.ones(hidden, dtype=dtype), requires_grad=False)

    class Inner(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = vocab_parallel_embedding.VocabParallelEmbedding(vocab, hidden, params_dtype=dtype)
            self.layers = torch.nn.ModuleList([Layer()])

    class Toy(torch.nn.Module):
        hf_to_vllm_mapper = Qwen2ForCausalLM.hf_to_vllm_mapper

        def __init__(self):
            super().__init__()
            self.model = Inner()

    model = Toy()
    g = torch.Generator().manual_seed(0)
    p = "model.layers.0"
    shapes = {
        "model.embed_tokens.weight": (vocab, hidden),
        f"{p}.self_attn.q_proj.weight": (heads * size, hidden),
        f"{p}.self_attn.q_proj.bias": (heads * size,),
        f"{p}.self_attn.k_proj.weight": (kv * size, hidden),
        f"{p}.self_attn.k_proj.bias": (kv * size,),
        f"{p}.self_attn.v_proj.weight": (kv * size, hidden),
        f"{p}.self_attn.v_proj.bias": (kv * size,),
        f"{p}.self_attn.o_proj.weight": (hidden, heads * size),
        f"{p}.mlp.gate_proj.weight": (inter, hidden),
        f"{p}.mlp.up_proj.weight": (inter, hidden),
        f"{p}.mlp.down_proj.weight": (hidden, inter),
        f"{p}.input_layernorm.weight": (hidden,),
    }
    weights = [(n, torch.randn(*s, generator=g, dtype=dtype)) for n, s in shapes.items()]
    loaded = AutoWeightsLoader(model).load_weights(
        [(n, t.clone()) for n, t in weights], mapper=Qwen2ForCausalLM.hf_to_vllm_mapper
    )
    assert f"{p}.self_attn.qkv_proj.weight" in loaded
    reader = rb.VllmReadBack(model, 1)
    reader.calibrate(weights)
    assert reader.transformed == set()
    check = reader.for_sync(TensorMeta.of(n, t) for n, t in weights)
    for name, sent in weights:
        got = check(name)
        assert got is not None, f"{name} is not read back"
        assert torch.equal(got.reshape(sent.shape), sent), name
