"""The memory model: bytes of each role's states and of each phase's working memory on one GPU, from the model's
config alone (nothing is loaded). The planner (:mod:`.planner`) decides from these numbers what stays resident.

Notation: P parameters of a role's model, N its data-parallel ranks, z the ZeRO stage, b = 2 bytes per value with
bf16 (else 4), L layers, h hidden size, I MLP width, kv = KV heads x head dim, V vocabulary, S the longest sequence
(prompt_len + generate_len).

Trainers (kind ``trainer``: PPO's actor and critic, say), per GPU -- the ZeRO paper's accounting (Rajbhandari et
al. 2020), with DeepSpeed's own buffers as DeepSpeed 0.19.8 allocates them (see "The optimizer's bytes" below).
Under LoRA (``ModelShape.trainable_params``) every P of the gradients, the optimizer, the flat partitions, the
reduce buckets and CPU Adam below is the adapters' count instead (PPO's critic: its adapters' and its value head's,
which trains whole): the frozen base has parameters only.
    params     = b P / (N if z = 3 else 1)
    grads      = b P / (N if z >= 2 else 1)
    optimizer  = K P / (N if z >= 1 else 1), K = m + s with bf16 (the master weights and Adam's m, v), 8 in fp32
                 (m, v); 0 when the optimizer is in host memory (adam_offload)
    working (training, one micro batch of T = micro_train_batch_size x S tokens): activations, per token per layer
                 A = 5h + 2kv + 4I values (norm inputs, q/k/v, attention output, residual, gate/up/act/product of the
                 MLP; memory-efficient attention, no S^2 term): T L A b, or T (L h + A) b with gradient checkpointing;
                 logits T' V (b + 8) for a policy (model-dtype logits, their fp32 copy and log-softmax; T' = the
                 positions of one chunk when the trainer computes log-probs in chunks of ``logits_chunk_bytes`` of
                 float32 logits, else T), 0 for a value head;
                 ZeRO-3 gathers 2 layers' weights (the layer in use and the prefetched one);
                 DeepSpeed's buffers: the gradient reduce bucket, b min(5e8, P); with bf16 and ZeRO >= 1, the
                 optimizer step's flat gradient partition in the master dtype, m P / N (``fp32_grads``, or
                 ``bf16_grads`` with bf16 master weights; ZeRO-3 makes it one sub-group of at most 1e9 elements, plus
                 the parameter that closes it, at a time); with adam_offload under ZeRO-1/2, a staging buffer of the
                 largest parameter (b x its size) that gradients pass through on their way to host memory

The optimizer's bytes per parameter of a rank's ZeRO partition (bf16 model; m = master weights, s = Adam m + v):

    mode                                   on the GPU (K = m + s)    in host memory with CPU Adam (adam_offload)
    default (fp32 master, fp32 m, v)       4 + 8 = 12                4 + 4 + 8 + 2 = 18 (+ 2, ZeRO-2, see below)
    bf16_master_weights (fp32 m, v)        refused: DeepSpeed        2 + 2 + 8 + 2 = 14
                                           needs CPU Adam for it
    + bf16_optimizer_states                2 + 4 = 6                 2 + 2 + 4 + 2 = 10

  * on the GPU (FusedAdam): the master partition is a copy of the rank's bf16 partition in the master dtype (ZeRO-1/2
    ``single_partition_of_fp32_groups``; ZeRO-3 ``fp32_partitioned_groups_flat``: even when both are bf16 it is a
    separate copy, DeepSpeed's alias test compares a tensor's device with a device *name*), and FusedAdam's m, v are
    ``zeros_like`` the master partition: they follow its dtype, which is why DeepSpeed refuses bf16 master weights
    with fp32 moments unless CPU Adam holds them. At the step, the rank's gradients are flattened into one partition
    in the master dtype, beside the model's gradients until it is made (the ``fp32_grads`` / ``bf16_grads`` buffer
    above: with fp32 master weights the flattened bf16 copy is converted and dropped at once, only the fp32 one is
    counted; with bf16 master weights the flattened copy is the buffer). ZeRO-1/2 flatten the whole partition at once,
    ZeRO-3 one sub-group at a time -- on one rank with a bf16 optimizer, that difference decides whether a 6.5B model's
    optimizer fits an 80 GB GPU beside a reference and vLLM (the training loop keeps one-rank ZeRO-3 for it).
  * in host memory (DeepSpeedCPUAdam, ``fp32_optimizer_states`` off with bf16_optimizer_states): the master
    partition (m), its gradient in the master dtype (m), Adam's m, v (s), and a model-dtype partition (b): under
    ZeRO-1/2 the buffer the updated weights pass through on their way back to the GPU
    (``param_buffer_of_bit16_for_cpu_offload_groups``), under ZeRO-3 the gradient partitions
    (``grad_partitions_flat_buffer``, in host memory when the optimizer is). ZeRO-2 with fp32 master weights and an
    update of several micro-batches also accumulates each parameter's gradient in a model-dtype host buffer
    (``accumulated_grads_in_cpu``; with bf16 master weights those are views of the master gradient): + b. ZeRO-1/2
    also keep one host staging buffer of the largest parameter (b x its size, per worker, not per parameter).
    Missing the model-dtype partition (16 instead of 18) let a 6.5B model's plan pass on a 125 GiB host where
    DeepSpeed's set-up then took 108 GiB in one process and Ray's memory monitor killed it (H100, 2026-11-24).
  (The fp32 model, without ``bf16``, is counted as before: K = 8, no master copy and no flat gradient buffer; DeepSpeed
  0.19.8 in fact keeps a 4-byte master copy there too under ZeRO >= 1.)
Frozen models (kind ``frozen``: a reference, a reward model), per GPU: params = b P / (N if sharded else 1) --
    sharded over the role's N > 1 ranks as the trainers' parameters are (:func:`frozen_shards`): under ZeRO-3, as
    OpenRLHF shards its reference and reward models (DeepSpeed inference engines with the trainers' ZeRO stage), and
    under FSDP2 (``fully_shard``, the trainers' layout, every unit resharded after its forward); else whole on every
    rank; working: one forward of micro_rollout_batch_size sequences, T'' A b (one layer at a time) + logits
    T'' V (b + 8), and when sharded the weights the forward gathers: 2 layers under ZeRO-3 (as for a trainer), 2
    layers and the root unit (embeddings, final norm, head) under FSDP2.
Engines (kind ``engine``), per GPU of an engine of TP GPUs:
    engines with a pool (vLLM, SGLang: their class says ``MEMORY_POOL``) pre-allocate
                 ``engine_memory_fraction x GPU memory`` (their pool): weights = 2P/TP (bf16) and the
                 KV cache = the rest of the pool; nothing else grows while they generate.
    hf (built-in): weights = b P / TP; while it generates, the KV cache of its share of the rollout
                 (ceil(samples / engines) sequences of S tokens, 2 L kv b / TP per token) + the last logits.
Host memory (per worker, :mod:`.host` sums it per node): with adam_offload, CPU Adam's bytes above x P / (N if z >= 1
    else 1) for the whole run (``RoleSize.host``); ``RoleSize.host_optimizer`` is the same number for a trainer
    without adam_offload, what the planner's ``host`` move would put there.
Every worker process also holds CONTEXT_BYTES (CUDA context, NCCL and cuBLAS workspaces), whatever it keeps.
During the sync, each side holds one weight-sync bucket.

``cache``: after its phase a role that does not trim keeps its working peak reserved in the caching allocator.

Which of these a phase holds is the phase's to say (``Phase.work``: ``generate``, ``infer``, ``train``, ``sync``): the
working memory of a role is counted in each phase that names it, for that phase's work (:func:`size_role`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from .steps import KIND_STATES, WORK_KINDS, Phase

GiB = 1024**3
CONTEXT_BYTES = GiB // 2
CPU_ADAM = "cpu_adam"  # its item in RoleSize.host
#: DeepSpeed's zero_optimization.sub_group_size default (the training loop keeps it): ZeRO-3's optimizer step makes
#: the flat gradient of one sub-group of parameters at a time.
ZERO3_SUB_GROUP = int(1e9)


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
    trainable_params: int | None = None  # LoRA: the adapters' parameters (a critic's: and its head's); None: all

    @property
    def trained(self) -> int:
        """Parameters the optimizer steps (and gradients exist for): the adapters under LoRA, else every one."""
        return self.num_params if self.trainable_params is None else self.trainable_params

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_activation_values(self) -> int:
        """A: values saved per token by one layer for the backward pass (see the module docstring)."""
        return 5 * self.hidden_size + 2 * self.kv_dim + 4 * self.intermediate_size

    @property
    def largest_param(self) -> int:
        """Elements of the largest single parameter tensor: the embeddings (or the LM head), else an MLP matrix."""
        return max(self.vocab_size, self.intermediate_size) * self.hidden_size

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
    return ModelShape(
        count_params(hf_config, value_head=value_head, trust_remote_code=trust_remote_code),
        hidden,
        cfg.num_hidden_layers,
        kv_heads,
        head_dim,
        inter,
        cfg.vocab_size,
        value_head,
    )


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
        raise ConfigError(
            "model", "sizing a model from its config needs transformers.", "pip install transformers"
        ) from e
    auto = AutoModel if value_head else AutoModelForCausalLM
    if getattr(hf_config, "vision_config", None) is not None and not value_head:
        # a vision-language model (Qwen2-VL): its vision tower's parameters count too, in every state of the role
        from transformers import AutoModelForImageTextToText

        auto = AutoModelForImageTextToText
    with torch.device("meta"):
        model = (
            auto.from_config(hf_config, trust_remote_code=trust_remote_code)
            if trust_remote_code
            else auto.from_config(hf_config)
        )
    n = int(sum(p.numel() for p in model.parameters()))  # int: torch is untyped here (Any)
    return n + (hf_config.hidden_size + 1 if value_head else 0)


@dataclass(frozen=True)
class Workload:
    """What the memory model needs to know about a run besides the models (the training loop fills it in)."""

    bf16: bool = True
    trainer_backend: str = "deepspeed"  # or "fsdp2": the trainers' bytes per state (see _fsdp2_trainer)
    zero_stage: int = 2
    adam_offload: bool = False
    bf16_master_weights: bool = False  # the ZeRO optimizer's master weights and gradients in bf16
    bf16_optimizer_states: bool = False  # Adam's m, v in bf16 (with bf16_master_weights)
    gradient_accumulation: bool = True  # an update may take several micro-batches (ZeRO-2 CPU Adam buffers them)
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

    @property
    def master_bytes(self) -> int:
        """m: bytes per value of the optimizer's master weights and of the gradients it steps with."""
        return 2 if self.bf16_master_weights else 4

    @property
    def adam_state_bytes(self) -> int:
        """s: bytes per parameter of Adam's m and v together."""
        return 4 if self.bf16_optimizer_states else 8

    @property
    def optimizer_bytes(self) -> int:
        """K: the optimizer's bytes per parameter of a rank's partition on the GPU (see the module docstring)."""
        if self.adam_offload:
            return 0
        return self.master_bytes + self.adam_state_bytes if self.bf16 else 8


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


