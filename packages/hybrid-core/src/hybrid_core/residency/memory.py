"""The memory model: bytes of each role's states and of each phase's working memory on one GPU, from the model's
config alone (nothing is loaded). The planner (:mod:`.planner`) decides from these numbers what stays resident.

Notation: P parameters of a role's model, N its data-parallel ranks, z the ZeRO stage, b = 2 bytes per value with
bf16 (else 4), L layers, h hidden size, I MLP width, kv = KV heads x head dim, V vocabulary, S the longest sequence
(prompt_len + generate_len).

Trainers (actor, critic), per GPU -- the ZeRO paper's accounting (Rajbhandari et al. 2020):
    params     = b P / (N if z = 3 else 1)
    grads      = b P / (N if z >= 2 else 1)
    optimizer  = K P / (N if z >= 1 else 1), K = 12 with bf16 (fp32 master + Adam m, v), 8 in fp32 (m, v)
    working (training, one micro batch of T = micro_train_batch_size x S tokens): activations, per token per layer
                 A = 5h + 2kv + 4I values (norm inputs, q/k/v, attention output, residual, gate/up/act/product of the
                 MLP; memory-efficient attention, no S^2 term): T L A b, or T (L h + A) b with gradient checkpointing;
                 logits T' V (b + 8) for a policy (model-dtype logits, their fp32 copy and log-softmax; T' = the
                 positions of one chunk when the trainer computes log-probs in chunks of ``logits_chunk_bytes`` of
                 float32 logits, else T), 0 for a value head;
                 ZeRO-3 gathers 2 layers' weights (the layer in use and the prefetched one)
Frozen models (reference, reward) are whole on every rank (they are not sharded): params = b P; working: one
    forward of micro_rollout_batch_size sequences, T'' A b (one layer at a time) + logits T'' V (b + 8).
Engines, per GPU of an engine of TP GPUs:
    engines with a pool (vLLM, SGLang: their class says ``MEMORY_POOL``) pre-allocate ``engine_memory_fraction x GPU memory`` (their pool): weights = 2P/TP (bf16) and the
                 KV cache = the rest of the pool; nothing else grows while they generate.
    hf (built-in): weights = b P / TP; while it generates, the KV cache of its share of the rollout
                 (ceil(samples / engines) sequences of S tokens, 2 L kv b / TP per token) + the last logits.
Host memory (per worker, :mod:`.host` sums it per node): with adam_offload, DeepSpeed's CPU Adam keeps fp32 master
    weights, Adam m, v and fp32 gradients of the rank's partition in host memory for the whole run, and ZeRO-1/2 a
    model-dtype copy of it: (16 + b if z < 3 else 16) P / (N if z >= 1 else 1) (``RoleSize.host``); ``RoleSize.host_optimizer`` is the same number for a trainer
    without adam_offload, what the planner's ``host`` move would put there.
Every worker process also holds CONTEXT_BYTES (CUDA context, NCCL and cuBLAS workspaces), whatever it keeps.
During the sync, each side holds one weight-sync bucket.

``cache``: after its phase a role that does not trim keeps its working peak reserved in the caching allocator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from .steps import KIND_STATES, kind_of

GiB = 1024**3
CONTEXT_BYTES = GiB // 2
#: DeepSpeed CPU Adam's host bytes per parameter of a rank's partition: fp32 master weights (4), Adam m and v (4 + 4),
#: fp32 gradients (4). ZeRO-1/2 also keep a model-dtype copy of the partition there, which the updated weights pass
#: through on their way back to the GPU (``stage_1_and_2.py``: ``param_buffer_of_bit16_for_cpu_offload_groups``):
#: + 2 bytes in bf16. Missing that (16 instead of 18) let a 6.5B model's plan pass on a 125 GiB host where DeepSpeed's
#: set-up then took 108 GiB in one process and Ray's memory monitor killed it (H100, 2026-11-24).
CPU_ADAM_BYTES = 16
CPU_ADAM = "cpu_adam"  # its item in RoleSize.host


@dataclass(frozen=True)
class ModelShape:
    """The sizes the model needs, read from a Hugging Face config."""

    num_params: int
    hidden_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    value_head: bool = False  # critic / reward model: a scalar head instead of the LM head

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_activation_values(self) -> int:
        """A: values saved per token by one layer for the backward pass (see the module docstring)."""
        return 5 * self.hidden_size + 2 * self.kv_dim + 4 * self.intermediate_size

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer (all but the embeddings and the head, spread over the layers)."""
        outside = self.vocab_size * self.hidden_size * (1 if self.value_head else 2)
        return max(self.num_params - outside, 0) // max(self.num_layers, 1)

    def kv_bytes_per_token(self, bytes_per_value: int) -> int:
        return 2 * self.num_layers * self.kv_dim * bytes_per_value


