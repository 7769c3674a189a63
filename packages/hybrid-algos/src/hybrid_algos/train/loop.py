"""``train(config)``: set up the roles on the placement plan, run the steps, checkpoint, save the final model.

The per-algorithm recipes (:mod:`.ppo`, :mod:`.grpo`, :mod:`.reinforce`) only choose a config; everything they
share is here and in :mod:`.step`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import random
import shutil
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hybrid_core.errors import HybridError
from hybrid_engines.weight_sync import choose_sync

from .checkpoint import CheckpointManager
from .config import RLConfig
from .placement import build_plan, build_residency, check_sleep_flags
from .profiling import profile_folder, profiled_step
from .step import StepContext, run_step
from .timeline import TimelineWriter

if TYPE_CHECKING:
    from hybrid_core.placement import PlacedPlan
    from hybrid_core.residency import ResidencyOwner
    from hybrid_engines.ray_engines import EngineGroup

    from .agents import AgentRollout
    from .async_loop import AsyncRunner
    from .failures import Preemption

log = logging.getLogger(__name__)


@dataclass
class Prepared:
    """What ``prepare`` resolves before any Ray or GPU work: model folder, tokenizer, prompts, step count."""

    config: RLConfig
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
    from .model_files import check_model_folder, check_reward_head, load_tokenizer
    from .resume import find_resume_point
    from .rewards import load_reward_fn
    from .run_folder import check_writable, refuse_or_clear
    from .tasks import SyntheticTask, task_from_config
    from .tiny import save_tiny_model

    config.validate()
    plan = build_plan(config, recipe)
    check_sleep_flags(config, plan)  # before any model is built: the flags against who shares a GPU
    sync = choose_sync(config, plan)  # a weight-sync path the placement cannot take fails here, before Ray
    if config.num_gpus is not None and config.num_gpus < plan.num_gpus:
        raise ConfigError(
            "num_gpus",
            f"the placement needs {plan.num_gpus} GPUs but --num_gpus declares {config.num_gpus}.",
            f"Use --num_gpus {plan.num_gpus}, or place the roles on fewer GPUs.",
        )
    missing = library_missing(config.backend)  # the engine registry knows each backend's package
    if missing:
        raise ConfigError("backend", f"--backend {config.backend}: {missing}.", "Install it, or use --backend hf.")
    for name in ("pretrain", "reward_pretrain", "critic_pretrain"):
        if getattr(config, name) is not None:
            check_model_folder(name, getattr(config, name), trust_remote_code=config.trust_remote_code)
    notes = [sync_backend_note(config, sync.mode)]  # an explicit --vllm_sync_backend the ipc path does not use
    notes.append(verify_note(config))  # a backend whose syncs cannot be verified, or verification turned off
    notes.append(config.clip_note())  # a policy loss's own clip range (GSPO's, CISPO's), said at start
    if config.reward_pretrain is not None:  # a folder without a reward head: refused, or --reward_random_head's note
        notes.append(
            check_reward_head(
                config.reward_pretrain,
                random_head=config.reward_random_head,
                trust_remote_code=config.trust_remote_code,
            )
        )
    start_lines = [f"note: {n}" for n in notes if n]
    reward_fn = load_reward_fn(config.reward_fn) if config.reward_fn is not None else None  # imports the user's file
    agent = _load_agent(config) if config.uses_agent else None  # imports the agent file
    # The folders next (writable, not holding another run): nothing is written before they are known to be fine.
    run_dir = check_writable("save_path", config.save_path)
    locks.take(run_dir, "save_path")  # before anything there is read or written: one run per folder
    ckpt = CheckpointManager(config.checkpoint_dir, config.max_ckpt_num)
    if config.save_steps > 0 or config.final_checkpoint or config.resume or config.resume_if_exists:
        check_writable("ckpt_path" if config.ckpt_path else "save_path", ckpt.root)
        if not ckpt.root.startswith(run_dir + os.sep):  # elsewhere: a run in another folder may use it too
            locks.take(ckpt.root, "ckpt_path")
    resume_from = find_resume_point(config, ckpt)
    refuse_or_clear(run_dir, ckpt, overwrite=config.overwrite, resuming=resume_from is not None)
    task = task_from_config(config) if config.prompt_data is None else None
    if config.pretrain is None:
        model_path = save_tiny_model(os.path.join(run_dir, "tiny-model"), seed=config.seed, **config.tiny_model)
    else:
        model_path = config.pretrain
    tokenizer = load_tokenizer("pretrain", model_path, trust_remote_code=config.trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    prompts = load_prompts(config, tokenizer)  # a file that is not UTF-8 is a ConfigError there (and in --dry-run)
    if agent is not None:
        _note_agent(config, agent, tokenizer)
    elif config.reward_fn is None:
        # None: the reward model scores (a lookup task has its environment: the branch above)
        reward_fn = task.reward_fn() if isinstance(task, SyntheticTask) else None
    if reward_fn is None and config.reward_pretrain is None and agent is None:  # an environment rewards its samples
        raise ConfigError(
            "reward_pretrain",
            "no reward: a --prompt_data run needs --reward_pretrain or --reward_fn.",
            "Add --reward_fn my_module:my_reward (rule-based) or --reward_pretrain DIR.",
        )
    longest_prompt, max_new_tokens = rollout_lengths(config, prompts)
    steps_per_episode = len(prompts) // config.rollout_batch_size
    if steps_per_episode == 0:
        raise ConfigError(
            "rollout_batch_size",
            f"only {len(prompts)} prompts, fewer than one rollout batch ({config.rollout_batch_size}).",
            "Lower --rollout_batch_size or give more prompts.",
        )
    # Size the engine's context to what rollouts can reach, not to the flags' ceiling: a small model's position
    # table is often shorter than prompt_max_len + generate_max_len, and vLLM refuses a longer max_model_len.
    max_model_len = longest_prompt + max_new_tokens
    positions = _max_positions(model_path)
    if positions is not None and max_model_len > positions:
        raise ConfigError(
            "generate_max_len",
            f"prompts of up to {longest_prompt} tokens plus {max_new_tokens} new "
            f"tokens need {max_model_len} positions; the model has {positions}.",
            "Lower --generate_max_len or --prompt_max_len (prompts longer than it are truncated).",
        )
    steps = step_count(config, len(prompts))  # the count and why: said at the start and by --dry-run
    total = steps.total
    start_lines.insert(0, steps.describe())
    for line in start_lines:
        log.info("%s", line)
    if config.profile_step > total:
        raise ConfigError(
            "profile_step",
            f"step {config.profile_step} is past the run's last step ({total}).",
            f"Profile a step from 1 to {total} (the first ones include warm-up).",
        )
    # What stays on each GPU, from the memory budget; a plan that cannot fit fails here, before Ray starts.
    residency, config = build_residency(
        config, plan, model_path, prompt_len=longest_prompt, generate_len=max_new_tokens, recipe=recipe
    )
    residency.check()
    from .async_rollout import async_mode

    mode, note = async_mode(config, plan, residency)
    if mode == "sync":  # --async_train on GPUs too small for both: synchronous turns, said in the plan's notes
        residency.notes.append(note)
    return Prepared(
        config,
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
    )


def _load_agent(config: RLConfig) -> Any:
    """The run's environment (its file is imported now, so a broken one fails before anything is written)."""
    from .agents import builtin_agent, load_agent

    return load_agent(config.agent_func_path) if config.agent_func_path else builtin_agent(config)


