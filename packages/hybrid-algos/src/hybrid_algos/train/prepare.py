"""``prepare(config)``: everything a run resolves before Ray or a GPU is touched — the settings checked, the placement
and residency plans, the model folder, tokenizer, prompts, reward, the step count, the checkpoint to continue — so
that a mistake costs nothing. :mod:`.loop` starts the run from the :class:`Prepared` it returns.

The flat config ends here: it is validated and turned into sections once (``Prepared.settings``,
:class:`~.train_settings.TrainSettings`), and the parts that are defined in flat names are resolved from it here —
the recipe's optional roles and model folders, the resume check against a checkpoint's saved config, the record a
checkpoint saves. Everything after reads the sections.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hybrid_engines.weight_sync import choose_sync

from .checkpoint import CheckpointManager
from .config import RLConfig
from .model_settings import ModelSettings
from .placement import check_sleep_flags, plan_placement, plan_run_residency, with_planner_changes
from .rollout_settings import RolloutSettings
from .train_settings import TrainSettings

log = logging.getLogger(__name__)


@dataclass
class Prepared:
    """What ``prepare`` resolves before any Ray or GPU work: model folder, tokenizer, prompts, step count."""

    settings: TrainSettings  # the run's settings in sections, the planner's changes in: what everything after reads
    plan: Any
    model_path: str
    tokenizer: Any
    prompts: list
    reward_fn: Any
    max_new_tokens: int
    total_steps: int
    run_dir: str
    max_model_len: int = 0  # the longest sequence a rollout can make: the engine's context size
    sync: Any = None  # hybrid_engines.weight_sync.SyncChoice: the weight-sync path, transport and group backend
    residency: Any = None  # hybrid_core.residency.ResidencyPlan: what each role keeps on its GPUs in each phase
    resume_from: Any = None  # resume.ResumePoint: the checkpoint this run continues, or None (a fresh start)
    agent: Any = None  # agents.AgentSpec: the environment of a multi-turn run (loaded here, before Ray)
    async_mode: str = "off"  # async_rollout.async_mode: off | split | shared | sync (--async_train fell back)
    async_note: str = ""
    locks: Any = None  # run_lock.RunLocks: the run folder (and checkpoint folder) are this run's until it ends
    start_lines: tuple = ()  # said at the start (and by --dry-run): the step count and why, flags not used as given
    recipe: Any = None  # recipe.Recipe: the run's roles and the phases of its step (recipes.recipe_for the config's)
    model_folders: dict[str, str | None] = field(default_factory=dict)  # role -> its folder (Recipe.model_folders)
    # what a checkpoint records of the flat config ("config", "essentials": resume.check_compatible compares them)
    config_record: dict[str, Any] = field(default_factory=dict)
    config: RLConfig | None = None  # the flat config the run applies, for loop's on_start callbacks only
    eval_prompts: list = field(default_factory=list)  # the held-out prompts of --eval_dataset (evaluation.py)
    mps: Any = None  # hybrid_core.mps_daemon.MpsDecision: whether the run starts a CUDA MPS daemon of its own
    # hybrid_engines.weight_sync.adapter.AdapterChoice under LoRA: adapter-only or merged syncs (None: no LoRA)
    lora_sync: Any = None


def prepare(config: RLConfig, recipe: Any = None) -> Prepared:
    """Validate the config and resolve everything that does not need Ray: errors here cost nothing. The run folder's
    lock is taken here (:mod:`.run_lock`) and held by the returned ``Prepared.locks`` until released. ``recipe``: the
    run's roles and phases (:class:`~.recipe.Recipe`; default: the config's, :func:`~.recipes.recipe_for`)."""
    from .recipes import recipe_for
    from .run_lock import RunLocks

    locks = RunLocks()
    recipe = recipe.for_config(config) if recipe is not None else recipe_for(config)
    try:
        prep = _prepare(config, locks, recipe)
    except BaseException:
        locks.release()
        raise
    prep.locks = locks
    return prep


def _prepare(config: RLConfig, locks: Any, recipe: Any) -> Prepared:
    from hybrid_core.errors import ConfigError
    from hybrid_engines.registry import library_missing
    from hybrid_engines.weight_sync import sync_backend_note, verify_note

    from .data import load_prompts, step_count
    from .lora import sync_choice
    from .model_files import check_model_folder, check_reward_head, check_same_tokenizer, load_tokenizer
    from .resume import find_resume_point
    from .rewards import load_reward_fn
    from .run_folder import check_writable, refuse_or_clear
    from .sections import flag_text, flag_words
    from .tasks import SyntheticTask, task_from_config
    from .tiny import save_tiny_model

    config.validate()
    settings = config.settings()  # the one conversion: below here the run reads sections
    run, rollout, models, engine = settings.run, settings.rollout, settings.models, settings.engine
    plan = plan_placement(settings.placement, engine, recipe)
    # before any model is built: the flags against who shares a GPU
    check_sleep_flags(settings.residency, engine, plan, recipe)
    with flag_words():  # a weight-sync path the placement cannot take fails here, before Ray
        sync = choose_sync(settings.sync, engine.backend, plan)
        lora_sync = sync_choice(settings)  # under LoRA: the adapter alone, or merged full weights (and why)
    if run.num_gpus is not None and run.num_gpus < plan.num_gpus:
        raise ConfigError(
            "num_gpus",
            f"the placement needs {plan.num_gpus} GPUs but --num_gpus declares {run.num_gpus}.",
            f"Use --num_gpus {plan.num_gpus}, or place the roles on fewer GPUs.",
        )
    missing = library_missing(engine.backend)  # the engine registry knows each backend's package
    if missing:
        raise ConfigError("backend", f"--backend {engine.backend}: {missing}.", "Install it, or use --backend hf.")
    for name in ("pretrain", "reward_pretrain", "critic_pretrain", "teacher_pretrain"):
        if getattr(models, name) is not None:
            check_model_folder(name, getattr(models, name), trust_remote_code=models.trust_remote_code)
    notes = [sync_backend_note(settings.sync, sync.mode)]  # an explicit --vllm_sync_backend ipc ignores
    notes.append(verify_note(settings.sync, engine.backend))  # unverifiable syncs, or verification off
    clip = settings.algorithm.clip_note()  # a policy loss's own clip range (GSPO's, CISPO's), said at start
    notes.append(flag_text(clip) if clip else None)
    if models.reward_pretrain is not None:  # a folder without a reward head: refused, or --reward_random_head's note
        notes.append(
            check_reward_head(
                models.reward_pretrain,
                random_head=models.reward_random_head,
                trust_remote_code=models.trust_remote_code,
            )
        )
    start_lines = [f"note: {n}" for n in notes if n]
    reward_fn = load_reward_fn(models.reward_fn) if models.reward_fn is not None else None  # imports the user's file
    agent = _load_agent(settings) if settings.uses_agent else None  # imports the agent file
    # The folders next (writable, not holding another run): nothing is written before they are known to be fine.
    run_dir = check_writable("save_path", run.save_path)
    locks.take(run_dir, "save_path")  # before anything there is read or written: one run per folder
    ckpt = CheckpointManager(run.checkpoint_dir, run.max_ckpt_num)
    if run.saves_checkpoints:
        check_writable("ckpt_path" if run.ckpt_path else "save_path", ckpt.root)
        if not ckpt.root.startswith(run_dir + os.sep):  # elsewhere: a run in another folder may use it too
            locks.take(ckpt.root, "ckpt_path")
    resume_from = find_resume_point(run, ckpt, config)  # a checkpoint saved the flat config: compared with it
    refuse_or_clear(run_dir, ckpt, overwrite=run.overwrite, resuming=resume_from is not None)
    task = task_from_config(models) if rollout.prompt_data is None else None
    if models.pretrain is None:
        model_path = save_tiny_model(os.path.join(run_dir, "tiny-model"), seed=run.seed, **models.tiny_model)
    else:
        model_path = models.pretrain
    tokenizer = load_tokenizer("pretrain", model_path, trust_remote_code=models.trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if settings.trainer.lora:  # what trains, said at the start (a target the model lacks is refused here)
        from hybrid_core.residency.memory import count_params

        from .lora import adapter_param_count, critic_count
        from .lora import describe as describe_lora
        from .placement import hf_config

        hf = hf_config(model_path, models)
        adapters = adapter_param_count(hf, settings.trainer, trust_remote_code=models.trust_remote_code)
        critic = None
        if recipe.has("critic"):  # its own folder (--critic_pretrain, a reward model's, else the policy's)
            critic_hf = hf_config(recipe.role("critic").model_folder(config, model_path), models)
            critic = critic_count(critic_hf, settings.trainer, trust_remote_code=models.trust_remote_code)
        start_lines.append(
            describe_lora(
                settings.trainer,
                adapters,
                count_params(hf, trust_remote_code=models.trust_remote_code),
                reference=settings.algorithm.uses_reference,
                critic=critic,  # PPO's: adapted too
            )
        )
        start_lines.append(flag_text(lora_sync.line))
    if models.teacher_pretrain is not None:  # the teacher scores the policy's token ids: it must read them alike
        check_same_tokenizer(
            "teacher_pretrain", models.teacher_pretrain, tokenizer, trust_remote_code=models.trust_remote_code
        )
    # a file that is not UTF-8 is a ConfigError there (and in --dry-run)
    vision = None
    if rollout.images:  # vision-language prompts: the model's own processor (train/vision.py)
        from .vision import load_vision_processor

        vision = load_vision_processor(model_path, tokenizer, trust_remote_code=models.trust_remote_code)
    prompts = load_prompts(rollout, tokenizer, task, vision=vision)
    eval_prompts, eval_source = _load_eval(settings, tokenizer, recipe)  # before Ray: a bad file costs nothing
    if agent is not None:
        _note_agent(settings, agent, tokenizer)
    elif models.reward_fn is None:
        # None: the reward model scores (a lookup task has its environment: the branch above)
        reward_fn = task.reward_fn() if isinstance(task, SyntheticTask) else None
    if reward_fn is None and models.reward_pretrain is None and agent is None:  # an environment rewards its samples
        raise ConfigError(
            "reward_pretrain",
            "no reward: a --prompt_data run needs --reward_pretrain or --reward_fn.",
            "Add --reward_fn my_module:my_reward (rule-based) or --reward_pretrain DIR.",
        )
    longest_prompt, max_new_tokens = rollout_lengths(rollout, models, [*prompts, *eval_prompts])  # the engines' context
    steps_per_episode = len(prompts) // rollout.rollout_batch_size
    if steps_per_episode == 0:
        raise ConfigError(
            "rollout_batch_size",
            f"only {len(prompts)} prompts, fewer than one rollout batch ({rollout.rollout_batch_size}).",
            "Lower --rollout_batch_size or give more prompts.",
        )
    # Size the engine's context to what rollouts can reach, not to the flags' ceiling: a small model's position
    # table is often shorter than prompt_max_len + generate_max_len, and vLLM refuses a longer max_model_len.
    max_model_len = longest_prompt + max_new_tokens
    positions = max_positions(model_path)
    if positions is not None and max_model_len > positions:
        raise ConfigError(
            "generate_max_len",
            f"prompts of up to {longest_prompt} tokens plus {max_new_tokens} new "
            f"tokens need {max_model_len} positions; the model has {positions}.",
            "Lower --generate_max_len or --prompt_max_len (prompts longer than it are truncated).",
        )
    steps = step_count(rollout, len(prompts))  # the count and why: said at the start and by --dry-run
    total = steps.total
    start_lines.insert(0, steps.describe())
    if eval_prompts:
        from .evaluation import describe

        line = describe(settings.evaluation, eval_source, total_steps=total, samples_per_step=rollout.samples_per_step)
        start_lines.insert(1, flag_text(line))
    for line in start_lines:
        log.info("%s", line)
    if run.profile_step > total:
        raise ConfigError(
            "profile_step",
            f"step {run.profile_step} is past the run's last step ({total}).",
            f"Profile a step from 1 to {total} (the first ones include warm-up).",
        )
    # What stays on each GPU, from the memory budget; a plan that cannot fit fails here, before Ray starts.
    folders = recipe.model_folders(config, model_path)  # the recipe names its folders' settings in flat words
    planned = settings
    residency, settings = plan_run_residency(
        planned, plan, folders, prompt_len=longest_prompt, generate_len=max_new_tokens, recipe=recipe
    )
    config = with_planner_changes(config, planned, settings)  # the flat record says what runs
    with flag_words():  # core's error names the residency settings
        residency.check()
    from .async_rollout import async_mode
    from .resume import essentials

    mode, note = async_mode(settings.rollout, plan, residency)
    if mode == "sync":  # --async_train on GPUs too small for both: synchronous turns, said in the plan's notes
        residency.notes.append(note)
    mps = decide_mps(settings.run, mode)  # `--mps on` that cannot start is refused here, before Ray
    if mps.note:
        log.info("note: %s", mps.note)
        start_lines.append(f"note: {mps.note}")
    return Prepared(
        settings,
        plan,
        model_path,
        tokenizer,
        prompts,
        reward_fn,
        max_new_tokens,
        total,
        run_dir,
        max_model_len,
        sync,
        residency,
        resume_from,
        agent,
        mode,
        note,
        start_lines=tuple(start_lines),
        recipe=recipe,
        model_folders=folders,
        config_record={"config": config.to_dict(), "essentials": essentials(config)},
        config=config,
        eval_prompts=eval_prompts,
        mps=mps,
        lora_sync=lora_sync,
    )


def decide_mps(run: Any, async_mode: str, **probe: Any) -> Any:
    """The run's CUDA MPS decision (:func:`hybrid_core.mps_daemon.decide`) in the flags' words: ``--mps on`` where a
    daemon cannot start is a ConfigError naming ``--mps``; ``auto`` resolves to on or off, its note saying why."""
    from hybrid_core.mps_daemon import decide

    from .sections import flag_text, flag_words

    joined = run.address or os.environ.get("RAY_ADDRESS") or None
    with flag_words():
        decision = decide(
            run.mps, async_mode=async_mode, engine_share=run.mps_engine_share, joined_cluster=joined, **probe
        )
    return dataclasses.replace(decision, note=flag_text(decision.note)) if decision.note else decision


def _load_eval(settings: TrainSettings, tokenizer: Any, recipe: Any) -> tuple[list, str]:
    """The held-out prompts of the evaluation section and where they came from (none without a dataset); a recipe
    of your own without the evaluation's phase would never run them: refused."""
    from hybrid_core.errors import ConfigError

    if not settings.evaluation.enabled:
        return [], ""
    if not any(p.function == "eval" for p in recipe.phases):
        raise ConfigError(
            "eval_dataset",
            f"the recipe {recipe.name!r} has no phase that runs 'eval', so the held-out prompts would never be "
            "evaluated.",
            "Add hybrid_algos.train.recipes.EVAL as its last phase, or drop --eval_dataset.",
        )
    from .evaluation import load_eval_prompts

    prompts, stats = load_eval_prompts(settings.rollout, settings.evaluation, tokenizer)
    return prompts, stats.describe()


