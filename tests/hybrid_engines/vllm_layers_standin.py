"""Stand-ins for vLLM 0.26's layers and a Qwen2-shaped model, for the read-back tests on CPU (vLLM cannot be imported
here). They carry vLLM's class names, modules and attribute names, and fill their parameters by vLLM's own rules:

* ``QKVParallelLinear``: ``num_heads`` / ``num_kv_heads`` / ``head_size`` / ``v_head_size`` per TP rank,
  ``num_kv_head_replicas``, ``_get_shard_offset_mapping`` / ``_get_shard_size_mapping``; the weight's loader is
  ``weight_loader_v2`` (``load_qkv_weight``: the shard's rows of the fused weight, the loaded tensor narrowed to this
  rank's heads), the bias's ``weight_loader`` (the same rows) -- ``model_executor/layers/linear.py``;
* ``MergedColumnParallelLinear``: ``output_sizes`` (whole), shard i at ``sum(output_sizes[:i]) // tp_size``;
* ``RowParallelLinear``: the input dim narrowed by rank; ``VocabParallelEmbedding`` / ``ParallelLMHead``: the
  vocabulary padded to a multiple of 64, rows past the checkpoint's zeroed (``vocab_parallel_embedding.py``);
* ``RMSNorm``: a plain parameter, loaded by ``default_weight_loader``;
* ``ToyQwen2ForCausalLM.load_weights``: ``AutoWeightsLoader`` with Qwen2's ``hf_to_vllm_mapper`` stacking
  (``models/qwen2.py``, ``models/utils.py``): the shard id rides on the tensor, the parameter's loader takes it.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

LINEAR = "vllm.model_executor.layers.linear"
EMBEDDING = "vllm.model_executor.layers.vocab_parallel_embedding"
STACKED = {
    ".q_proj": (".qkv_proj", "q"),
    ".k_proj": (".qkv_proj", "k"),
    ".v_proj": (".qkv_proj", "v"),
    ".gate_proj": (".gate_up_proj", 0),
    ".up_proj": (".gate_up_proj", 1),
}


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    assert param.size() == loaded_weight.size()
    param.data.copy_(loaded_weight)


default_weight_loader.__module__ = "vllm.model_executor.model_loader.weight_utils"


class UnquantizedLinearMethod:
    pass


class UnquantizedEmbeddingMethod:
    pass


class Fp8LinearMethod:
    pass


def _param(data: torch.Tensor, **attrs) -> nn.Parameter:
    p = nn.Parameter(data, requires_grad=False)
    for k, v in attrs.items():
        setattr(p, k, v)
    return p


class QKVParallelLinear(nn.Module):
    __module__ = LINEAR

    def __init__(self, hidden_size, head_size, total_num_heads, total_num_kv_heads, *, bias=True, tp_size=1, dtype):
        super().__init__()
        self.tp_size, self.tp_rank = tp_size, 0
        self.quant_method = UnquantizedLinearMethod()
        self.head_size = self.v_head_size = head_size
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.num_heads = total_num_heads // tp_size
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads, self.num_kv_head_replicas = 1, tp_size // total_num_kv_heads
        else:
            self.num_kv_heads, self.num_kv_head_replicas = total_num_kv_heads // tp_size, 1
        self.output_sizes = [
            self.num_heads * head_size * tp_size,
            self.num_kv_heads * head_size * tp_size,
            self.num_kv_heads * self.v_head_size * tp_size,
        ]
        rows = sum(self.output_sizes) // tp_size
        self.weight = _param(
            torch.empty(rows, hidden_size, dtype=dtype), output_dim=0, weight_loader=self.weight_loader_v2
        )
        self.bias = (
            _param(torch.empty(rows, dtype=dtype), output_dim=0, weight_loader=self.weight_loader) if bias else None
        )

    def _get_shard_offset_mapping(self, loaded_shard_id):
        return {
            "q": 0,
            "k": self.num_heads * self.head_size,
            "v": (self.num_heads + self.num_kv_heads) * self.head_size,
            "total": (self.num_heads + self.num_kv_heads) * self.head_size + self.num_kv_heads * self.v_head_size,
        }.get(loaded_shard_id)

    def _get_shard_size_mapping(self, loaded_shard_id):
        return {
            "q": self.num_heads * self.head_size,
            "k": self.num_kv_heads * self.head_size,
            "v": self.num_kv_heads * self.v_head_size,
        }.get(loaded_shard_id)

    def _load(self, param, loaded_weight, shard_id):
        offset, size = self._get_shard_offset_mapping(shard_id), self._get_shard_size_mapping(shard_id)
        rank = self.tp_rank if shard_id == "q" else self.tp_rank // self.num_kv_head_replicas
        param.data.narrow(0, offset, size).copy_(loaded_weight.narrow(0, rank * size, size))

    def weight_loader_v2(self, param, loaded_weight, loaded_shard_id=None):
        self._load(param, loaded_weight, loaded_shard_id)

    def weight_loader(self, param, loaded_weight, loaded_shard_id=None):
        self._load(param, loaded_weight, loaded_shard_id)


class MergedColumnParallelLinear(nn.Module):
    __module__ = LINEAR

    def __init__(self, input_size, output_sizes, *, tp_size=1, dtype):
        super().__init__()
        self.tp_size, self.tp_rank = tp_size, 0
        self.quant_method = UnquantizedLinearMethod()
        self.output_sizes = list(output_sizes)
        rows = sum(output_sizes) // tp_size
        self.weight = _param(
            torch.empty(rows, input_size, dtype=dtype), output_dim=0, weight_loader=self.weight_loader_v2
        )

    def weight_loader_v2(self, param, loaded_weight, loaded_shard_id=None):
        offset = sum(self.output_sizes[:loaded_shard_id]) // self.tp_size
        size = self.output_sizes[loaded_shard_id] // self.tp_size
        param.data.narrow(0, offset, size).copy_(loaded_weight.narrow(0, self.tp_rank * size, size))


class RowParallelLinear(nn.Module):
    __module__ = LINEAR

    def __init__(self, input_size, output_size, *, tp_size=1, dtype):
        super().__init__()
        self.tp_size, self.tp_rank = tp_size, 0
        self.quant_method = UnquantizedLinearMethod()
        self.weight = _param(
            torch.empty(output_size, input_size // tp_size, dtype=dtype),
            input_dim=1,
            weight_loader=self.weight_loader_v2,
        )

    def weight_loader_v2(self, param, loaded_weight):
        size = param.data.shape[1]
        param.data.copy_(loaded_weight.narrow(1, self.tp_rank * size, size))


class VocabParallelEmbedding(nn.Module):
    __module__ = EMBEDDING

    def __init__(self, num_embeddings, embedding_dim, *, tp_size=1, dtype):
        super().__init__()
        self.tp_size = tp_size
        self.quant_method = UnquantizedEmbeddingMethod()
        self.org_vocab_size = num_embeddings
        self.num_embeddings_padded = -(-num_embeddings // 64) * 64
        rows = self.num_embeddings_padded // tp_size
        self.weight = _param(
            torch.empty(rows, embedding_dim, dtype=dtype), output_dim=0, weight_loader=self.weight_loader
        )

    def weight_loader(self, param, loaded_weight):
        shard = min(param.data.shape[0], self.org_vocab_size)  # rank 0's rows of the checkpoint
        param[:shard].data.copy_(loaded_weight[:shard])
        param[shard:].data.fill_(0)


class ParallelLMHead(VocabParallelEmbedding):
    __module__ = EMBEDDING


class RMSNorm(nn.Module):
    __module__ = "vllm.model_executor.layers.layernorm"

    def __init__(self, hidden_size, *, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)


class Config(SimpleNamespace):
    def __init__(self, **kw):
        defaults = dict(hidden=16, heads=4, kv_heads=2, head_size=4, inter=24, vocab=128, layers=2, tie=False)
        super().__init__(**{**defaults, **kw})


class _Attention(nn.Module):
    def __init__(self, c, tp, dtype):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(c.hidden, c.head_size, c.heads, c.kv_heads, tp_size=tp, dtype=dtype)
        self.o_proj = RowParallelLinear(c.heads * c.head_size, c.hidden, tp_size=tp, dtype=dtype)


class _Mlp(nn.Module):
    def __init__(self, c, tp, dtype):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(c.hidden, [c.inter, c.inter], tp_size=tp, dtype=dtype)
        self.down_proj = RowParallelLinear(c.inter, c.hidden, tp_size=tp, dtype=dtype)


class _Layer(nn.Module):
    def __init__(self, c, tp, dtype):
        super().__init__()
        self.self_attn = _Attention(c, tp, dtype)
        self.mlp = _Mlp(c, tp, dtype)
        self.input_layernorm = RMSNorm(c.hidden, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden, dtype=dtype)


class _Model(nn.Module):
    def __init__(self, c, tp, dtype):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(c.vocab, c.hidden, tp_size=tp, dtype=dtype)
        self.layers = nn.ModuleList([_Layer(c, tp, dtype) for _ in range(c.layers)])
        self.norm = RMSNorm(c.hidden, dtype=dtype)


class ToyQwen2ForCausalLM(nn.Module):
    """Qwen2ForCausalLM's module tree and loading. ``skip``: names ``load_weights`` drops (a stale load);
    ``transform``: name -> function applied to the tensor before its loader (a model that permutes/scales)."""

    hf_to_vllm_mapper = SimpleNamespace(orig_to_new_stacked=STACKED)

    def __init__(self, c: Config | None = None, *, tp: int = 1, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.c = c = c or Config()
        self.model = _Model(c, tp, dtype)
        self.lm_head = self.model.embed_tokens if c.tie else ParallelLMHead(c.vocab, c.hidden, tp_size=tp, dtype=dtype)
        self.skip: set[str] = set()
        self.transform: dict = {}

    def load_weights(self, weights):
        loaded = set()
        for name, data in weights:
            if name in self.skip or (self.c.tie and name.startswith("lm_head.")):
                continue
            if name in self.transform:
                data = self.transform[name](data)
            key, shard = name, None
            for substr, (new, new_shard) in STACKED.items():
                if substr in key:
                    key, shard = key.replace(substr, new, 1), new_shard
            path, attr = key.rsplit(".", 1)
            param = getattr(self.get_submodule(path), attr)
            loader = getattr(param, "weight_loader", default_weight_loader)
            loader(param, data) if shard is None else loader(param, data, shard)
            loaded.add(key)
        return loaded


def checkpoint(c: Config | None = None, seed: int = 0, dtype: torch.dtype = torch.float32):
    """The HF checkpoint of a ToyQwen2ForCausalLM (Qwen2's names and shapes: q/k/v with biases, GQA)."""
    c = c or Config()
    g = torch.Generator().manual_seed(seed)
    shapes = [("model.embed_tokens.weight", (c.vocab, c.hidden))]
    q, kv = c.heads * c.head_size, c.kv_heads * c.head_size
    for i in range(c.layers):
        p = f"model.layers.{i}"
        shapes += [
            (f"{p}.self_attn.q_proj.weight", (q, c.hidden)),
            (f"{p}.self_attn.q_proj.bias", (q,)),
            (f"{p}.self_attn.k_proj.weight", (kv, c.hidden)),
            (f"{p}.self_attn.k_proj.bias", (kv,)),
            (f"{p}.self_attn.v_proj.weight", (kv, c.hidden)),
            (f"{p}.self_attn.v_proj.bias", (kv,)),
            (f"{p}.self_attn.o_proj.weight", (c.hidden, q)),
            (f"{p}.mlp.gate_proj.weight", (c.inter, c.hidden)),
            (f"{p}.mlp.up_proj.weight", (c.inter, c.hidden)),
            (f"{p}.mlp.down_proj.weight", (c.hidden, c.inter)),
            (f"{p}.input_layernorm.weight", (c.hidden,)),
            (f"{p}.post_attention_layernorm.weight", (c.hidden,)),
        ]
    shapes.append(("model.norm.weight", (c.hidden,)))
    if not c.tie:
        shapes.append(("lm_head.weight", (c.vocab, c.hidden)))
    return [(n, torch.randn(*s, generator=g).to(dtype)) for n, s in shapes]