def model_shape(hf_config: Any, *, value_head: bool = False, trust_remote_code: bool = False) -> ModelShape:
    """Sizes from a transformers config; the parameter count is exact (the model is built on the meta device).

    ``trust_remote_code``: the config comes from a model folder that ships its own modelling code (the user said
    they trust it), so that code builds the meta model too."""
    cfg = getattr(hf_config, "text_config", None) or hf_config
    hidden = cfg.hidden_size
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    inter = getattr(cfg, "intermediate_size", None) or 4 * hidden
    return ModelShape(count_params(hf_config, value_head=value_head, trust_remote_code=trust_remote_code), hidden, cfg.num_hidden_layers, kv_heads,
                      head_dim, inter, cfg.vocab_size, value_head)


def count_params(hf_config: Any, *, value_head: bool = False, trust_remote_code: bool = False) -> int:
    """Parameters of the causal LM (or of the base model + a scalar value head), without allocating any memory.

    Cached by the config's content: the planner sizes the same models again on every replan."""
    key = (hf_config.to_json_string(), value_head, trust_remote_code)
    if key not in _PARAM_COUNTS:
        if len(_PARAM_COUNTS) >= 32:
            _PARAM_COUNTS.clear()
        _PARAM_COUNTS[key] = _count_params(hf_config, value_head, trust_remote_code)
    return _PARAM_COUNTS[key]


_PARAM_COUNTS: dict[tuple[str, bool, bool], int] = {}


def _count_params(hf_config: Any, value_head: bool, trust_remote_code: bool) -> int:
    import torch

    try:
        from transformers import AutoModel, AutoModelForCausalLM
    except ImportError as e:  # hybrid-core does not depend on transformers; the training loop does
        raise ConfigError("model", "sizing a model from its config needs transformers.",
                          "pip install transformers") from e
    auto = AutoModel if value_head else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(hf_config, trust_remote_code=trust_remote_code) if trust_remote_code \
            else auto.from_config(hf_config)
    n = sum(p.numel() for p in model.parameters())
    return n + (hf_config.hidden_size + 1 if value_head else 0)


@dataclass(frozen=True)
class Workload:
    """What the memory model needs to know about a run besides the models (the training loop fills it in)."""

    bf16: bool = True
    zero_stage: int = 2
    adam_offload: bool = False
    gradient_checkpointing: bool = False
    micro_train_batch_size: int = 8
    micro_rollout_batch_size: int = 16
    prompt_len: int = 1024
    generate_len: int = 1024
    rollout_samples: int = 16  # sequences generated per step (all engines together)
    engine_pool: bool = False  # the engine takes engine_memory_fraction x its GPU at start-up (vLLM, SGLang)
    engine_memory_fraction: float = 0.5  # vllm_gpu_memory_utilization
    sync_bucket_bytes: int = 512 << 20
    logits_chunk_bytes: int | None = None  # the trainer computes float32 logits this many bytes at a time (None: all)
    context_bytes: float = CONTEXT_BYTES  # what every process holds on its GPU whatever it keeps (CUDA context)

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.generate_len

    @property
    def bytes_per_value(self) -> int:
        return 2 if self.bf16 else 4


@dataclass(frozen=True)
class RoleSize:
    """One worker of a role on one of its GPUs: its states' bytes and its working memory per phase it works in."""

    role: str
    kind: str
    states: dict[str, float]  # state -> bytes (see steps.KIND_STATES)
    working: dict[str, dict[str, float]] = field(default_factory=dict)  # phase -> item -> bytes
    context: float = CONTEXT_BYTES
    #: states whose bytes are exact, not estimated: a vLLM / SGLang pool is the fraction of the GPU it was told to
    #: take, so the safety margin of the estimates does not apply to it
    exact: frozenset[str] = frozenset()
    #: what one worker keeps in host memory for the whole run, whatever the plan (item -> bytes): CPU Adam's state
    #: with adam_offload (``"cpu_adam"``)
    host: dict[str, float] = field(default_factory=dict)
    #: the bytes CPU Adam would keep in host memory for one worker, should the plan keep its optimizer there (the
    #: ``host`` move); 0 for roles without an optimizer
    host_optimizer: float = 0.0

    def working_total(self, phase: str) -> float:
        return sum(self.working.get(phase, {}).values())

    @property
    def peak_working(self) -> float:
        return max((self.working_total(p) for p in self.working), default=0.0)


