"""GPU-memory budget of one training step, per GPU and per phase, from the model config alone (no weights loaded).

Notation: P parameters of a role's model, N its data-parallel ranks, z the ZeRO stage, b = 2 bytes per value with
``--bf16`` (else 4), L layers, h hidden size, I MLP width, kv = KV heads x head dim, V vocabulary,
T tokens of one micro batch = micro batch x (prompt_max_len + generate_max_len) (padded; packing only lowers it).

Trainers (actor, critic), per GPU -- the ZeRO paper's accounting (Rajbhandari et al. 2020):
    weights    = b P / (N if z = 3 else 1)
    gradients  = b P / (N if z >= 2 else 1)
    optimizer  = K P / (N if z >= 1 else 1), K = 12 with bf16 (fp32 master + Adam m, v), 8 in fp32 (m, v);
                 0 on the GPU with --adam_offload
    activations (training, one micro batch), per token per layer A = 5h + 2kv + 4I values (norm inputs, q/k/v,
                 attention output, residual, gate/up/act/product of the MLP; memory-efficient attention, no s^2 term):
                 T L A b without --gradient_checkpointing, T (L h + A) b with it (layer inputs + one layer recomputed)
    logits     = T V (b + 8) for the policy (model-dtype logits, their fp32 copy and log-softmax); 0 for a value head
    ZeRO-3 gather = 2 x one layer's weights (the layer in use and the prefetched one)
Frozen models (reference, reward): weights b P / (N if z = 3 else 1), forward activations for one
    micro_rollout_batch_size batch: T' A b (one layer at a time) + logits T' V (b + 8) for log-prob models.
Engines, per GPU of an engine of TP GPUs:
    vllm / sglang: they pre-allocate ``vllm_gpu_memory_utilization x GPU memory`` for weights (2P/TP, bf16) + KV cache;
                   the weights and one full-length sequence's KV cache must fit inside that fraction.
    hf: weights b P / TP + KV cache of its share of the rollout: ceil(prompts x samples / engines) sequences x
        (prompt_max_len + generate_max_len) tokens x 2 L kv b / TP.
Every worker process also holds CONTEXT_GIB (CUDA context, NCCL buffers), asleep or not.

A step runs the phases of :mod:`hybrid_algos.train.step` in order: generate, reward, reference, critic_infer,
actor_train, sync, critic_train. In a phase, the active roles take the memory of that phase; a role that sleeps
leaves only its CUDA context behind (vLLM level-1 sleep keeps no weights on the GPU); a role that does not sleep
keeps its resident memory (trainers: weights + gradients + optimizer; frozen models: weights; vLLM/SGLang: its whole
pre-allocated fraction; hf engine: weights). During ``sync`` the actor (still awake) and the engines' weights
(no KV cache) share the GPU, plus one weight-sync bucket on each side.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from hybrid_core.errors import PlacementError

GiB = 1024**3
CONTEXT_GIB = 0.5
PHASES = ("generate", "reward", "reference", "critic_infer", "actor_train", "sync", "critic_train")
#: role name in the plan -> what kind of worker it is
ROLE_KINDS = {"actor": "trainer", "critic": "trainer", "reference": "frozen", "ref": "frozen", "reward": "frozen",
              "rollout": "engine", "engine": "engine", "engines": "engine", "vllm": "engine"}
#: the phase in which each role works (the actor also works in ``sync``)
ACTIVE = {"generate": "rollout", "reward": "reward", "reference": "reference", "critic_infer": "critic",
          "actor_train": "actor", "sync": "actor", "critic_train": "critic"}


@dataclass(frozen=True)
class ModelShape:
    """The sizes the budget needs, read from a Hugging Face config."""

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


def model_shape(hf_config: Any, *, value_head: bool = False) -> ModelShape:
    """Sizes from a transformers config; the parameter count is exact (the model is built on the meta device)."""
    cfg = getattr(hf_config, "text_config", None) or hf_config
    hidden = cfg.hidden_size
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    inter = getattr(cfg, "intermediate_size", None) or 4 * hidden
    return ModelShape(count_params(hf_config, value_head=value_head), hidden, cfg.num_hidden_layers, kv_heads,
                      head_dim, inter, cfg.vocab_size, value_head)


def count_params(hf_config: Any, *, value_head: bool = False) -> int:
    """Parameters of the causal LM (or of the base model + a scalar value head), without allocating any memory."""
    return _count_params(hf_config.to_json_string(), value_head)


@functools.lru_cache(maxsize=32)
def _count_params(config_json: str, value_head: bool) -> int:
    import json

    import torch
    from transformers import AutoConfig

    settings = json.loads(config_json)
    hf_config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    from transformers import AutoModel, AutoModelForCausalLM

    with torch.device("meta"):
        model = (AutoModel if value_head else AutoModelForCausalLM).from_config(hf_config)
    n = sum(p.numel() for p in model.parameters())
    return n + (hf_config.hidden_size + 1 if value_head else 0)


@dataclass(frozen=True)
class RolePlacement:
    """A role as the budget sees it: how many ranks (or engines), GPUs per worker, whether it sleeps, which GPUs."""

    role: str
    ranks: int
    tp: int
    sleeps: bool
    gpus: tuple[int, ...]  # one entry per (worker, GPU) pair; a GPU repeats if two workers of the role share it

    @property
    def kind(self) -> str:
        return ROLE_KINDS.get(self.role, "trainer")


@dataclass
class PhaseBudget:
    """Bytes on one GPU in one phase: (role, item) -> bytes."""

    gpu: int
    phase: str
    items: dict[tuple[str, str], float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.items.values())

    def by_item(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for (_, item), value in self.items.items():
            out[item] = out.get(item, 0.0) + value
        return out


@dataclass
class MemoryBudget:
    gpu_bytes: float
    phases: list[PhaseBudget]
    roles_on_gpu: dict[int, tuple[str, ...]]

    def worst(self) -> PhaseBudget:
        return max(self.phases, key=lambda p: p.total)

    def check(self) -> None:
        """Raise a PlacementError with the number that does not fit (the fullest GPU and phase)."""
        worst = self.worst()
        if worst.total <= self.gpu_bytes:
            return
        parts = ", ".join(f"{role} {item} {v / GiB:.1f}" for (role, item), v in
                          sorted(worst.items.items(), key=lambda kv: -kv[1]) if v >= 0.05 * GiB)
        raise PlacementError(
            "gpu_memory_gb", f"GPU {worst.gpu}, phase {worst.phase}: {worst.total / GiB:.1f} GiB needed > "
            f"{self.gpu_bytes / GiB:.1f} GiB ({parts} GiB).", _fix_for(worst))


def _fix_for(worst: PhaseBudget) -> str:
    role, item = max(worst.items, key=lambda k: worst.items[k])
    if item == "weights" and ROLE_KINDS.get(role) == "engine":
        return ("Use a larger --vllm_tensor_parallel_size (an engine's weights are split over its GPUs), or more "
                "GPUs.")
    return {
        "optimizer": "Use --adam_offload, --zero_stage 3, or more GPUs for the " + role + ".",
        "activations": "Use --gradient_checkpointing or a smaller micro batch size.",
        "logits": "Use a smaller micro batch size (logits are micro batch x length x vocab).",
        "kv_cache": "Lower --vllm_gpu_memory_utilization, or let the engines sleep (--vllm_enable_sleep).",
        "engine": "Lower --vllm_gpu_memory_utilization, or let the engines sleep (--vllm_enable_sleep).",
        "weights": "Use --zero_stage 3, more GPUs, or let colocated roles sleep (--deepspeed_enable_sleep).",
        "gradients": "Use --zero_stage 2 or 3, or more GPUs for the " + role + ".",
    }.get(item, "Give the roles more GPUs or let colocated roles sleep.")


def estimate(config: Any, roles: Iterable[RolePlacement], models: Mapping[str, ModelShape], gpu_bytes: float
             ) -> MemoryBudget:
    """The budget of every GPU in every phase for ``roles`` placed as given (see the module docstring)."""
    roles = list(roles)
    b = 2 if config.bf16 else 4
    seq = config.prompt_max_len + config.generate_max_len
    workers_on: dict[int, Counter] = {}
    for r in roles:
        for gpu in r.gpus:
            workers_on.setdefault(gpu, Counter())[r.role] += 1
    by_name = {r.role: r for r in roles}
    phases = []
    for gpu in sorted(workers_on):
        for phase in PHASES:
            if not _phase_runs(phase, by_name):
                continue
            budget = PhaseBudget(gpu, phase)
            for role_name, count in workers_on[gpu].items():
                r = by_name[role_name]
                usage = _role_usage(config, r, models[role_name], phase, b, seq, gpu_bytes)
                for item, value in usage.items():
                    budget.items[(role_name, item)] = budget.items.get((role_name, item), 0.0) + value * count
            phases.append(budget)
    return MemoryBudget(gpu_bytes, phases, {g: tuple(sorted(c)) for g, c in workers_on.items()})


def _phase_runs(phase: str, roles: Mapping[str, RolePlacement]) -> bool:
    active = ACTIVE[phase]
    return any(canonical_role(name) == active for name in roles)


def canonical_role(role: str) -> str:
    """The phase-table name of a plan role (engines are "rollout", "ref" is "reference")."""
    kind = ROLE_KINDS.get(role)
    if kind == "engine":
        return "rollout"
    return "reference" if role == "ref" else role


def _role_usage(config: Any, r: RolePlacement, m: ModelShape, phase: str, b: int, seq: int, gpu_bytes: float
                ) -> dict[str, float]:
    """Bytes one worker of ``r`` holds on one of its GPUs in ``phase``."""
    usage = {"context": CONTEXT_GIB * GiB}
    role = canonical_role(r.role)
    active = ACTIVE[phase] == role or (phase == "sync" and r.kind == "engine")
    if not active and r.sleeps:
        return usage
    if r.kind == "engine":
        usage.update(_engine(config, r, m, phase if active else "resident", b, seq, gpu_bytes))
        return usage
    z, n = config.zero_stage, r.ranks
    usage["weights"] = b * m.num_params / (n if z == 3 else 1)
    if r.kind == "trainer":
        usage["gradients"] = b * m.num_params / (n if z >= 2 else 1)
        k = 0 if config.adam_offload else (12 if config.bf16 else 8)
        usage["optimizer"] = k * m.num_params / (n if z >= 1 else 1)
    if not active:
        return usage
    gather = 2 * m.layer_params * b if z == 3 else 0
    if gather:
        usage["zero3_gather"] = gather
    if phase in ("actor_train", "critic_train"):
        tokens = config.micro_train_batch_size * seq
        layers_saved = (m.num_layers * m.hidden_size + m.layer_activation_values if config.gradient_checkpointing
                        else m.num_layers * m.layer_activation_values)
        usage["activations"] = tokens * layers_saved * b
        usage["logits"] = 0 if m.value_head else tokens * m.vocab_size * (b + 8)
    elif phase == "sync":
        usage["sync_bucket"] = _bucket(config, m)
    else:  # forward-only inference of reward / reference / critic values
        tokens = config.micro_rollout_batch_size * seq
        usage["activations"] = tokens * m.layer_activation_values * b
        usage["logits"] = 0 if m.value_head else tokens * m.vocab_size * (b + 8)
    return usage


def _memory_pool(backend: str) -> bool:
    """The engine takes ``vllm_gpu_memory_utilization`` x its GPU at start-up (weights + KV cache), as vLLM and SGLang
    do; its class says so (``MEMORY_POOL``), so a new engine needs no edit here."""
    from hybrid_engines.registry import engine_spec

    return bool(getattr(engine_spec(backend), "MEMORY_POOL", False))


def _engine(config: Any, r: RolePlacement, m: ModelShape, phase: str, b: int, seq: int, gpu_bytes: float
            ) -> dict[str, float]:
    """An engine worker's bytes on one of its GPUs: generating, syncing weights, or resident while others work."""
    if _memory_pool(config.backend):
        weights = 2 * m.num_params / r.tp
        pool = config.vllm_gpu_memory_utilization * gpu_bytes
        if weights + m.kv_bytes_per_token(2) / r.tp * seq > pool:
            raise PlacementError(
                "vllm_gpu_memory_utilization",
                f"an engine's share of the GPU ({config.vllm_gpu_memory_utilization} x {gpu_bytes / GiB:.1f} GiB = "
                f"{pool / GiB:.1f} GiB) cannot hold its weights ({weights / GiB:.1f} GiB per GPU at TP "
                f"{r.tp}) plus the KV cache of one {seq}-token sequence.",
                "Raise --vllm_gpu_memory_utilization or --vllm_tensor_parallel_size.")
        held = {"weights": weights, "kv_cache": pool - weights}  # pre-allocated: held until the engine sleeps
        if phase == "sync":
            # A sleeping engine wakes only its weights for the sync; an awake one still holds its whole pool.
            return {"weights": weights, **({} if r.sleeps else {"kv_cache": pool - weights}),
                    "sync_bucket": _bucket(config, m)}
        return held
    weights = b * m.num_params / r.tp
    if phase == "sync":
        return {"weights": weights, "sync_bucket": _bucket(config, m)}
    if phase == "resident":
        return {"weights": weights}
    sequences = math.ceil(config.rollout_batch_size * config.n_samples_per_prompt / max(r.ranks, 1))
    return {"weights": weights, "kv_cache": sequences * seq * m.kv_bytes_per_token(b) / r.tp,
            "logits": sequences * m.vocab_size * 4.0}


def _bucket(config: Any, m: ModelShape) -> float:
    """One weight-sync bucket: --weight_sync_bucket_mb, or the whole model in bf16 when that is smaller."""
    return min(config.weight_sync_bucket_mb * 2**20, 2 * m.num_params)