@dataclass(frozen=True)
class GpuShare:
    """The workers of one role on one GPU, with the bytes one of them holds (a residency plan's layout: plan GPU ->
    its shares; here, below the plan and the host-memory count, which both read it)."""

    size: RoleSize
    workers: int = 1

    @property
    def role(self) -> str:
        return self.size.role


def size_role(
    role: str,
    shape: ModelShape,
    work: Workload,
    *,
    kind: str,
    phases: Sequence[Phase],
    ranks: int,
    tp: int,
    gpu_bytes: float,
) -> RoleSize:
    """The bytes one worker of ``role`` (a ``kind`` of :data:`~.steps.KIND_STATES`; ``ranks`` workers of ``tp`` GPUs
    each) holds on one of its GPUs. Its working memory is counted in each of ``phases`` that names it, for the work
    the phase declares (``Phase.work``: the largest of its kinds of work, which run one after another)."""
    if kind not in KIND_STATES:
        raise ValueError(f"{role}: unknown role kind {kind!r} (one of {', '.join(KIND_STATES)})")
    if kind == "engine":
        states, exact, sized = _engine(role, shape, work, ranks=ranks, tp=tp, gpu_bytes=gpu_bytes)
        return RoleSize(role, kind, states, _working(role, kind, phases, sized), work.context_bytes, exact)
    b, z, n, seq = work.bytes_per_value, work.zero_stage, ranks, work.seq_len
    if kind == "frozen":
        # ZeRO-3 or FSDP2 shards a frozen model over its ranks (one rank: nothing to split, the worker keeps it whole)
        shards = frozen_shards(z, ranks=n, backend=work.trainer_backend)
        gather = _frozen_gather(shape, work) if shards > 1 else {}
        sized = {"infer": {**_forward(shape, work, work.micro_rollout_batch_size * seq), **gather}}
        size = RoleSize(
            role,
            kind,
            {"params": b * shape.num_params / shards},
            _working(role, kind, phases, sized),
            work.context_bytes,
        )
        return _with_cache(size)
    if work.trainer_backend == "fsdp2":
        return _fsdp2_trainer(role, shape, work, phases, ranks=n)
    # under LoRA the frozen base keeps its parameters but has no gradients and no optimizer state (shape.trained)
    part = shape.trained / (n if z >= 1 else 1)  # parameters of the rank's optimizer partition
    states = {
        "params": b * shape.num_params / (n if z == 3 else 1),
        "grads": b * shape.trained / (n if z >= 2 else 1),
        "optimizer": work.optimizer_bytes * part,
    }
    gather = {"zero3_gather": 2 * shape.layer_params * b} if z == 3 else {}
    tokens = work.micro_train_batch_size * seq
    saved = (
        shape.num_layers * shape.hidden_size + shape.layer_activation_values
        if work.gradient_checkpointing
        else shape.num_layers * shape.layer_activation_values
    )
    # DeepSpeed's own buffers: the gradient reduce bucket (reduce_bucket_size elements of the model dtype, capped at
    # 5e8 as the training loop configures it) and, for the optimizer step, the flat gradient partition in the master
    # dtype (or, with CPU Adam under ZeRO-1/2, a GPU staging buffer of the largest parameter).
    ds_buffers = {"reduce_bucket": b * min(5e8, shape.trained)}
    if work.bf16 and not work.adam_offload and z >= 1:
        # ZeRO-3 steps one sub-group (sub_group_size elements, closed after the parameter that reaches it) at a time
        flat = min(part, ZERO3_SUB_GROUP + shape.largest_param) if z == 3 else part
        ds_buffers["bf16_grads" if work.bf16_master_weights else "fp32_grads"] = work.master_bytes * flat
    if work.adam_offload and z in (1, 2):
        ds_buffers["offload_grad_staging"] = b * shape.largest_param
    train = {"activations": tokens * saved * b, "logits": _logits(shape, work, tokens), **gather, **ds_buffers}
    sized = {
        "train": train,
        "infer": {**_forward(shape, work, work.micro_rollout_batch_size * seq), **gather},
        "sync": {"sync_bucket": _bucket(work, shape), **gather},
    }
    cpu_adam = cpu_adam_bytes(shape, work, ranks=n)
    return _with_cache(
        RoleSize(
            role,
            kind,
            states,
            _working(role, kind, phases, sized),
            work.context_bytes,
            host={CPU_ADAM: cpu_adam} if work.adam_offload else {},
            host_optimizer=cpu_adam,
        )
    )


