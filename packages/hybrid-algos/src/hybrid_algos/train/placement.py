"""The training config's layout: OpenRLHF counts (or RLinf-style ranges) -> a validated hybrid-core placement plan,
and the memory budget -> the residency plan (what each role keeps on its GPUs in each phase).

The roles come from the run's recipe (:mod:`.recipes`); roles it does not use get no GPUs: no critic unless the
estimator reads critic values, no reference without a KL term (``init_kl_coef`` 0, with or without ``use_kl_loss``),
no reward model with a rule-based reward. The residency planner gets the recipe's phases and role kinds. The CLI's
``--dry-run`` prints exactly these two plans. ``vllm_num_engines`` 0 puts one engine on each actor GPU (OpenRLHF:
generate with the actor). Under ``--zero_stage 3`` the reference and reward model are sharded over their GPUs, as
OpenRLHF shards them (the memory model counts 1/N of their weights per GPU; ``workers/zero3_frozen.py`` shards them).
"""

from __future__ import annotations

from typing import Any

from hybrid_core.errors import ConfigError
from hybrid_core.placement import PlacementPlan, PlacementSpec
from hybrid_core.residency import (
    GiB,
    HostBudget,
    ModelShape,
    ResidencyPlan,
    Workload,
    build_layout,
    local_budget,
    model_shape,
    plan_residency,
)
from hybrid_core.residency.planner import check_sleepers

from .config import RLConfig
from .recipe import Recipe
from .recipes import RECIPES, recipe_for

#: The budget's GPU size when neither --gpu_memory_gb nor a local GPU says (an H100 / A100 80GB).
DEFAULT_GPU_GIB = 80.0


def build_plan(cfg: RLConfig, recipe: Recipe | None = None) -> PlacementPlan:
    """The placement of ``recipe``'s roles (default: the config's, :func:`~.recipes.recipe_for`)."""
    recipe = recipe or recipe_for(cfg)
    if cfg.placement is not None:
        roles = {role: rng for role, rng in cfg.placement.items() if _role_used(recipe, role)}
        stray = [role for role in roles if not recipe.has(role)]
        if stray:
            raise ConfigError(
                f"placement.{stray[0]}",
                f"the {recipe.name} recipe has no role {stray[0]!r} (its roles: "
                f"{', '.join(r.name for r in recipe.roles)}).",
                "Give GPU ranges to those roles only.",
            )
        return PlacementSpec.from_ranges(
            roles, tp={"rollout": cfg.vllm_tensor_parallel_size}, gpus_per_node=cfg.gpus_per_node
        ).plan()
    return PlacementSpec.from_counts(
        actor_num_nodes=cfg.actor_num_nodes,
        actor_num_gpus_per_node=cfg.actor_num_gpus_per_node,
        critic_num_nodes=cfg.critic_num_nodes,
        critic_num_gpus_per_node=cfg.critic_num_gpus_per_node if recipe.has("critic") else 0,
        ref_num_nodes=cfg.ref_num_nodes,
        ref_num_gpus_per_node=cfg.ref_num_gpus_per_node if recipe.has("reference") else 0,
        reward_num_nodes=cfg.reward_num_nodes,
        reward_num_gpus_per_node=cfg.reward_num_gpus_per_node if recipe.has("reward") else 0,
        vllm_num_engines=cfg.vllm_num_engines or cfg.actor_world_size,
        vllm_tensor_parallel_size=cfg.vllm_tensor_parallel_size if cfg.vllm_num_engines else 1,
        colocate_all_models=cfg.colocate_all_models,
        colocate_actor_ref=cfg.colocate_actor_ref,
        colocate_critic_reward=cfg.colocate_critic_reward,
        gpus_per_node=cfg.gpus_per_node,
        engines_on_actor=cfg.vllm_num_engines == 0,
    ).plan()