def _load_agent(settings: TrainSettings) -> Any:
    """The run's environment (its file is imported now, so a broken one fails before anything is written)."""
    from .agents import builtin_agent, load_agent

    path = settings.rollout.agent_func_path
    return load_agent(path) if path else builtin_agent(settings.models)


def _note_agent(settings: TrainSettings, agent: Any, tokenizer: Any) -> None:
    """Log lines about how the environment's run is set up (where its prompts come from, chat templates)."""
    rollout, models, engine = settings.rollout, settings.models, settings.engine
    if rollout.prompt_data is None and rollout.agent_func_path and models.task not in ("lookup",):
        log.info(
            "agent %s: the prompts are the built-in %r task's; the rewards are the environment's",
            agent.source,
            models.task,
        )
    if engine.backend == "vllm" and not engine.enable_prefix_caching:
        log.info(
            "agent %s: every turn sends the whole conversation again; --enable_prefix_caching lets vLLM reuse the "
            "earlier turns' KV cache (bench/agent_gpu.py measures the difference)",
            agent.source,
        )
    if (
        agent.kind == "environment"
        and not agent.builtin
        and getattr(tokenizer, "chat_template", None)
        and not rollout.apply_chat_template
    ):
        log.info(
            "agent %s: the tokenizer has a chat template, but --apply_chat_template is off: prompts and the "
            "environment's replies go in as plain text (add --apply_chat_template to render both with it)",
            agent.source,
        )