def _fsdp2_trainer(role: str, shape: ModelShape, work: Workload, phases: Sequence[Phase], *, ranks: int) -> RoleSize:
    """A trainer under FSDP2 (``fully_shard`` per decoder layer, then the root), per GPU, with m the master bytes
    (4, or 2 with bf16_master_weights) and b the compute bytes: every state is sharded over the N ranks --
    params m P / N, grads m P / N, optimizer 2 m P / N (AdamW's m, v take the master dtype). Working memory: the
    activations and logits as under DeepSpeed; the gathered weights of 2 layers (the one in use and the next) in the
    compute dtype, and the root unit's (embeddings, final norm, head) for the whole pass, since it is not resharded
    after the forward; in the backward one layer's unsharded gradients in the fp32 reduce dtype before their
    reduce-scatter. No CPU Adam: nothing stays in host memory."""
    b, m, seq = work.bytes_per_value, work.master_bytes, work.seq_len
    P, T = shape.num_params, shape.trained  # T: the trained ones (LoRA's adapters), with gradients and moments
    states = {"params": m * P / ranks, "grads": m * T / ranks, "optimizer": 2 * m * T / ranks}
    root = max(0, P - shape.num_layers * shape.layer_params)
    gather = {"fsdp2_gather": (2 * shape.layer_params + root) * b}
    tokens = work.micro_train_batch_size * seq
    saved = (
        shape.num_layers * shape.hidden_size + shape.layer_activation_values
        if work.gradient_checkpointing
        else shape.num_layers * shape.layer_activation_values
    )
    train = {
        "activations": tokens * saved * b,
        "logits": _logits(shape, work, tokens),
        **gather,
        "fsdp2_reduce": 4.0 * shape.layer_params * T / max(P, 1),
    }
    sized = {
        "train": train,
        "infer": {**_forward(shape, work, work.micro_rollout_batch_size * seq), **gather},
        "sync": {"sync_bucket": _bucket(work, shape), **gather},
    }
    return _with_cache(RoleSize(role, "trainer", states, _working(role, "trainer", phases, sized), work.context_bytes))