def _role_used(recipe: Recipe, role: str) -> bool:
    """A --placement range is kept unless it names a built-in role this run's recipe dropped (any other name goes on
    to the placement's own checks)."""
    builtin = {r.name for base in RECIPES.values() for r in base.roles}
    return recipe.has(role) or role not in builtin


# ---- residency ------------------------------------------------------------------------------------------------------
def gpu_memory(cfg: RLConfig) -> tuple[float, str]:
    """Bytes per GPU the plan budgets, and where the number comes from."""
    if cfg.gpu_memory_gb is not None:
        return cfg.gpu_memory_gb * GiB, "--gpu_memory_gb"
    try:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            return float(props.total_memory), f"the local GPU ({props.name})"
    except Exception:  # no driver, broken install: the default is a budget, not a measurement
        pass
    return DEFAULT_GPU_GIB * GiB, f"no local GPU: {DEFAULT_GPU_GIB:g} GiB assumed (set --gpu_memory_gb)"


def host_memory(cfg: RLConfig, gpus_per_node: int | None = None) -> HostBudget:
    """The host memory each node may fill: --host_memory_gb, else what this machine has available now (Linux
    MemAvailable; unknown elsewhere, and then the plan says it did not check)."""
    if cfg.host_memory_gb is not None:
        return HostBudget(cfg.host_memory_gb * GiB, "--host_memory_gb", gpus_per_node)
    return local_budget(gpus_per_node)


def build_residency(
    cfg: RLConfig,
    placement: PlacementPlan,
    model_path: str | None,
    *,
    prompt_len: int,
    generate_len: int,
    gpu_bytes: float | None = None,
    host: HostBudget | None = None,
    recipe: Recipe | None = None,
) -> tuple[ResidencyPlan, RLConfig]:
    """The residency plan for this run, and the config the roles are built with (the planner may keep an optimizer
    in host memory: then ``adam_offload`` is on). ``prompt_len`` + ``generate_len``: the longest sequence. ``host``:
    each node's host memory (default: :func:`host_memory`); ``plan.check()`` refuses a plan that overfills it.
    ``recipe``: the run's roles and phases (default: the config's, :func:`~.recipes.recipe_for`)."""
    recipe = recipe or recipe_for(cfg)
    if gpu_bytes is None:
        gpu_bytes, _ = gpu_memory(cfg)
    if host is None:
        host = host_memory(cfg, placement.gpus_per_node)
    shapes = role_models(cfg, list(placement.roles), model_path, recipe)
    notes = []
    # the roles ZeRO-3 shards: the trainers, and the frozen models too (as OpenRLHF's inference engines do)
    sharded = [placement.roles[r.name] for r in recipe.workers if r.name in placement.roles]
    plan = None
    if cfg.zero_stage == 3 and all(t.world_size == 1 for t in sharded):
        # ZeRO-3 splits states across ranks; with one rank there is nothing to split, the same bytes stay on the GPU,
        # and every layer is still gathered and released around each use (measured: train 0.96 s vs 0.27 s at 357M).
        demoted = cfg.replace(zero_stage=1)
        plan = _plan(demoted, placement, shapes, gpu_bytes, prompt_len, generate_len, host, recipe)
        kept = None
        if _cpu_adam(plan) and not cfg.adam_offload:
            # ZeRO-1's optimizer step flattens all the gradients into a second copy at once, ZeRO-3's one sub-group
            # at a time: where that keeps the optimizer on the GPU, ZeRO-3's gathers cost less than CPU Adam's steps
            kept = _plan(cfg, placement, shapes, gpu_bytes, prompt_len, generate_len, host, recipe)
            kept = kept if kept.fits() and not _cpu_adam(kept) else None
        if kept is None:
            cfg = demoted
            notes.append(
                "--zero_stage 3 with one rank per trainer partitions nothing: running ZeRO-1 (the same bytes "
                "per GPU, without ZeRO-3's per-layer gather and release)"
            )
        else:
            plan = kept
            notes.append(
                "--zero_stage 3 with one rank per trainer: kept, although it partitions nothing (ZeRO-1 "
                "would keep the optimizer in host memory: its step holds a flat copy of all the gradients "
                "at once, ZeRO-3's one sub-group at a time)"
            )
    if plan is None:
        plan = _plan(cfg, placement, shapes, gpu_bytes, prompt_len, generate_len, host, recipe)
    if cfg.bf16_master_weights:
        notes.append(bf16_update_note(cfg))
    if _cpu_adam(plan) and not cfg.adam_offload:
        cfg = cfg.replace(adam_offload=True)  # DeepSpeed's CPU Adam: the optimizer state never enters the GPU
        notes += plan.notes
        plan = _plan(cfg, placement, shapes, gpu_bytes, prompt_len, generate_len, host, recipe)
    plan.notes[:0] = notes
    return plan, cfg