def _note_agent(config: RLConfig, agent: Any, tokenizer: Any) -> None:
    """Log lines about how the environment's run is set up (where its prompts come from, chat templates)."""
    if config.prompt_data is None and config.agent_func_path and config.task not in ("lookup",):
        log.info(
            "agent %s: the prompts are the built-in %r task's; the rewards are the environment's",
            agent.source,
            config.task,
        )
    if config.backend == "vllm" and not config.enable_prefix_caching:
        log.info(
            "agent %s: every turn sends the whole conversation again; --enable_prefix_caching lets vLLM reuse the "
            "earlier turns' KV cache (bench/agent_gpu.py measures the difference)",
            agent.source,
        )
    if (
        agent.kind == "environment"
        and not agent.builtin
        and getattr(tokenizer, "chat_template", None)
        and not config.apply_chat_template
    ):
        log.info(
            "agent %s: the tokenizer has a chat template, but --apply_chat_template is off: prompts and the "
            "environment's replies go in as plain text (add --apply_chat_template to render both with it)",
            agent.source,
        )


def rollout_lengths(config: RLConfig, prompts: Sequence[Any]) -> tuple[int, int]:
    """(longest prompt, most new tokens) a rollout of this run can have: what engines and the memory budget size."""
    from .tasks import task_from_config

    task = task_from_config(config) if config.prompt_data is None else None
    # Built-in tasks have short answers: generating up to 1024 tokens would only waste time.
    max_new_tokens = min(config.generate_max_len, task.answer_len + 1) if task else config.generate_max_len
    if config.agent_func_path is not None:  # your environment: its turns and replies share generate_max_len
        max_new_tokens = config.generate_max_len
    elif task is not None and hasattr(task, "response_budget"):  # the built-in multi-turn task: all its turns fit
        from .agents import AgentSettings

        settings = AgentSettings.from_config(config)
        turn_tokens = settings.turn_tokens
        assert turn_tokens is not None  # a built-in task's turns: --max_new_tokens_per_turn, else its TURN_TOKENS
        max_new_tokens = min(config.generate_max_len, task.response_budget(settings.max_turns, turn_tokens))
    longest_prompt = min(config.prompt_max_len, max((len(p.prompt_ids) for p in prompts), default=1))
    return longest_prompt, max_new_tokens


def _max_positions(model_path: str) -> int | None:
    """The model's position-table size from its config.json (None when it does not say)."""
    import json

    try:
        with open(os.path.join(model_path, "config.json")) as f:
            value = json.load(f).get("max_position_embeddings")
    except (OSError, ValueError):
        return None
    return int(value) if isinstance(value, (int, float)) else None