def _working(
    role: str, kind: str, phases: Sequence[Phase], sized: dict[str, dict[str, float]]
) -> dict[str, dict[str, float]]:
    """Phase -> the role's working memory there: of the phase's kinds of work, the largest (they run one after
    another, e.g. the old-log-prob pass and the PPO epochs of one phase). Work a role's kind cannot do is a
    ValueError naming the phase; work that needs no memory of its own (an engine with a pool generating) adds none."""
    out: dict[str, dict[str, float]] = {}
    for phase in phases:
        if role not in phase.needs:
            continue
        bad = [w for w in phase.work if w not in WORK_KINDS[kind]]
        if bad:
            raise ValueError(
                f"phase {phase.name}: {role} (kind {kind}) cannot {', '.join(bad)} "
                f"(it can {', '.join(WORK_KINDS[kind])})"
            )
        options = [sized[w] for w in phase.work if sized.get(w)]
        if options:
            out[phase.name] = max(options, key=lambda d: sum(d.values()))
    return out


def frozen_shards(zero_stage: int, *, ranks: int, backend: str = "deepspeed") -> int:
    """Into how many shards a frozen role (reference, reward model) of ``ranks`` workers splits its parameters: all
    of its ranks where the trainers' parameters are sharded -- ZeRO-3 (OpenRLHF's inference engines take the
    trainers' ZeRO stage) or FSDP2 (``backend``, which shards them always) --, else 1 (whole on each). The training
    loop's frozen workers shard exactly when this is above 1 (``trainer_backends.registry.frozen_sharded``)."""
    sharded = backend == "fsdp2" or zero_stage == 3
    return ranks if sharded and ranks > 1 else 1


