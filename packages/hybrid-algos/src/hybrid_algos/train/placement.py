"""The training config's layout: OpenRLHF counts (or RLinf-style ranges) -> a validated hybrid-core placement plan,
and the memory budget -> the residency plan (what each role keeps on its GPUs in each phase).

The roles come from the run's recipe (:mod:`.recipes`); roles it does not use get no GPUs: no critic unless the
estimator reads critic values, no reference without a KL term (``init_kl_coef`` 0, with or without ``use_kl_loss``),
no reward model with a rule-based reward. The residency planner gets the recipe's phases and role kinds. The CLI's
``--dry-run`` prints exactly these two plans. ``vllm_num_engines`` 0 puts one engine on each actor GPU (OpenRLHF:
generate with the actor). Under ``--zero_stage 3`` the reference and reward model are sharded over their GPUs, as
OpenRLHF shards them (the memory model counts 1/N of their weights per GPU; ``workers/zero3_frozen.py`` shards them).

The run reads sections (:func:`plan_placement`, :func:`plan_run_residency`, :func:`replan`: the settings of
:class:`~.train_settings.TrainSettings`). :func:`build_plan`, :func:`build_residency`, :func:`gpu_memory` and
:func:`host_memory` take the flat :class:`~.config.RLConfig`: the CLI's ``--dry-run`` (the flat form's home) calls
them, and they only turn it into sections.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hybrid_core.errors import ConfigError
from hybrid_core.placement import CountedRole, PlacementPlan, PlacementSpec
from hybrid_core.placement.settings import PlacementSettings
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
from hybrid_core.residency.settings import ResidencySettings, SleepAsks
from hybrid_engines.adapter import EngineSettings

from .config import RLConfig
from .model_settings import ModelSettings
from .recipe import Recipe
from .recipes import RECIPES, recipe_for
from .sections import flag_of, flag_text, flag_words
from .train_settings import TrainSettings
from .workers.settings import TrainerSettings

#: The budget's GPU size when neither --gpu_memory_gb nor a local GPU says (an H100 / A100 80GB).
DEFAULT_GPU_GIB = 80.0


def build_plan(cfg: RLConfig, recipe: Recipe | None = None) -> PlacementPlan:
    """:func:`plan_placement` of a flat config; ``recipe`` default: the config's, :func:`~.recipes.recipe_for`."""
    return plan_placement(cfg.placement_settings(), cfg.engine_settings(), recipe or recipe_for(cfg))


def plan_placement(placement: PlacementSettings, engine: EngineSettings, recipe: Recipe) -> PlacementPlan:
    """The placement of ``recipe``'s roles; its errors name the flags."""
    with flag_words():
        if placement.ranges is not None:
            ranges = {role: rng for role, rng in placement.ranges.items() if _role_used(recipe, role)}
            stray = [role for role in ranges if not recipe.has(role)]
            if stray:
                raise ConfigError(
                    f"placement.{stray[0]}",
                    f"the {recipe.name} recipe has no role {stray[0]!r} (its roles: "
                    f"{', '.join(r.name for r in recipe.roles)}).",
                    "Give GPU ranges to those roles only.",
                )
            return PlacementSpec.from_ranges(
                ranges, tp={recipe.engine_role: engine.tensor_parallel_size}, gpus_per_node=placement.gpus_per_node
            ).plan()
        roles = counted_roles(placement, recipe, engine.num_engines, engine.tensor_parallel_size)
        return PlacementSpec.from_counts(roles, gpus_per_node=placement.gpus_per_node).plan()


#: The roles OpenRLHF's count flags place (``<prefix>_num_nodes`` x ``<prefix>_num_gpus_per_node``), in its
#: launcher's order (each block of GPUs after the previous ones; the engines' block follows the actor's).
COUNT_PREFIXES = {"actor": "actor", "critic": "critic", "reference": "ref", "reward": "reward"}
#: How the placement's errors call a role, where not by its name.
_LABELS = {"reference": "reference model", "reward": "reward model"}