def train(config: RLConfig, *, callbacks: Sequence[Any] = (), recipe: Any = None) -> dict[str, Any]:
    """Run a whole training job; returns a summary (steps, final metrics, saved paths). ``recipe``: its roles and
    phases (default: the config's, :func:`~.recipes.recipe_for`).

    In the main thread, SIGTERM is preemption (:class:`~.failures.Preemption`): the step running finishes, a
    checkpoint is saved, then :class:`~.failures.Terminated` (a KeyboardInterrupt) is raised; a lost Ray GCS ends the
    run at once with :class:`~.failures.ClusterLost`. However it ends, the roles, engines, a Ray started here and
    every process they started on this node (:mod:`hybrid_core.run_processes`) are ended before it returns."""
    prep = prepare(config, recipe)
    try:
        return _train_prepared(config, prep, callbacks)
    finally:
        prep.locks.release()  # the folder is free for the next run (a run that dies leaves a lock that is stale)


def _train_prepared(config: RLConfig, prep: Prepared, callbacks: Sequence[Any]) -> dict[str, Any]:
    from hybrid_core.cluster import connect, gcs_answers, shutdown
    from hybrid_core.run_processes import RUN_TAG_ENV, end_leftovers, new_tag
    from hybrid_core.runtime_env import set_worker_env

    from .cluster_watch import ClusterWatch
    from .deepspeed_ops import ensure_cpu_ops_built
    from .failures import ClusterLost, Terminated, explain, resume_hint, sigterm_as_interrupt

    address = config.address or os.environ.get("RAY_ADDRESS")
    if address and not _ray_connected():  # a cluster that is not there fails now, not after the ops are built
        from hybrid_core.cluster import check_gcs

        check_gcs(address, source="address" if config.address else "RAY_ADDRESS")
    built_s = ensure_cpu_ops_built()  # before any worker: one build, not one per role racing for torch's lock
    if built_s > 5:
        log.info("set-up: DeepSpeed CPU ops ready in %.1f s", built_s)

    tag = new_tag()
    set_worker_env({RUN_TAG_ENV: tag})  # every worker, and what it starts, carries it: ended at the very end
    cluster = connect(
        config.address,
        num_gpus=config.num_gpus
        if config.num_gpus is not None
        else (None if (config.address or os.environ.get("RAY_ADDRESS")) else prep.plan.num_gpus),
        temp_dir=config.ray_temp_dir,
        log_max_mb=config.ray_log_max_mb,
    )
    session = None
    watch = ClusterWatch(cluster.address)
    try:
        with sigterm_as_interrupt() as preemption, watch:  # after connect: ray.init replaces the SIGTERM handler
            ended = False
            try:
                session = TrainingSession(prep)
                session.preemption = preemption
                try:
                    session.start()
                except HybridError as e:  # the role and GPU that failed are in e; say it was the start-up
                    raise explain("start-up", e, log_dir=session.log_dir, ckpt=session.ckpt) from e
                _emit(
                    callbacks,
                    "on_start",
                    {
                        "plan": prep.plan,
                        "residency": prep.residency,
                        "total_steps": prep.total_steps,
                        "run_dir": prep.run_dir,
                        "lines": prep.start_lines,
                        "config": prep.config,
                        "start_step": session.start_step,
                    },
                )
                summary = session.run(callbacks)
                _emit(callbacks, "on_end", summary)
                ended = True
                return summary
            except KeyboardInterrupt as e:
                if preemption.requested and not isinstance(e, Terminated):  # the watch's interrupt after SIGTERM
                    raise Terminated(
                        "Ray's GCS stopped too (the signal reached Ray's processes as well), so no "
                        "checkpoint could be saved."
                    ) from None
                if watch.lost:
                    steps = len(session.history) if session is not None else 0
                    raise ClusterLost(
                        f"Ray's GCS at {cluster.address} stopped answering after step {steps}; no "
                        f"Ray call can succeed without it, so the run ends. "
                        f"{resume_hint(CheckpointManager(config.checkpoint_dir))}"
                    ) from None
                raise
            finally:
                if session is not None:  # a dead GCS makes every Ray call of the tear-down wait: none is made then
                    session.close(cluster_lost=watch.lost or not gcs_answers(cluster.address, 1.0), hurry=not ended)
    finally:
        try:
            if cluster.started_here:
                shutdown(cluster)
        finally:
            end_leftovers(tag)  # vLLM's / SGLang's child processes a killed actor leaves behind, on this node


def _ray_connected() -> bool:
    import ray

    return ray.is_initialized()


def _emit(callbacks: Sequence[Any], event: str, payload: Any) -> None:
    for cb in callbacks:
        fn = getattr(cb, event, None)
        if fn is not None:
            fn(payload)


