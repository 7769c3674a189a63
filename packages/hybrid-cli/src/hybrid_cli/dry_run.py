"""``--dry-run``: everything a run checks before it starts, and what it would put on each GPU -- without Ray or a GPU.

Prints the placement plan (GPU x roles), the prompt set (records read, dropped), and the residency plan: per phase
and per group of identical GPUs, what each role keeps resident and the predicted peak against the GPU's capacity
(the planner and memory model of :mod:`hybrid_core.residency`, called exactly as the run calls them), and what it
keeps in each node's host memory against what the node has. A plan that does not fit fails with the GPU, the phase
and the numbers, or with the node and its host memory (exit status 2). The nodes' host memory is ``--host_memory_gb``,
else this machine's only where it could be one of the run's nodes (:func:`host_budget`): a dry-run on a laptop says
what the plan needs per node and does not refuse it for the laptop's memory.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any

from rich.console import Console

from hybrid_core.errors import ConfigError, PlacementError
from hybrid_core.residency import GiB, HostBudget


def dry_run(
    config: Any,
    *,
    gpu_memory_gb: float | None = None,
    host_memory_gb: float | None = None,
    notes: Sequence[str] = (),
    console: Console | None = None,
) -> int:
    """Validate ``config`` (already ``validate()``-d) all the way, print both plans; 0 when it fits."""
    from rich.markup import escape

    from hybrid_algos.train.data import step_count
    from hybrid_algos.train.model_files import check_model_folder, check_reward_head
    from hybrid_algos.train.placement import build_residency, gpu_memory
    from hybrid_algos.train.prepare import rollout_lengths
    from hybrid_algos.train.sections import flag_text, flag_words

    console = console or Console(width=None if _is_terminal() else 132, highlight=False)
    for note in notes:  # yellow: a note says what was chosen for the user (defaults taken, flags translated)
        console.print("[yellow]note:[/yellow] " + escape(note))
    for name in ("pretrain", "reward_pretrain", "critic_pretrain", "teacher_pretrain"):  # named, not a traceback
        if getattr(config, name) is not None:
            check_model_folder(name, getattr(config, name), trust_remote_code=config.trust_remote_code)
    if config.reward_pretrain is not None:  # a folder without a reward head: refused, or --reward_random_head's note
        head = check_reward_head(
            config.reward_pretrain, random_head=config.reward_random_head, trust_remote_code=config.trust_remote_code
        )
        if head:
            console.print("[yellow]note:[/yellow] " + escape(head))
    plan = build_plan(config)
    console.print(
        f"[bold]{config.algorithm}[/bold]: {plan.num_gpus} GPU(s), backend {config.backend}, "
        f"advantage estimator {config.advantage_estimator}"
    )
    clip = config.clip_note()  # a policy loss's own clip range (GSPO's, CISPO's)
    if clip:
        console.print("note: " + clip, markup=False)
    console.print(plan.render(), markup=False)
    console.print(f"weight sync: {describe_sync(config, plan)} (actor -> engines after each update)", markup=False)
    console.print(_rendezvous_line(plan), markup=False)  # where the groups' stores and sockets listen
    unused = sync_backend_note(config, plan)
    if unused:
        console.print("[yellow]note:[/yellow] " + escape(unused))
    missing = library_missing(config.backend)
    if missing:
        console.print(
            f"warning: {missing}; the run will stop before it starts unless it is installed.", markup=False
        )  # as markup, the extra ('hybrid-engines[vllm]') would vanish
    prompts = load_prompts(config, console)
    steps = step_count(config.rollout_settings(), len(prompts))
    console.print(steps.describe(), markup=False)  # the loop's own count
    eval_prompts = load_eval_prompts(config, steps.total, console)
    console.print(describe_reward(config), markup=False)  # a path or URL may hold [...]
    if config.teacher_pretrain is not None:  # the run's own check: the teacher must read the policy's token ids
        from hybrid_algos.train.model_files import check_same_tokenizer

        check_same_tokenizer(
            "teacher_pretrain", config.teacher_pretrain, _tokenizer(config), trust_remote_code=config.trust_remote_code
        )
        console.print(
            f"distillation: teacher {config.teacher_pretrain}; each token's advantage = {config.distill_task_coef:g} "
            f"x the task's - {config.distill_coef:g} x (log p_student - log p_teacher)",
            markup=False,
        )
    if config.use_wandb and importlib.util.find_spec("wandb") is None:
        console.print(
            "warning: --use_wandb, but wandb is not installed here; the run will stop before it starts "
            "unless it is (pip install wandb)."
        )
    if config.lora_rank:  # how many parameters train (the memory model counts their gradients and moments alone)
        console.print(lora_line(config), markup=False)
        console.print(lora_sync_line(config), markup=False)  # adapter-only syncs, or merged, and why
    if gpu_memory_gb is not None and gpu_memory_gb <= 0:
        raise PlacementError("gpu_memory_gb", f"must be > 0, got {gpu_memory_gb}.")
    if gpu_memory_gb is not None:
        config = config.replace(gpu_memory_gb=gpu_memory_gb)
    if host_memory_gb is not None:
        config = config.replace(host_memory_gb=host_memory_gb).validate()  # the config's own check names the flag
    gpu_bytes, source = gpu_memory(config)
    prompt_len, generate_len = rollout_lengths(
        config.rollout_settings(), config.models_settings(), [*prompts, *eval_prompts]
    )
    residency, run_config = build_residency(
        config,
        plan,
        config.pretrain,
        prompt_len=prompt_len,
        generate_len=generate_len,
        gpu_bytes=gpu_bytes,
        host=host_budget(config, plan),
    )
    host = residency.host  # --host_memory_gb, else this machine's available memory where it is one of the nodes
    assert host is not None  # host_budget always gives one, and the plan keeps it
    console.print(
        f"GPU memory: {gpu_bytes / GiB:.1f} GiB per GPU ({source}); sequences up to {prompt_len} + "
        f"{generate_len} tokens"
    )
    console.print(
        "host memory: "
        + (
            f"{host.bytes / GiB:.1f} GiB per node ({host.source})"
            if host.bytes is not None
            else f"not checked ({host.source}; set --host_memory_gb)"
        ),
        markup=False,
    )
    console.print(flag_text(residency.render()), markup=False)  # core names its settings, the user reads flags
    if run_config.adam_offload and not config.adam_offload:
        console.print("note: the optimizer state stays in host memory (DeepSpeed CPU Adam), as if --adam_offload")
    if config.async_train:  # the loop's own decision: split, shared GPUs, or synchronous turns where they do not fit
        from hybrid_algos.train.async_rollout import async_mode

        console.print(f"note: {async_mode(run_config.rollout_settings(), plan, residency)[1]}", markup=False)
    with flag_words():
        residency.check()
    gpu, phase, total = residency.worst()
    console.print(
        f"fits: the fullest GPU is GPU {gpu} in phase {phase}: {total / GiB:.1f} of "
        f"{residency.capacity / GiB:.1f} GiB usable. Dry run only: no Ray started, no GPU taken."
    )
    return 0


def host_budget(config: Any, plan: Any) -> HostBudget:
    """The host memory the plan is checked against: ``--host_memory_gb`` (the run's own), else this machine's only if
    it has the GPUs one of the run's nodes uses or the run is a local one (a local Ray declaring ``--num_gpus``)."""
    from hybrid_algos.train.placement import host_memory
    from hybrid_core.residency.host import planning_budget

    if config.residency_settings().host_memory_gb is not None:
        return host_memory(config, plan.gpus_per_node)
    node_gpus = min(plan.gpus_per_node or plan.num_gpus, plan.num_gpus)
    runs_here = config.num_gpus is not None and not config.address
    return planning_budget(plan.gpus_per_node, node_gpus, _local_gpus(), runs_here=runs_here)


def _local_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # no driver, broken install: no GPU to count
        return 0


def build_plan(config: Any):
    """The placement plan the run would use (the training loop's own function, so the two cannot disagree)."""
    from hybrid_algos.train.placement import build_plan as plan_for_config

    return plan_for_config(config)


def describe_sync(config: Any, plan: Any) -> str:
    """The sync path and the engine's wire format (the loop's own chooser: a path it cannot run raises here, in the
    flags' words)."""
    from hybrid_algos.train.sections import flag_words
    from hybrid_engines.weight_sync import describe_sync as describe

    with flag_words():
        return describe(config.sync_settings(), config.backend, plan)


def sync_backend_note(config: Any, plan: Any) -> str | None:
    """An explicit --vllm_sync_backend the chosen path does not use, and why (the note the run starts with)."""
    from hybrid_algos.train.sections import flag_words
    from hybrid_engines.weight_sync import choose_sync
    from hybrid_engines.weight_sync import sync_backend_note as note

    sync = config.sync_settings()
    with flag_words():
        return note(sync, choose_sync(sync, config.backend, plan).mode)


def _rendezvous_line(plan: Any) -> str:
    from hybrid_core.rendezvous import for_plan

    return for_plan(plan).describe()


def library_missing(backend: str) -> str | None:
    from hybrid_engines.registry import library_missing as missing

    return missing(backend)


def load_prompts(config: Any, console: Console | None = None) -> list:
    """Load and encode the prompts exactly as the run would (printing how many there are)."""
    from hybrid_algos.train.data import load_prompt_set
    from hybrid_algos.train.tasks import task_from_config

    task = task_from_config(config.models_settings()) if config.prompt_data is None else None
    tokenizer, vision = _tokenizer(config), None
    if config.max_images_per_prompt > 0 and config.pretrain:  # the images through the model's processor, as a run
        from hybrid_algos.train.vision import load_vision_processor

        vision = load_vision_processor(config.pretrain, tokenizer, trust_remote_code=config.trust_remote_code)
    prompts, stats = load_prompt_set(config.rollout_settings(), tokenizer, task, vision=vision)
    if len(prompts) < config.rollout_batch_size:
        raise ConfigError(
            "rollout_batch_size",
            f"{stats.describe()}: fewer than one rollout batch (rollout_batch_size = {config.rollout_batch_size}).",
            "Lower --rollout_batch_size or give more prompts.",
        )
    (console or Console(highlight=False)).print(f"prompts: {stats.describe()}", markup=False)
    return prompts


def load_eval_prompts(config: Any, total_steps: int, console: Console) -> list:
    """The evaluation's held-out prompts, loaded as the run loads them, and the line saying how and when they are
    evaluated (none without --eval_dataset)."""
    from hybrid_algos.train import evaluation
    from hybrid_algos.train.sections import flag_text

    settings = config.evaluation_settings()
    if not settings.enabled:
        return []
    prompts, stats = evaluation.load_eval_prompts(config.rollout_settings(), settings, _tokenizer(config))
    line = evaluation.describe(
        settings, stats.describe(), total_steps=total_steps, samples_per_step=config.samples_per_step
    )
    console.print(flag_text(line), markup=False)
    return prompts


def describe_reward(config: Any) -> str:
    """Where rewards come from; a run with its own prompts needs a reward model or a reward function."""
    if getattr(config, "uses_agent", False):  # multi-turn: the environment rewards (its file is imported now)
        from hybrid_algos.train.agents import builtin_agent, load_agent

        models = config.models_settings()
        spec = load_agent(config.agent_func_path) if config.agent_func_path else builtin_agent(models)
        what = "OpenRLHF AgentExecutor" if spec.kind == "openrlhf" else "environment"
        return (
            f"reward: the environment's ({what} of {spec.source}; multi-turn, up to "
            f"{config.rollout_settings().agent_settings(spec.builtin).max_turns} turns)"
        )
    if config.reward_fn is not None:
        from hybrid_algos.train.remote_rewards import HttpReward, RewardFile
        from hybrid_algos.train.rewards import load_reward_fn

        fn = load_reward_fn(config.reward_fn)  # imports the user's module now: a typo fails here, not after Ray starts
        if isinstance(fn, HttpReward):
            return (
                f"reward: HTTP reward server{'s' if len(fn.urls) > 1 else ''} {', '.join(fn.urls)} (OpenRLHF's "
                f"protocol; {fn.timeout_s:g} s timeout, {fn.tries} tries; not contacted by --dry-run)"
            )
        if isinstance(fn, RewardFile):
            return f"reward: reward_func(queries, prompts, labels) in {fn.path} (OpenRLHF's shape)"
        return f"reward: function {config.reward_fn}"
    if config.reward_pretrain is not None:
        return f"reward: model {config.reward_pretrain}"
    if config.prompt_data is not None:
        raise ConfigError(
            "reward_pretrain",
            "no reward: a --prompt_data run needs --reward_pretrain or --reward_fn.",
            "Add --reward_fn my_module:my_reward (rule-based) or --reward_pretrain DIR.",
        )
    return f"reward: the built-in task {config.task!r}'s rule"


def lora_sync_line(config: Any) -> str:
    """What the run's syncs send under LoRA (the adapter alone, or merged full weights) and why: the run's own line."""
    from hybrid_algos.train.lora import sync_choice
    from hybrid_algos.train.sections import flag_text, flag_words

    with flag_words():
        return flag_text(sync_choice(config.settings()).line)


def lora_line(config: Any) -> str:
    from hybrid_algos.train.lora import adapter_param_count, critic_count, describe
    from hybrid_algos.train.placement import hf_config
    from hybrid_algos.train.recipes import recipe_for
    from hybrid_core.residency.memory import count_params

    models, trainer = config.models_settings(), config.trainer_settings()
    hf = hf_config(config.pretrain, models)
    total = count_params(hf, trust_remote_code=config.trust_remote_code)
    adapters = adapter_param_count(hf, trainer, trust_remote_code=config.trust_remote_code)
    recipe, critic = recipe_for(config), None
    if recipe.has("critic"):  # PPO's critic: adapted too, on its own folder
        critic_hf = hf_config(recipe.role("critic").model_folder(config, config.pretrain), models)
        critic = critic_count(critic_hf, trainer, trust_remote_code=config.trust_remote_code)
    return describe(trainer, adapters, total, reference=config.uses_reference, critic=critic)


def _is_terminal() -> bool:
    return Console().is_terminal


def _tokenizer(config: Any):
    if config.pretrain is None:
        from hybrid_algos.train.tiny import build_tiny_tokenizer

        return build_tiny_tokenizer(int(config.tiny_model.get("num_symbols", 8)))
    from hybrid_algos.train.model_files import load_tokenizer

    # the run's own loader: a folder without (readable) tokenizer files is a ConfigError here too, not a traceback
    return load_tokenizer("pretrain", config.pretrain, trust_remote_code=config.trust_remote_code)