def _frozen_gather(shape: ModelShape, work: Workload) -> dict[str, float]:
    """The weights a sharded frozen model's forward holds gathered (see the module docstring)."""
    b = work.bytes_per_value
    if work.trainer_backend == "fsdp2":
        root = max(0, shape.num_params - shape.num_layers * shape.layer_params)
        return {"fsdp2_gather": (2 * shape.layer_params + root) * b}
    return {"zero3_gather": 2 * shape.layer_params * b}


def cpu_adam_bytes(shape: ModelShape, work: Workload, *, ranks: int) -> float:
    """Host bytes DeepSpeed's CPU Adam keeps for one trainer rank for the whole run (the module docstring's table):
    master weights and their gradients (m each), Adam's m, v (s), a model-dtype partition (b), ZeRO-2's gradient
    accumulation buffers with fp32 master weights, and ZeRO-1/2's staging buffer of the largest parameter."""
    b, z = work.bytes_per_value, work.zero_stage
    per_param = 2 * work.master_bytes + work.adam_state_bytes + b
    if z == 2 and work.gradient_accumulation and not work.bf16_master_weights:
        per_param += b  # accumulated_grads_in_cpu (with bf16 master weights: views of the master gradient)
    staging = b * shape.largest_param if z in (1, 2) else 0
    return per_param * shape.trained / (ranks if z >= 1 else 1) + staging