class _SetupClock:
    """Seconds spent in each set-up stage (logged, and returned in the summary)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.seconds[stage] = now - self._last
        self._last = now
        log.info("set-up: %s in %.1f s", stage, self.seconds[stage])


class TrainingSession:
    """The live job: placement group, turnstile, role groups, engines, weight sync, checkpoints."""

    def __init__(self, prep: Prepared):
        self.prep = prep
        self.config = prep.config
        self.log_dir = os.path.join(prep.run_dir, "logs")
        self.ckpt = CheckpointManager(self.config.checkpoint_dir, self.config.max_ckpt_num)
        self.placed: PlacedPlan | None = None
        self.groups: list = []
        self.engines: EngineGroup | None = None
        self.timeline: TimelineWriter | None = None
        self.engine_where: list[dict] = []  # pid and node of each engine, for stack dumps when a step fails
        self.owner: ResidencyOwner | None = None  # start() makes it; close() checks (see started_owner)
        self.start_step = 0
        self.history: list[dict[str, float]] = []
        self.runner: AsyncRunner | None = (
            None  # async_loop.AsyncRunner with --async_train (split, or shared GPUs that fit)
        )
        self.restored_queue: list[dict] = []  # the generated batches a resumed asynchronous run continues with
        self.preemption: Preemption | None = (
            None  # failures.Preemption (train() sets it): SIGTERM during a step waits for its end
        )

    # ---- set-up ----------------------------------------------------------------------------------------------------
    def start(self) -> None:
        from hybrid_algos.kl import make_kl_controller
        from hybrid_core.placement import place
        from hybrid_core.residency import ResidencyOwner, WakeGuard
        from hybrid_core.roles import RoleGroup
        from hybrid_core.runtime_env import set_worker_env
        from hybrid_core.stacks import DIR_ENV
        from hybrid_core.turnstile import Turnstile
        from hybrid_engines.ray_engines import launch_engines
        from hybrid_engines.weight_sync import WeightSync

        from .rewards import RewardScorer

        cfg, prep, plan = self.config, self.prep, self.prep.plan
        timeout = cfg.call_timeout_s
        clock = _SetupClock()
        self.setup_seconds = clock.seconds
        set_worker_env({DIR_ENV: self.log_dir})  # every worker's stacks land in the run's log folder
        self.placed = placed = place(plan, timeout_s=timeout)
        os.makedirs(self.log_dir, exist_ok=True)
        _write_json(os.path.join(self.log_dir, "placement.json"), placed.layout())  # which node got what
        clock.lap("placement group")
        self.turnstile = Turnstile.create(f"hybrid-turnstile-{uuid.uuid4().hex[:8]}", timeout_s=timeout)

        def role(name: str, cls: type):
            return RoleGroup(name, cls, placed, cfg, self.log_dir, timeout_s=timeout)

        # One role group per worker role of the recipe (trainers and frozen models; the engines come below)
        self.roles = {spec.name: role(spec.name, spec.worker_class()) for spec in prep.recipe.workers}
        self.groups.extend(self.roles.values())
        self.actor = self.roles["actor"]
        self.critic = self.roles.get("critic")  # the other trainer, if any: checkpoints save both

        # Models load concurrently; DeepSpeed roles rendezvous on their rank 0's node (the frozen ones too: under
        # ZeRO-3 they are sharded over their ranks, workers/zero3_frozen.py; otherwise they leave the address unused).
        pending = []
        for spec in prep.recipe.workers:
            group, path = self.roles[spec.name], spec.model_folder(cfg, prep.model_path)
            from hybrid_core import rendezvous

            # loopback when the whole group is on one node (every listener binds it), else rank 0's cluster address
            from hybrid_core.remote import get_all_with_timeout

            ips = [
                w["node_ip"]
                for w in get_all_with_timeout(
                    [(group.name(r, "where"), w.where.remote()) for r, w in enumerate(group.workers)], timeout
                )
            ]
            addr = rendezvous.choose(ips).host
            port = get_all_with_timeout(
                [(group.name(0, "free_port"), group.workers[0].free_port.remote(addr))], timeout
            )[0]
            pending.append((group, "setup", (path, addr, port, prep.total_steps)))
        clock.lap("role actors started")
        self._call_all(pending)
        clock.lap("role models loaded")

        # The residency owner moves every state from here on. The roles first take the residency the engines start
        # in (generate's): the engines size their KV cache from the memory they find free.
        residency = prep.residency
        self._call_all([(g, "set_residency", (residency.move(g.role, "cache") == "release",)) for g in self.groups])
        probes: dict[int, tuple[str, Any]] = {}
        for group in self.groups:
            for rank, worker in enumerate(group.workers):
                for gpu in plan.roles[group.role].workers[rank].gpus:
                    probes.setdefault(gpu, (f"{group.role} rank {rank}", worker))
        self.owner = owner = ResidencyOwner(
            residency,
            {g.role: g for g in self.groups},
            turnstile=self.turnstile,
            timeout_s=timeout,
            overlap=cfg.residency_overlap,
        )
        owner.guard = WakeGuard(probes, owner.holders, timeout_s=timeout)
        owner.to_phase_state("generate")
        self.async_mode, self.async_note = prep.async_mode, prep.async_note
        if self.async_note:  # a fall-back to synchronous turns is also in the plan's notes (prepare)
            log.log(logging.WARNING if self.async_mode == "sync" else logging.INFO, "%s", self.async_note)
        _write_json(os.path.join(prep.run_dir, "residency.json"), residency.to_dict())  # what each phase may use

        pausing = cfg.partial_rollout and self.async_mode in ("split", "shared")
        # partial rollouts: an engine takes the pause, the weight update and the resume while a generate runs
        self.engines = engines = launch_engines(
            placed,
            role="rollout",
            backend=cfg.backend,
            engine_kwargs=self._engine_kwargs(),
            timeout_s=timeout,
            max_concurrency=4 if pausing else 1,
        )
        self.engine_where = engines.call("where")
        owner.add_role("rollout", engines)
        clock.lap("engines started")

        self.weight_sync = WeightSync(
            prep.sync.mode,
            self.actor,
            engines,
            plan,
            bucket_bytes=cfg.weight_sync_bucket_mb << 20,
            backend=prep.sync.group_backend,
            transport=prep.sync.transport,
            timeout_s=timeout,
            verify=cfg.verify_weight_sync,
        )
        self.weight_sync.setup()
        clock.lap("weight sync ready")

        tok = prep.tokenizer
        self.reward = RewardScorer(
            prep.reward_fn,
            lambda ids: tok.decode(ids, skip_special_tokens=False),
            normalize=cfg.normalize_reward,
            clip_range=(*cfg.reward_clip_range,),  # a tuple (a --config file gives a list)
            name=cfg.reward_fn or f"of the {cfg.task} task",
            timeout_s=cfg.call_timeout_s,
        )
        # Spans in wall-clock time so an outside sampler (GPU memory) can be matched to phases; kept on resume.
        self.timeline = TimelineWriter(
            os.path.join(prep.run_dir, "timeline.jsonl"), append=prep.resume_from is not None
        )
        kl_controller = (
            make_kl_controller(cfg.init_kl_coef, target=cfg.kl_target, horizon=cfg.kl_horizon)
            if cfg.uses_reference
            else None
        )
        self.agent: AgentRollout | None = None
        if prep.agent is not None:
            from .agents import AgentRollout

            self.agent = AgentRollout(prep.agent, cfg, tok, context_limit=_max_positions(prep.model_path))
        self.ctx = StepContext(
            config=cfg,
            actor=self.actor,
            engines=engines,
            weight_sync=self.weight_sync,
            reward=self.reward,
            residency=owner,
            pad_id=tok.pad_token_id,
            roles=self.roles,
            recipe=prep.recipe,
            kl_controller=kl_controller,
            on_phases=self.timeline,
            prompt_pool=prep.prompts,
            agent=self.agent,
        )
        if prep.resume_from is not None:
            self._resume(prep.resume_from)

    def _engine_kwargs(self) -> dict[str, Any]:
        """Every engine's constructor arguments: the adapter's own (``engine_kwargs(settings, plan)``) from the
        config's engine section and what the run's plan says of the engines."""
        from hybrid_engines.adapter import EnginePlan
        from hybrid_engines.registry import engine_spec

        cfg = self.config
        plan = EnginePlan(
            model_path=self.prep.model_path,
            max_model_len=self.prep.max_model_len,
            shares_gpus=bool(self.prep.plan.shared_gpus("rollout")),
            seeded_sampling=self.seeded_sampling(),
            partial_rollout=cfg.partial_rollout,
        )
        return engine_spec(cfg.backend).engine_kwargs(cfg.engine_settings(), plan)

    def _call_all(self, calls) -> list:
        from hybrid_core.remote import get_all_with_timeout

        named = []
        for group, method, args in calls:
            for r, w in enumerate(group.workers):
                named.append((group.name(r, method), getattr(w, method).remote(*args)))
        try:
            return get_all_with_timeout(named, self.config.call_timeout_s)
        except HybridError:
            for group, _, _ in calls:
                group.dump_stacks()
            raise

    # ---- the steps -------------------------------------------------------------------------------------------------
    def seeded_sampling(self) -> bool:
        """A seed per sample? ``--seeded_sampling``, or where it is cheap (the built-in engine): vLLM / SGLang sample
        seeded requests one by one, and are seeded once from --seed instead."""
        from hybrid_engines.registry import engine_spec

        seeded = self.config.seeded_sampling
        if seeded is None:
            seeded = bool(getattr(engine_spec(self.config.backend), "CHEAP_SEEDED_SAMPLING", False))
        return seeded

    def sampling(self, step: int):
        from hybrid_engines.protocol import SamplingParams

        cfg = self.config
        eos = self.prep.tokenizer.eos_token_id
        seeded = self.seeded_sampling()
        return SamplingParams(
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            max_new_tokens=self.prep.max_new_tokens,
            n=cfg.n_samples_per_prompt,
            stop_token_ids=(eos,) if eos is not None else (),
            seed=cfg.seed * 1_000_003 + step if seeded else None,
            logprobs=cfg.wants_engine_logprobs,
        )

    def prompts_for(self, step: int) -> list:
        """Step ``step``'s prompts: episode-seeded shuffles of the prompt set, so a resumed run sees the same order."""
        prompts, bs = self.prep.prompts, self.config.rollout_batch_size
        per_episode = len(prompts) // bs
        episode, index = divmod(step, per_episode)
        order = list(range(len(prompts)))
        random.Random(self.config.seed + episode).shuffle(order)
        return [prompts[i] for i in order[index * bs : (index + 1) * bs]]

    def run(self, callbacks: Sequence[Any]) -> dict[str, Any]:
        cfg = self.config
        total = self.prep.total_steps
        saved_at = self.start_step if self.prep.resume_from is not None else None
        preemption = self.preemption
        if self.async_mode in ("split", "shared"):
            from .async_loop import AsyncRunner

            self.runner = AsyncRunner(self, self.async_mode, self.restored_queue)
            self.runner.start()
        owner = self.started_owner
        for step in range(self.start_step, total):
            owner.tag = step
            # the asynchronous producer's batch of this step, if it has one
            producer = self.runner if self.runner is not None and self.runner.has(step) else None
            if preemption is not None:  # SIGTERM from here on lets the step (and its checkpoint) finish first
                preemption.deferring, preemption.step = True, step + 1  # (no gap between steps: off after the loop)
            try:
                with (
                    profiled_step(self.groups, profile_folder(self.prep.run_dir, step + 1))
                    if step + 1 == cfg.profile_step
                    else contextlib.nullcontext()
                ):
                    metrics = self._one_step(step, producer)
                if _refines_after(step - self.start_step):
                    refine = functools.partial(self.refine_residency, step + 1)
                    metrics.update(self.guarded("refining the residency plan", refine))
                    self._recheck_async()
            except HybridError as error:
                if preemption is not None and preemption.requested:  # e.g. SIGTERM reached the roles as well
                    from .failures import Terminated

                    raise Terminated(
                        f"Step {step + 1} could not finish after SIGTERM ("
                        f"{_first_line(error)}), so no checkpoint of it was saved."
                    ) from error
                raise
            self.history.append(metrics)
            if (step + 1) % cfg.logging_steps == 0 or step + 1 == total:
                _emit(callbacks, "on_step", metrics)
            if cfg.save_steps > 0 and (step + 1) % cfg.save_steps == 0:
                owner.tag = f"checkpoint {step + 1}"
                self.guarded(f"the checkpoint after step {step + 1}", functools.partial(self.save_checkpoint, step + 1))
                saved_at = step + 1
            if preemption is not None and preemption.requested:
                self._stop_on_sigterm(step + 1, saved_at)
        if preemption is not None:
            preemption.deferring = False  # the final saves: SIGTERM stops them at once (the last checkpoint stands)
        # A run that can be continued is the default: the last step gets a checkpoint unless it has one already.
        end = max(total, self.start_step)
        if cfg.final_checkpoint and saved_at != end:
            owner.tag = f"checkpoint {end}"
            self.guarded(f"the checkpoint after step {end}", lambda: self.save_checkpoint(end))
        owner.tag = "final"
        final = self.guarded("saving the final model", self.save_final_model)
        latest = self.ckpt.latest()
        if self.runner is not None:
            self.runner.close()
        summary = {
            "steps": total,
            "start_step": self.start_step,
            "history": self.history,
            "async": {"mode": self.async_mode, "note": self.async_note},
            "setup_seconds": self.setup_seconds,
            "final_model": final,
            "run_dir": self.prep.run_dir,
            "plan": self.prep.plan,
            "residency": self.prep.residency,
            "residency_log": owner.log,
        }
        if latest is not None:  # only folders that exist: a summary never points at nothing
            summary.update(checkpoint_dir=self.ckpt.root, last_checkpoint=latest[0])
        return summary

    @property
    def started_owner(self) -> ResidencyOwner:
        """The residency owner that :meth:`start` made (``owner`` is None before that; :meth:`close` checks it)."""
        if self.owner is None:
            raise RuntimeError("TrainingSession.start() makes the residency owner: call it first")
        return self.owner

    def _one_step(self, step: int, producer: AsyncRunner | None) -> dict[str, float]:
        """Step ``step``: on the batch ``producer`` (the asynchronous runner) made for it, else generated now."""
        if producer is not None:
            return producer.step(step)
        return self.guarded(
            f"step {step + 1}",
            lambda: run_step(self.ctx, step, self.prompts_for(step), self.sampling(step)),
        )[0]

    def _stop_on_sigterm(self, done: int, saved_at: int | None) -> None:
        """After the step SIGTERM let finish: its checkpoint (unless it has one), then :class:`~.failures.Terminated`.
        The save has the step budget; a second SIGTERM stops it (the checkpoint folder keeps no half-written step)."""
        from .failures import Terminated

        if saved_at != done:
            self.started_owner.tag = f"checkpoint {done}"
            try:
                self.guarded(f"the checkpoint after step {done} (on SIGTERM)", lambda: self.save_checkpoint(done))
            except HybridError as error:
                raise Terminated(f"The checkpoint of step {done} on SIGTERM failed ({_first_line(error)}).") from error
            log.warning("SIGTERM: saved the checkpoint of step %d", done)
        raise Terminated()

    def _recheck_async(self) -> None:
        """A refined plan that no longer keeps the engines next to the trainer ends the overlap: the batches already
        generated are trained on, then the run takes synchronous turns (and says so)."""
        from .async_rollout import async_mode

        if self.runner is None or self.async_mode != "shared":
            return
        mode, note = async_mode(self.config, self.prep.plan, self.prep.residency)
        if mode == "sync":
            self.async_mode, self.async_note = mode, note + " (from the refined plan on)"
            log.warning("%s", self.async_note)
            self.prep.residency.notes.append(self.async_note)
            self.guarded("stopping the asynchronous rollout producer", self.runner.stop_producing)

    def refine_residency(self, after_step: int) -> dict[str, float]:
        """What each GPU really holds against what the model counts there now, after steps 1, 2, 4, 8, ... of this
        run (:mod:`hybrid_core.residency.refine`). The difference (CUDA contexts, library buffers, the allocator's
        fragmentation as sequence lengths vary, another process) becomes the plan's measured overhead, held in every
        phase, and the plan is made again with it: a plan that no longer fits changes now, before a later phase would
        run out of memory, and where no plan fits the run stops with the numbers. The overhead only grows (the largest
        seen), and each reading is a step later than the last: reserved memory that keeps growing over the first
        steps is caught. Nothing to measure without CUDA (the guard is off)."""
        from hybrid_core.residency import refine_plan

        from .placement import replan

        owner = self.started_owner
        guard = owner.guard
        plan = owner.plan
        if guard is None or not guard.enabled:
            return {}
        owner.settle()  # every move landed: the owner's record is what the GPUs hold (early wakes included)
        used = {}
        for gpu in plan.layout:
            reading = guard.read(gpu)
            if reading is None:
                return {}
            used[gpu] = reading.total - reading.free
        result = refine_plan(
            plan,
            used,
            phase=owner.phase,
            on_gpu=owner.on_gpu(),
            after_step=after_step,
            replan=lambda overhead: replan(
                self.config, plan.layout, plan.gpu_bytes, overhead=overhead, host=plan.host, phases=plan.phases
            ),
        )
        metrics = {"residency/overhead_gib": result.largest / 2**30, "residency/replanned": float(result.changed)}
        if not result.replanned:
            return metrics
        refined = result.plan
        trims = [
            (g, "set_residency", (refined.move(g.role, "cache") == "release",))
            for g in self.groups
            if refined.move(g.role, "cache") != plan.move(g.role, "cache")
        ]
        if trims:  # a role that now trims its allocator cache after each phase (or keeps it) is told so
            self._call_all(trims)
        owner.plan = self.prep.residency = refined
        _write_json(os.path.join(self.prep.run_dir, "residency.json"), refined.to_dict())
        return metrics

    # ---- failures --------------------------------------------------------------------------------------------------
    def guarded(self, label: str, fn):
        """Run ``fn`` within ``step_timeout_s`` (every remote call in it, and the driver's own work such as the reward
        function, shares that budget). A failure ends the run with an error naming what failed (role, phase, rank),
        the stacks of every role and of the driver when something was late or dead, and the checkpoint to resume
        from; an unexpected exception's traceback goes to the log folder (see :mod:`.failures`)."""
        from hybrid_core.remote import deadline

        from .failures import explain, wants_stacks

        try:
            with deadline(self.config.step_timeout_s, label):
                return fn()
        except Exception as e:
            stacks = ""
            if wants_stacks(e):
                self.dump_all_stacks()
                stacks = f"Python stacks of every role actor and of the driver: {self.log_dir}/stacks-*.txt."
            raise explain(label, e, log_dir=self.log_dir, ckpt=self.ckpt, stacks=stacks) from e

    def dump_all_stacks(self) -> None:
        """Stacks of every trainer worker (control-thread call) and every engine (signal); never raises."""
        from hybrid_core.stacks import request_dump

        from .failures import write_driver_stacks

        write_driver_stacks(self.log_dir)
        for group in self.groups:
            group.dump_stacks()
        for where in self.engine_where:
            request_dump(where["pid"], where.get("node_ip"))
        os.makedirs(self.log_dir, exist_ok=True)
        with open(os.path.join(self.log_dir, "stacks-index.txt"), "a") as f:  # which pid is which engine
            f.write(
                "".join(
                    f"{time.strftime('%H:%M:%S')} rollout engine {r}: pid {w['pid']} on {w.get('node_ip')} "
                    f"-> stacks-pid{w['pid']}.txt\n"
                    for r, w in enumerate(self.engine_where)
                )
            )
        time.sleep(0.5)  # the signal handlers write asynchronously

    # ---- checkpoints -----------------------------------------------------------------------------------------------
    def driver_state(self, next_step: int) -> dict[str, Any]:
        """Plain data only (saved as JSON): nothing read back from a checkpoint can run code."""
        from .resume import essentials

        kl = self.ctx.kl_controller
        return {
            "next_step": next_step,
            "kl": kl.state_dict() if kl is not None else None,
            "reward_norm": self.reward.state_dict(),
            "history": self.history,
            "config": self.config.to_dict(),
            "essentials": essentials(self.config),
            # batches generated ahead of the trainer (asynchronous training): a resumed run trains on them
            "async_queue": self.runner.state(next_step) if self.runner is not None else [],
        }

    def save_checkpoint(self, next_step: int) -> str:
        def save_roles(folder: str) -> None:
            for group in (self.actor, self.critic):
                if group is not None:
                    # DeepSpeed saves from the GPU
                    self.started_owner.to_phase_state(_train_phase(self.prep.recipe, group.role))
                    group.call("save_checkpoint", os.path.join(folder, group.role), "state")

        return self.ckpt.save(next_step, save_roles, self.driver_state(next_step))

    def _resume(self, point) -> None:
        """Load ``point`` (a :class:`~.resume.ResumePoint` chosen and checked by ``prepare``) into every role."""
        path, state = point.path, point.state
        for group in (self.actor, self.critic):
            if group is not None:
                self.started_owner.to_phase_state(
                    _train_phase(self.prep.recipe, group.role)
                )  # DeepSpeed loads into the GPU
                group.call("load_checkpoint", os.path.join(path, group.role), "state")
        if self.ctx.kl_controller is not None and state["kl"] is not None:
            self.ctx.kl_controller.load_state_dict(state["kl"])
        self.reward.load_state_dict(state["reward_norm"])
        self.history = list(state["history"])
        self.start_step = int(state["next_step"])
        from .resume import drop_steps_from

        # the steps done after this checkpoint are done again: their spans go (the writer appends at the new end)
        drop_steps_from(os.path.join(self.prep.run_dir, "timeline.jsonl"), self.start_step)
        self.restored_queue = list(state.get("async_queue") or [])
        if self.restored_queue and not self.config.async_train:
            log.warning(
                "the checkpoint holds %d batches generated ahead (--async_train); this run is synchronous "
                "and generates them again",
                len(self.restored_queue),
            )
        # The engines still hold the pretrained weights: give them the restored actor's. The first step's phases
        # then move everything where the plan wants it, as after any sync.
        self.started_owner.to_phase_state("sync")
        self.weight_sync.sync(wake_engines=False)
        log.info("resumed from %s at step %d", path, self.start_step)

    def save_final_model(self) -> str:
        """The trained policy in Hugging Face format, written atomically to ``<save_path>/final``."""
        from .checkpoint import CheckpointError, out_of_space

        final = os.path.join(self.prep.run_dir, "final")
        tmp = f"{final}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            self.started_owner.to_phase_state("actor_train")  # the actor's weights on its GPUs: it saves from there
            self.actor.call("save_pretrained", tmp, self.prep.model_path)
        except BaseException as error:
            shutil.rmtree(tmp, ignore_errors=True)  # an interrupted or failed save leaves nothing half-written
            if isinstance(error, Exception) and out_of_space(error, self.prep.run_dir):
                raise CheckpointError(
                    f"no space left on device: the final model did not fit in {self.prep.run_dir}. "
                    "Fix: free disk space (or keep fewer checkpoints: --max_ckpt_num), then "
                    "--resume to save it."
                ) from error
            raise
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        return final

    # ---- tear-down -------------------------------------------------------------------------------------------------
    def close(self, *, cluster_lost: bool = False, hurry: bool = False) -> None:
        """End the run's actors (``hurry``: after an error or interrupt, the engines get 10 s to shut down, not 60:
        the command must end within seconds of Ctrl-C / SIGTERM). Never raises for a role that is already gone."""
        import ray

        if self.runner is not None:
            self.runner.close()
        if self.timeline is not None:
            self.timeline.close()
        agent = getattr(self, "agent", None)
        if agent is not None:  # the environments' event loop: a local thread
            agent.close()
        if cluster_lost:  # every Ray call would wait out its timeout: Ray's shutdown ends the local processes
            return
        owner = getattr(self, "owner", None)
        if owner is not None:
            owner.release_turn_quietly()
        if getattr(self, "weight_sync", None) is not None:
            try:
                self.weight_sync.close()
            except Exception:  # tearing down after an error: report the error, not the clean-up
                log.debug("weight-sync close failed", exc_info=True)
        if self.engines is not None:
            try:
                self.engines.shutdown(timeout_s=min(10.0 if hurry else 60.0, self.config.call_timeout_s))  # then killed
            except Exception:  # tearing down after an error: report the error, not the clean-up
                log.debug("engine shutdown failed", exc_info=True)
        for group in self.groups:
            group.kill()
        if getattr(self, "turnstile", None) is not None:
            try:
                ray.kill(self.turnstile.actor)
            except Exception:
                log.debug("turnstile kill failed", exc_info=True)
        if self.placed is not None:
            try:
                self.placed.remove()
            except Exception:  # a Ray started here goes with its placement group; a shared one logs it
                log.warning("removing the run's placement group failed", exc_info=True)


def _write_json(path: str, data: Any) -> None:
    import json

    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0].rstrip(".") if lines else type(error).__name__


def _refines_after(steps_done: int) -> bool:
    """Refine the residency plan after the 1st, 2nd, 4th, 8th, ... step of a run (``steps_done``: 0, 1, 3, 7, ...)."""
    return steps_done & (steps_done + 1) == 0


def _train_phase(recipe: Any, role: str) -> str:
    """The phase in which a trainer holds all it trains with (DeepSpeed saves and loads its checkpoint there)."""
    return recipe.train_phase(role)