def rollout_lengths(rollout: RolloutSettings, models: ModelSettings, prompts: Sequence[Any]) -> tuple[int, int]:
    """(longest prompt, most new tokens) a rollout of this run can have: what engines and the memory budget size."""
    from .tasks import task_from_config

    task = task_from_config(models) if rollout.prompt_data is None else None
    # Built-in tasks have short answers: generating up to 1024 tokens would only waste time.
    max_new_tokens = min(rollout.generate_max_len, task.answer_len + 1) if task else rollout.generate_max_len
    if rollout.agent_func_path is not None:  # your environment: its turns and replies share generate_max_len
        max_new_tokens = rollout.generate_max_len
    elif task is not None and hasattr(task, "response_budget"):  # the built-in multi-turn task: all its turns fit
        settings = rollout.agent_settings(builtin=True)
        turn_tokens = settings.turn_tokens
        assert turn_tokens is not None  # a built-in task's turns: --max_new_tokens_per_turn, else its TURN_TOKENS
        max_new_tokens = min(rollout.generate_max_len, task.response_budget(settings.max_turns, turn_tokens))
    longest_prompt = min(rollout.prompt_max_len, max((len(p.prompt_ids) for p in prompts), default=1))
    return longest_prompt, max_new_tokens


def max_positions(model_path: str) -> int | None:
    """The model's position-table size from its config.json (None when it does not say)."""
    import json

    try:
        with open(os.path.join(model_path, "config.json")) as f:
            value = json.load(f).get("max_position_embeddings")
    except (OSError, ValueError):
        return None
    return int(value) if isinstance(value, (int, float)) else None