def _with_cache(size: RoleSize) -> RoleSize:
    size.states["cache"] = size.peak_working
    return size


def _forward(shape: ModelShape, work: Workload, tokens: int) -> dict[str, float]:
    """Working memory of a forward pass without gradients: one layer's activations at a time, plus the logits."""
    return {
        "activations": tokens * shape.layer_activation_values * work.bytes_per_value,
        "logits": _logits(shape, work, tokens),
    }


def _logits(shape: ModelShape, work: Workload, tokens: int) -> float:
    if shape.value_head:
        return 0.0
    if work.logits_chunk_bytes:
        tokens = min(tokens, max(1, work.logits_chunk_bytes // (4 * shape.vocab_size)))
    return tokens * shape.vocab_size * (work.bytes_per_value + 8)


def _engine(
    role: str, shape: ModelShape, work: Workload, *, ranks: int, tp: int, gpu_bytes: float
) -> tuple[dict[str, float], frozenset[str], dict[str, dict[str, float]]]:
    """An engine's states, the states whose bytes are exact (a pool), and its working memory per kind of work."""
    seq = work.seq_len
    bucket = _bucket(work, shape)
    if work.engine_pool:
        weights = 2 * shape.num_params / tp
        pool = work.engine_memory_fraction * gpu_bytes
        if weights + shape.kv_bytes_per_token(2) / tp * seq > pool:
            raise ConfigError(
                "engine.gpu_memory_utilization",
                f"an engine's share of the GPU ({work.engine_memory_fraction} x {gpu_bytes / GiB:.1f} GiB = "
                f"{pool / GiB:.1f} GiB) cannot hold its weights ({weights / GiB:.1f} GiB per GPU at TP {tp}) plus "
                f"the KV cache of one {seq}-token sequence.",
                "Raise engine.gpu_memory_utilization or engine.tensor_parallel_size.",
            )
        return (
            {"weights": weights, "kv_cache": pool - weights},
            frozenset({"weights", "kv_cache"}),
            {"sync": {"sync_bucket": bucket}},
        )
    b = work.bytes_per_value
    sequences = math.ceil(work.rollout_samples / max(ranks, 1))
    generate = {
        "kv_cache": sequences * seq * shape.kv_bytes_per_token(b) / tp,
        "logits": sequences * shape.vocab_size * 4.0,
    }
    # The built-in engine allocates its KV cache per generate call and frees it after: working memory, no pool.
    return (
        {"weights": b * shape.num_params / tp, "kv_cache": 0.0},
        frozenset(),
        {"generate": generate, "sync": {"sync_bucket": bucket}},
    )


def _bucket(work: Workload, shape: ModelShape) -> float:
    """One weight-sync bucket: the configured size, or the whole model in bf16 when that is smaller."""
    return float(min(work.sync_bucket_bytes, 2 * shape.num_params))