def counted_roles(
    placement: PlacementSettings, recipe: Recipe, num_engines: int, tensor_parallel_size: int
) -> list[CountedRole]:
    """OpenRLHF's count flags, as its launcher reads them, for the roles ``recipe`` has (a role it has not gets no
    GPUs). ``num_engines`` / ``tensor_parallel_size``: the engine section's counts -- 0 engines puts one engine
    on each actor GPU (OpenRLHF: generate with the actor).

    ``colocate_all``: every role on the actor's GPUs (a role with fewer GPUs takes the first ones), the engines
    filling them exactly; ``colocate_actor_ref``: the reference on the actor's; ``colocate_critic_reward``: the
    reward model on the critic's; every other role gets its own block, in the order actor, engines, critic,
    reference, reward. A distillation teacher (no OpenRLHF counterpart) sits on the actor's GPUs, as many as the
    actor's (``--placement teacher=...`` places it elsewhere)."""
    unknown = [r.name for r in recipe.workers if r.name not in (*COUNT_PREFIXES, "teacher")]
    if unknown:
        raise ConfigError(
            "placement.ranges",
            f"the {recipe.name} recipe's role {unknown[0]!r} has no count settings (they place "
            f"{', '.join(COUNT_PREFIXES)} and the engines).",
            "Give every role a GPU range with placement.ranges.",
        )

    def counted(role: str, on: str | None = None, on_field: str = "", required: bool = False) -> CountedRole:
        prefix = COUNT_PREFIXES[role]
        nodes, per_node = placement.count(prefix)
        return CountedRole(
            role,
            (nodes, per_node if recipe.has(role) else 0),
            (f"placement.{prefix}_num_nodes", f"placement.{prefix}_num_gpus_per_node"),
            on=on,
            on_field=on_field,
            required=required,
            label=_LABELS.get(role, ""),
        )

    every = "placement.colocate_all" if placement.colocate_all else ""
    on_actor = "actor" if every else None
    engine_fields = ("engine.num_engines", "engine.tensor_parallel_size")
    engines_on: str | None
    if num_engines == 0:  # one engine of one GPU on each actor GPU
        count, engines_on, engines_field = (placement.world_size("actor"), 1), "actor", every or "engine.num_engines"
    else:
        count, engines_on, engines_field = (num_engines, tensor_parallel_size), on_actor, every
    roles = [
        counted("actor", required=True),
        CountedRole(recipe.engine_role, count, engine_fields, engines=True, on=engines_on, on_field=engines_field),
        counted("critic", on_actor, every),
    ]
    if every or not placement.colocate_actor_ref:
        roles.append(counted("reference", on_actor, every))
    else:
        roles.append(counted("reference", "actor", "placement.colocate_actor_ref", required=True))
    if every or not placement.colocate_critic_reward:
        roles.append(counted("reward", on_actor, every))
    else:
        roles.append(counted("reward", "critic", "placement.colocate_critic_reward", required=True))
    if recipe.has("teacher"):
        teacher = counted("actor", "actor", "models.teacher_pretrain", required=True)
        roles.append(dataclasses.replace(teacher, name="teacher", label="teacher model"))
    return roles


def _role_used(recipe: Recipe, role: str) -> bool:
    """A --placement range is kept unless it names a built-in role this run's recipe dropped (any other name goes on
    to the placement's own checks)."""
    builtin = {r.name for base in RECIPES.values() for r in base.roles}
    return recipe.has(role) or role not in builtin


# ---- residency ------------------------------------------------------------------------------------------------------
def gpu_memory(cfg: RLConfig) -> tuple[float, str]:
    """:func:`gpu_budget` of a flat config."""
    return gpu_budget(cfg.residency_settings())


def gpu_budget(residency: ResidencySettings) -> tuple[float, str]:
    """Bytes per GPU the plan budgets, and where the number comes from."""
    given = residency.gpu_memory_gb
    if given is not None:
        return given * GiB, flag_text("residency.gpu_memory_gb")
    try:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            return float(props.total_memory), f"the local GPU ({props.name})"
    except Exception:  # no driver, broken install: the default is a budget, not a measurement
        pass
    return DEFAULT_GPU_GIB * GiB, flag_text(
        f"no local GPU: {DEFAULT_GPU_GIB:g} GiB assumed (set residency.gpu_memory_gb)"
    )