def bf16_update_note(cfg: RLConfig) -> str:
    """What bf16 master weights cost in precision, with this run's learning rate."""
    rates = [cfg.actor_learning_rate] + ([cfg.critic_learning_rate] if cfg.uses_critic else [])
    lr = min(rates)
    return (
        f"--bf16_master_weights: the optimizer updates the weights in bf16, so a step smaller than half of bf16's "
        f"spacing at a weight (1/512 to 1/256 of its magnitude) is rounded away; Adam's steps are about the "
        f"learning rate ({lr:g}), so weights above ~{256 * lr:.1e}-{512 * lr:.1e} in magnitude barely move (as "
        "in any pure-bf16 trainer). The default fp32 master weights keep every step."
    )


def _cpu_adam(plan: ResidencyPlan) -> bool:
    """Whether the plan keeps some trainer's optimizer in host memory (DeepSpeed's CPU Adam)."""
    return any(m == "host" for (_, s), m in plan.moves.items() if s == "optimizer")


def _plan(cfg, placement, shapes, gpu_bytes, prompt_len, generate_len, host, recipe: Recipe) -> ResidencyPlan:
    phases = recipe.residency_phases()
    layout = build_layout(
        placement, shapes, workload(cfg, prompt_len, generate_len), gpu_bytes, kinds=recipe.kinds, phases=phases
    )
    return replan(cfg, layout, gpu_bytes, host=host, phases=phases)


def replan(
    cfg: RLConfig, layout, gpu_bytes: float, overhead=None, host: HostBudget | None = None, phases=None
) -> ResidencyPlan:
    """The plan for a sized layout under this config's residency settings (``overhead``: bytes measured per GPU
    beyond the model, by a run's first step; ``host``: each node's host memory, shown and checked by the plan;
    ``phases``: the step, default the config's recipe's -- a refinement passes the plan's own)."""
    if phases is None:
        phases = recipe_for(cfg).residency_phases()
    settings = cfg.residency_settings()
    present = {s.role for shares in layout.values() for s in shares}
    pins = {k: v for k, v in settings["flag_pins"].items() if k[0] in present}  # the flags speak for both trainers
    pins.update(settings["pins"])
    shared = {s.role for shares in layout.values() if len(shares) > 1 for s in shares}
    sleeping = sleeping_roles(cfg, present, shared)

    def plan(pins):
        return plan_residency(
            layout,
            gpu_bytes,
            phases=phases,
            mode=settings["mode"],
            pins=pins,
            sleep_roles=sleeping,
            engine_sleep_level=settings["engine_sleep_level"],
            usable=cfg.gpu_memory_usable,
            allow_host=cfg.zero_stage >= 1,
            overhead=overhead,
            sleep_fields=SLEEP_FLAGS,
            host=host,
        )

    # --async_train on shared GPUs: first the plan that keeps the engines next to the trainer in every phase (they
    # then generate while it trains); where that does not fit, the usual plan (synchronous turns: async_rollout.py)
    from .async_rollout import async_pins

    together = async_pins(cfg, shared, sleeping)
    if together is not None:
        concurrent = plan({**pins, **together})
        if concurrent.fits():
            return concurrent
    return plan(pins)