def size_role(role: str, shape: ModelShape, work: Workload, *, ranks: int, tp: int, gpu_bytes: float) -> RoleSize:
    """The bytes one worker of ``role`` (``ranks`` workers of ``tp`` GPUs each) holds on one of its GPUs."""
    kind = kind_of(role)
    if kind == "engine":
        return _engine(role, shape, work, ranks=ranks, tp=tp, gpu_bytes=gpu_bytes)
    b, z, n, seq = work.bytes_per_value, work.zero_stage, ranks, work.seq_len
    if kind == "frozen":
        tokens = work.micro_rollout_batch_size * seq
        working = {role: _forward(shape, work, tokens)}
        size = RoleSize(role, kind, {"params": b * shape.num_params}, working, work.context_bytes)
        return _with_cache(size)
    k = 0 if work.adam_offload else (12 if work.bf16 else 8)
    cpu_adam = (CPU_ADAM_BYTES + (b if z < 3 else 0)) * shape.num_params / (n if z >= 1 else 1)
    states = {"params": b * shape.num_params / (n if z == 3 else 1),
              "grads": b * shape.num_params / (n if z >= 2 else 1),
              "optimizer": k * shape.num_params / (n if z >= 1 else 1)}
    gather = {"zero3_gather": 2 * shape.layer_params * b} if z == 3 else {}
    tokens = work.micro_train_batch_size * seq
    saved = (shape.num_layers * shape.hidden_size + shape.layer_activation_values if work.gradient_checkpointing
             else shape.num_layers * shape.layer_activation_values)
    # DeepSpeed's own buffers: the gradient reduce bucket (reduce_bucket_size elements of the model dtype, capped at
    # 5e8 as the training loop configures it) and, for the optimizer step, fp32 copies of this rank's gradients.
    ds_buffers = {"reduce_bucket": b * min(5e8, shape.num_params)}
    if work.bf16 and not work.adam_offload and z >= 1:
        ds_buffers["fp32_grads"] = 4 * shape.num_params / n
    train = {"activations": tokens * saved * b, "logits": _logits(shape, work, tokens), **gather, **ds_buffers}
    infer = {**_forward(shape, work, work.micro_rollout_batch_size * seq), **gather}
    if role == "critic":
        working = {"critic_infer": infer, "critic_train": train}
    else:
        # actor_train also runs the old-log-prob pass; the larger of the two is the phase's working memory
        working = {"actor_train": max(train, infer, key=lambda d: sum(d.values())),
                   "sync": {"sync_bucket": _bucket(work, shape), **gather}}
    return _with_cache(RoleSize(role, kind, states, working, work.context_bytes,
                                host={CPU_ADAM: cpu_adam} if work.adam_offload else {}, host_optimizer=cpu_adam))


def _with_cache(size: RoleSize) -> RoleSize:
    size.states["cache"] = size.peak_working
    return size


def _forward(shape: ModelShape, work: Workload, tokens: int) -> dict[str, float]:
    """Working memory of a forward pass without gradients: one layer's activations at a time, plus the logits."""
    return {"activations": tokens * shape.layer_activation_values * work.bytes_per_value,
            "logits": _logits(shape, work, tokens)}


def _logits(shape: ModelShape, work: Workload, tokens: int) -> float:
    if shape.value_head:
        return 0.0
    if work.logits_chunk_bytes:
        tokens = min(tokens, max(1, work.logits_chunk_bytes // (4 * shape.vocab_size)))
    return tokens * shape.vocab_size * (work.bytes_per_value + 8)


def _engine(role: str, shape: ModelShape, work: Workload, *, ranks: int, tp: int, gpu_bytes: float) -> RoleSize:
    seq = work.seq_len
    bucket = _bucket(work, shape)
    if work.engine_pool:
        weights = 2 * shape.num_params / tp
        pool = work.engine_memory_fraction * gpu_bytes
        if weights + shape.kv_bytes_per_token(2) / tp * seq > pool:
            raise ConfigError(
                "vllm_gpu_memory_utilization",
                f"an engine's share of the GPU ({work.engine_memory_fraction} x {gpu_bytes / GiB:.1f} GiB = "
                f"{pool / GiB:.1f} GiB) cannot hold its weights ({weights / GiB:.1f} GiB per GPU at TP {tp}) plus "
                f"the KV cache of one {seq}-token sequence.",
                "Raise --vllm_gpu_memory_utilization or --vllm_tensor_parallel_size.")
        return RoleSize(role, "engine", {"weights": weights, "kv_cache": pool - weights},
                        {"sync": {"sync_bucket": bucket}}, work.context_bytes, frozenset({"weights", "kv_cache"}))
    b = work.bytes_per_value
    sequences = math.ceil(work.rollout_samples / max(ranks, 1))
    generate = {"kv_cache": sequences * seq * shape.kv_bytes_per_token(b) / tp,
                "logits": sequences * shape.vocab_size * 4.0}
    # The built-in engine allocates its KV cache per generate call and frees it after: working memory, no pool.
    return RoleSize(role, "engine", {"weights": b * shape.num_params / tp, "kv_cache": 0.0},
                    {"generate": generate, "sync": {"sync_bucket": bucket}}, work.context_bytes)


def _bucket(work: Workload, shape: ModelShape) -> float:
    """One weight-sync bucket: the configured size, or the whole model in bf16 when that is smaller."""
    return float(min(work.sync_bucket_bytes, 2 * shape.num_params))


def check_states(size: RoleSize) -> None:
    expected = set(KIND_STATES[size.kind])
    if set(size.states) != expected:
        raise ValueError(f"{size.role}: states {sorted(size.states)} != {sorted(expected)}")