def host_memory(cfg: RLConfig, gpus_per_node: int | None = None) -> HostBudget:
    """:func:`host_budget` of a flat config."""
    return host_budget(cfg.residency_settings(), gpus_per_node)


def host_budget(residency: ResidencySettings, gpus_per_node: int | None = None) -> HostBudget:
    """The host memory each node may fill: --host_memory_gb, else what this machine has available now (Linux
    MemAvailable; unknown elsewhere, and then the plan says it did not check)."""
    given = residency.host_memory_gb
    if given is not None:
        return HostBudget(given * GiB, flag_text("residency.host_memory_gb"), gpus_per_node)
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
    """:func:`plan_run_residency` of a flat config: the plan, and the config with the planner's changes in.
    ``recipe`` default: the config's, :func:`~.recipes.recipe_for`."""
    recipe = recipe or recipe_for(cfg)
    settings = cfg.settings()
    folders = recipe.model_folders(cfg, model_path if model_path is not None else cfg.pretrain)
    plan, changed = plan_run_residency(
        settings,
        placement,
        folders,
        prompt_len=prompt_len,
        generate_len=generate_len,
        gpu_bytes=gpu_bytes,
        host=host,
        recipe=recipe,
    )
    return plan, with_planner_changes(cfg, settings, changed)


def with_planner_changes(cfg: RLConfig, before: TrainSettings, after: TrainSettings) -> RLConfig:
    """``cfg`` with what :func:`plan_run_residency` changed (ZeRO demoted, CPU Adam) in flat names: the flat config
    a run records (its checkpoints' ``config``) is the one it runs."""
    changes = {
        flag_of(f"trainer.{name}") or name: getattr(after.trainer, name)
        for name in ("zero_stage", "adam_offload")
        if getattr(after.trainer, name) != getattr(before.trainer, name)
    }
    return cfg.replace(**changes) if changes else cfg


def plan_run_residency(
    settings: TrainSettings,
    placement: PlacementPlan,
    folders: dict[str, str | None],
    *,
    prompt_len: int,
    generate_len: int,
    recipe: Recipe,
    gpu_bytes: float | None = None,
    host: HostBudget | None = None,
) -> tuple[ResidencyPlan, TrainSettings]:
    """The residency plan for this run, and the settings the roles are built with (the planner may keep an optimizer
    in host memory: then ``trainer.adam_offload`` is on). ``folders``: the model folder of each role
    (:meth:`~.recipe.Recipe.model_folders`). ``prompt_len`` + ``generate_len``: the longest sequence. ``host``:
    each node's host memory (default: :func:`host_budget`); ``plan.check()`` refuses a plan that overfills it.
    ``recipe``: the run's roles and phases. Its errors name the flags."""
    with flag_words():
        return _build_residency(settings, placement, folders, prompt_len, generate_len, gpu_bytes, host, recipe)


def _build_residency(settings, placement, folders, prompt_len, generate_len, gpu_bytes, host, recipe):
    if gpu_bytes is None:
        gpu_bytes, _ = gpu_budget(settings.residency)
    if host is None:
        host = host_budget(settings.residency, placement.gpus_per_node)
    shapes = role_models(settings.models, list(placement.roles), folders, recipe, trainer=settings.trainer)
    notes = []
    # the roles ZeRO-3 shards: the trainers, and the frozen models too (as OpenRLHF's inference engines do)
    sharded = [placement.roles[r.name] for r in recipe.workers if r.name in placement.roles]
    plan = None
    trainer = settings.trainer
    # DeepSpeed's choices (FSDP2 has no ZeRO stages to demote and no CPU Adam)
    deepspeed = trainer.backend == "deepspeed"
    if deepspeed and trainer.zero_stage == 3 and all(t.world_size == 1 for t in sharded):
        # ZeRO-3 splits states across ranks; with one rank there is nothing to split, the same bytes stay on the GPU,
        # and every layer is still gathered and released around each use (measured: train 0.96 s vs 0.27 s at 357M).
        demoted = settings.with_changes(trainer={"zero_stage": 1})
        plan = _plan(demoted, placement, shapes, gpu_bytes, prompt_len, generate_len, host, recipe)
        kept = None
        if _cpu_adam(plan) and not trainer.adam_offload:
            # ZeRO-1's optimizer step flattens all the gradients into a second copy at once, ZeRO-3's one sub-group
            # at a time: where that keeps the optimizer on the GPU, ZeRO-3's gathers cost less than CPU Adam's steps
            kept = _plan(settings, placement, shapes, gpu_bytes, prompt_len, generate_len, host, recipe)
            kept = kept if kept.fits() and not _cpu_adam(kept) else None
        if kept is None:
            settings = demoted
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
        plan = _plan(settings, placement, shapes, gpu_bytes, prompt_len, generate_len, host, recipe)
    if settings.trainer.bf16_master_weights:
        notes.append(bf16_update_note(settings))
    if deepspeed and _cpu_adam(plan) and not settings.trainer.adam_offload:
        # DeepSpeed's CPU Adam: the optimizer state never enters the GPU
        settings = settings.with_changes(trainer={"adam_offload": True})
        notes += plan.notes
        plan = _plan(settings, placement, shapes, gpu_bytes, prompt_len, generate_len, host, recipe)
    plan.notes[:0] = notes
    return plan, settings