def sleeping_roles(cfg: RLConfig, present: set[str], shared: set[str]) -> set[str]:
    """The roles the sleep flags ask to sleep. A flag for several roles (``--deepspeed_enable_sleep``: actor and critic)
    applies to those of them that share a GPU; one that none of them shares is an error naming the flag."""
    asked_roles = cfg.residency_settings()["sleep_roles"] & present
    out: set[str] = set()
    for flag in dict.fromkeys(SLEEP_FLAGS.values()):
        asked = {r for r in asked_roles if SLEEP_FLAGS.get(r) == flag}
        out |= (asked & shared) or asked
    check_sleepers(out, shared, SLEEP_FLAGS)
    return out


def check_sleep_flags(cfg: RLConfig, placement: PlacementPlan) -> None:
    """The sleep flags against the placement alone (before any model is sized): cheap, so it runs first."""
    shared = {r for r in placement.roles if placement.shared_gpus(r)}
    sleeping_roles(cfg, set(placement.roles), shared)


#: The setting that asks each role to sleep (named by the planner's errors).
SLEEP_FLAGS = {
    "rollout": "vllm_enable_sleep",
    "actor": "deepspeed_enable_sleep",
    "critic": "deepspeed_enable_sleep",
    "reference": "ref_reward_offload",
    "reward": "ref_reward_offload",
}


def workload(cfg: RLConfig, prompt_len: int, generate_len: int) -> Workload:
    from hybrid_engines.registry import engine_spec

    from .models import LOGITS_CHUNK_BYTES

    # an update of some trainer spans several micro-batches (ZeRO-2's CPU Adam then buffers gradients in host memory)
    ranks = min([cfg.actor_world_size] + ([cfg.critic_world_size] if cfg.uses_critic else []))
    accumulates = cfg.use_dynamic_batch or cfg.train_batch_size > cfg.micro_train_batch_size * ranks
    return Workload(
        bf16=cfg.bf16,
        zero_stage=cfg.zero_stage,
        adam_offload=cfg.adam_offload,
        bf16_master_weights=cfg.bf16_master_weights,
        bf16_optimizer_states=cfg.bf16_optimizer_states,
        gradient_accumulation=accumulates,
        gradient_checkpointing=cfg.gradient_checkpointing,
        micro_train_batch_size=cfg.micro_train_batch_size,
        micro_rollout_batch_size=cfg.micro_rollout_batch_size,
        prompt_len=prompt_len,
        generate_len=generate_len,
        rollout_samples=cfg.samples_per_step,
        engine_pool=bool(getattr(engine_spec(cfg.backend), "MEMORY_POOL", False)),
        engine_memory_fraction=cfg.vllm_gpu_memory_utilization,
        sync_bucket_bytes=cfg.weight_sync_bucket_mb << 20,
        context_bytes=cfg.gpu_context_gb * GiB,
        logits_chunk_bytes=LOGITS_CHUNK_BYTES,
    )


def hf_config(path: str | None, cfg: RLConfig) -> Any:
    """The transformers config of a model folder (config.json only, no weights), or the tiny demo model's."""
    if path is None:
        from .tiny import tiny_model_config

        return tiny_model_config(**cfg.tiny_model)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)


def role_models(
    cfg: RLConfig, roles: list[str], model_path: str | None = None, recipe: Recipe | None = None
) -> dict[str, ModelShape]:
    """The model shape of each role: of the folder its recipe entry loads (``RoleSpec.model``; the engines: the
    policy's), with a value head where the entry says so (critic, reward model)."""
    recipe = recipe or recipe_for(cfg)
    policy_path = model_path if model_path is not None else cfg.pretrain
    out: dict[str, ModelShape] = {}
    for role in roles:
        spec = recipe.role(role)
        source = policy_path if spec.kind == "engine" else spec.model_folder(cfg, policy_path)
        out[role] = model_shape(
            hf_config(source, cfg), value_head=spec.value_head, trust_remote_code=cfg.trust_remote_code
        )
    return out