def bf16_update_note(settings: TrainSettings) -> str:
    """What bf16 master weights cost in precision, with this run's learning rate."""
    trainer = settings.trainer
    rates = [trainer.actor_lr] + ([trainer.critic_lr] if settings.algorithm.uses_critic else [])
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


def _plan(settings, placement, shapes, gpu_bytes, prompt_len, generate_len, host, recipe: Recipe) -> ResidencyPlan:
    phases = recipe.residency_phases()
    layout = build_layout(
        placement, shapes, workload(settings, prompt_len, generate_len), gpu_bytes, kinds=recipe.kinds, phases=phases
    )
    return replan(settings, layout, gpu_bytes, host=host, phases=phases)


def replan(
    settings: TrainSettings, layout, gpu_bytes: float, overhead=None, host: HostBudget | None = None, *, phases
) -> ResidencyPlan:
    """The plan for a sized layout under this run's residency settings (``overhead``: bytes measured per GPU
    beyond the model, by a run's first step; ``host``: each node's host memory, shown and checked by the plan;
    ``phases``: the step's -- a refinement passes the plan's own). Its errors name the flags."""
    residency, engine = settings.residency, settings.engine
    kinds = {s.role: s.size.kind for shares in layout.values() for s in shares}  # the roles present, by kind
    asks = sleep_asks(residency, engine, kinds)
    pins = {**asks.pins, **residency.state_pins()}  # the user's own pins win over what the switches imply
    shared = {s.role for shares in layout.values() if len(shares) > 1 for s in shares}
    with flag_words():
        sleeping = sleeping_roles(asks, set(kinds), shared)

    def plan(pins):
        return plan_residency(
            layout,
            gpu_bytes,
            phases=phases,
            mode=residency.mode,
            pins=pins,
            sleep_roles=sleeping,
            engine_sleep_level=engine.sleep_level or 1,
            usable=residency.gpu_memory_usable,
            allow_host=settings.trainer.backend == "deepspeed" and settings.trainer.zero_stage >= 1,  # CPU Adam
            overhead=overhead,
            sleep_fields=asks.fields,
            host=host,
        )

    # --async_train on shared GPUs: first the plan that keeps the engines next to the trainer in every phase (they
    # then generate while it trains); where that does not fit, the usual plan (synchronous turns: async_rollout.py)
    from .async_rollout import async_pins

    with flag_words():
        together = async_pins(settings.rollout, residency, shared, sleeping)
        if together is not None:
            concurrent = plan({**pins, **together})
            if concurrent.fits():
                return concurrent
        return plan(pins)


def sleep_asks(residency: ResidencySettings, engine: EngineSettings, kinds: dict[str, str]) -> SleepAsks:
    """What the sleep switches (the trainers' and frozen models' in the residency section, the engines' in the
    engine section) ask of the roles ``kinds`` names."""
    return residency.sleep_asks(kinds, engine_sleep=engine.sleep, engine_sleep_level=engine.sleep_level)


def sleeping_roles(asks: SleepAsks, present: set[str], shared: set[str]) -> set[str]:
    """The roles the sleep switches ask to sleep. A switch for several roles (the trainers': actor and critic)
    applies to those of them that share a GPU; one that none of them shares is an error naming the switch."""
    asked_roles = asks.roles & present
    out: set[str] = set()
    for setting in dict.fromkeys(asks.fields.values()):
        asked = {r for r in asked_roles if asks.fields.get(r) == setting}
        out |= (asked & shared) or asked
    check_sleepers(out, shared, asks.fields)
    return out


def check_sleep_flags(
    residency: ResidencySettings, engine: EngineSettings, placement: PlacementPlan, recipe: Recipe
) -> None:
    """The sleep flags against the placement alone (before any model is sized): cheap, so it runs first.
    ``recipe``: the run's, for the kinds of its roles."""
    kinds = {role: kind for role, kind in recipe.kinds.items() if role in placement.roles}
    shared = {r for r in placement.roles if placement.shared_gpus(r)}
    with flag_words():
        sleeping_roles(sleep_asks(residency, engine, kinds), set(kinds), shared)


def workload(settings: TrainSettings, prompt_len: int, generate_len: int) -> Workload:
    from hybrid_engines.registry import engine_spec

    from .models import LOGITS_CHUNK_BYTES

    trainer, rollout, engine = settings.trainer, settings.rollout, settings.engine
    # an update of some trainer spans several micro-batches (ZeRO-2's CPU Adam then buffers gradients in host memory)
    critic = [settings.critic_world_size] if settings.algorithm.uses_critic else []
    ranks = min([settings.actor_world_size, *critic])
    accumulates = trainer.dynamic_batch or rollout.train_batch_size > rollout.micro_train_batch_size * ranks
    return Workload(
        bf16=trainer.bf16,
        trainer_backend=trainer.backend,
        zero_stage=trainer.zero_stage,
        adam_offload=trainer.adam_offload,
        bf16_master_weights=trainer.bf16_master_weights,
        bf16_optimizer_states=trainer.bf16_optimizer_states,
        gradient_accumulation=accumulates,
        gradient_checkpointing=trainer.gradient_checkpointing,
        micro_train_batch_size=rollout.micro_train_batch_size,
        micro_rollout_batch_size=rollout.micro_rollout_batch_size,
        prompt_len=prompt_len,
        generate_len=generate_len,
        rollout_samples=rollout.samples_per_step,
        engine_pool=bool(getattr(engine_spec(engine.backend), "MEMORY_POOL", False)),
        engine_memory_fraction=engine.gpu_memory_utilization,
        sync_bucket_bytes=settings.sync.bucket_mb << 20,
        context_bytes=settings.residency.gpu_context_gb * GiB,
        logits_chunk_bytes=LOGITS_CHUNK_BYTES,
    )


def hf_config(path: str | None, models: ModelSettings) -> Any:
    """The transformers config of a model folder (config.json only, no weights), or the tiny demo model's."""
    if path is None:
        from .tiny import tiny_model_config

        return tiny_model_config(**models.tiny_model)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, trust_remote_code=models.trust_remote_code)


def role_models(
    models: ModelSettings,
    roles: list[str],
    folders: dict[str, str | None],
    recipe: Recipe,
    *,
    trainer: TrainerSettings | None = None,
) -> dict[str, ModelShape]:
    """The model shape of each role: of the folder ``folders`` names for it (:meth:`~.recipe.Recipe.model_folders`),
    with a value head where its recipe entry says so (critic, reward model); under LoRA (``trainer``) the actor
    trains its adapters' parameters only, and the critic its adapters' and its value head's."""
    out: dict[str, ModelShape] = {}
    for role in roles:
        spec = recipe.role(role)
        config = hf_config(folders[role], models)
        shape = model_shape(config, value_head=spec.value_head, trust_remote_code=models.trust_remote_code)
        if role in ("actor", "critic") and trainer is not None and trainer.lora:  # one --lora_rank for both
            from .lora import adapter_param_count

            adapters = adapter_param_count(
                config, trainer, value_head=role == "critic", trust_remote_code=models.trust_remote_code
            )
            shape = dataclasses.replace(shape, trainable_params=adapters)
        out[role] = shape
    return out
