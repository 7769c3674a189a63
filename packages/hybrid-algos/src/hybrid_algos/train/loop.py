"""``train(config)``: set up the roles on the placement plan, run the steps, checkpoint, save the final model.

The per-algorithm recipes (:mod:`.ppo`, :mod:`.grpo`, :mod:`.reinforce`) only choose a config; everything they
share is here and in :mod:`.step`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import random
import shutil
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from hybrid_core.errors import HybridError

from .checkpoint import CheckpointManager
from .config import RLConfig
from .placement import build_plan
from .step import StepContext, release_quietly, run_step
from .timeline import TimelineWriter
from .weight_sync import choose_mode as choose_sync_mode

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
    sync_mode: str = "broadcast"  # weight_sync.choose_mode's answer for this plan
    resume_from: Any = None  # resume.ResumePoint: the checkpoint this run continues, or None (a fresh start)


def prepare(config: RLConfig) -> Prepared:
    """Validate the config and resolve everything that does not need Ray: errors here cost nothing."""
    from .data import load_prompts
    from .model_files import check_model_folder, load_tokenizer
    from .resume import find_resume_point
    from .rewards import load_reward_fn
    from .run_folder import check_writable, refuse_or_clear
    from .tasks import task_from_config
    from .tiny import save_tiny_model

    from hybrid_core.errors import ConfigError

    config.validate()
    plan = build_plan(config)
    sync_mode = choose_sync_mode(config, plan)  # a weight-sync path the placement cannot take fails here, before Ray
    if config.num_gpus is not None and config.num_gpus < plan.num_gpus:
        raise ConfigError("num_gpus", f"the placement needs {plan.num_gpus} GPUs but --num_gpus declares {config.num_gpus}.",
                          f"Use --num_gpus {plan.num_gpus}, or place the roles on fewer GPUs.")
    if config.backend != "hf" and importlib.util.find_spec(config.backend) is None:
        raise ConfigError("backend", f"--backend {config.backend} needs the {config.backend} package, which is not "
                          "installed.", f"pip install 'hybrid-engines[{config.backend}]', or use --backend hf.")
    for name in ("pretrain", "reward_pretrain", "critic_pretrain"):
        if getattr(config, name) is not None:
            check_model_folder(name, getattr(config, name), trust_remote_code=config.trust_remote_code)
    reward_fn = load_reward_fn(config.reward_fn) if config.reward_fn is not None else None  # imports the user's file
    # The folders next (writable, not holding another run): nothing is written before they are known to be fine.
    run_dir = check_writable("save_path", config.save_path)
    ckpt = CheckpointManager(config.checkpoint_dir, config.max_ckpt_num)
    if config.save_steps > 0 or config.final_checkpoint or config.resume or config.resume_if_exists:
        check_writable("ckpt_path" if config.ckpt_path else "save_path", ckpt.root)
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
    try:
        prompts = load_prompts(config, tokenizer)
    except UnicodeDecodeError as e:
        raise ConfigError("prompt_data", f"{config.prompt_data} is not UTF-8 text (byte {e.object[e.start:e.start + 1]!r} "
                          f"at offset {e.start} cannot be decoded).",
                          "Save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8 in.jsonl > out.jsonl).") from None
    if config.reward_fn is None:
        reward_fn = task.reward_fn() if task is not None else None  # None: the reward model scores
    if reward_fn is None and config.reward_pretrain is None:
        raise ConfigError("reward_pretrain", "no reward: a --prompt_data run needs --reward_pretrain or --reward_fn.",
                          "Add --reward_fn my_module:my_reward (rule-based) or --reward_pretrain DIR.")
    # Built-in tasks have short answers: generating up to 1024 tokens would only waste time.
    max_new_tokens = min(config.generate_max_len, task.answer_len + 1) if task else config.generate_max_len
    steps_per_episode = len(prompts) // config.rollout_batch_size
    if steps_per_episode == 0:
        raise ConfigError("rollout_batch_size", f"only {len(prompts)} prompts, fewer than one rollout batch "
                          f"({config.rollout_batch_size}).", "Lower --rollout_batch_size or give more prompts.")
    # Size the engine's context to what rollouts can reach, not to the flags' ceiling: a small model's position
    # table is often shorter than prompt_max_len + generate_max_len, and vLLM refuses a longer max_model_len.
    longest_prompt = min(config.prompt_max_len, max(len(p.prompt_ids) for p in prompts))
    max_model_len = longest_prompt + max_new_tokens
    positions = _max_positions(model_path)
    if positions is not None and max_model_len > positions:
        raise ConfigError("generate_max_len", f"prompts of up to {longest_prompt} tokens plus {max_new_tokens} new "
                          f"tokens need {max_model_len} positions; the model has {positions}.",
                          "Lower --generate_max_len or --prompt_max_len (prompts longer than it are truncated).")
    total = steps_per_episode * config.num_episodes
    if config.max_steps is not None:
        total = min(total, config.max_steps)
    return Prepared(config, plan, model_path, tokenizer, prompts, reward_fn, max_new_tokens, total, run_dir,
                    max_model_len, sync_mode, resume_from)


def _max_positions(model_path: str) -> int | None:
    """The model's position-table size from its config.json (None when it does not say)."""
    import json

    try:
        with open(os.path.join(model_path, "config.json")) as f:
            value = json.load(f).get("max_position_embeddings")
    except (OSError, ValueError):
        return None
    return int(value) if isinstance(value, (int, float)) else None


def train(config: RLConfig, *, callbacks: Sequence[Any] = ()) -> dict[str, Any]:
    """Run a whole training job; returns a summary (steps, final metrics, saved paths).

    In the main thread, SIGTERM stops the run like Ctrl-C (:class:`~.failures.Terminated`, a KeyboardInterrupt)
    and a lost Ray GCS ends it at once with :class:`~.failures.ClusterLost`; either way the roles, engines and a
    Ray started here are shut down before it returns."""
    prep = prepare(config)
    from hybrid_core.cluster import connect, shutdown

    from .cluster_watch import ClusterWatch
    from .deepspeed_ops import ensure_cpu_ops_built
    from .failures import ClusterLost, resume_hint, sigterm_as_interrupt

    built_s = ensure_cpu_ops_built()  # before any worker: one build, not one per role racing for torch's lock
    if built_s > 5:
        log.info("set-up: DeepSpeed CPU ops ready in %.1f s", built_s)

    cluster = connect(config.address, num_gpus=config.num_gpus if config.num_gpus is not None else
                      (None if (config.address or os.environ.get("RAY_ADDRESS")) else prep.plan.num_gpus),
                      temp_dir=config.ray_temp_dir, log_max_mb=config.ray_log_max_mb)
    session = None
    watch = ClusterWatch(cluster.address)
    try:
        with sigterm_as_interrupt(), watch:  # after connect: ray.init replaces the SIGTERM handler
            try:
                session = TrainingSession(prep)
                session.start()
                _emit(callbacks, "on_start", {"plan": prep.plan, "total_steps": prep.total_steps,
                                              "run_dir": prep.run_dir, "config": config,
                                              "start_step": session.start_step})
                summary = session.run(callbacks)
                _emit(callbacks, "on_end", summary)
                return summary
            except KeyboardInterrupt:
                if watch.lost:
                    steps = len(session.history) if session is not None else 0
                    raise ClusterLost(f"Ray's GCS at {cluster.address} stopped answering after step {steps}; no "
                                      f"Ray call can succeed without it, so the run ends. "
                                      f"{resume_hint(CheckpointManager(config.checkpoint_dir))}") from None
                raise
            finally:
                if session is not None:
                    session.close(cluster_lost=watch.lost)
    finally:
        if cluster.started_here:
            shutdown(cluster)


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
        self.placed = None
        self.groups: list = []
        self.engines = None
        self.timeline = None
        self.engine_where: list[dict] = []  # pid and node of each engine, for stack dumps when a step fails
        self.memory = None
        self.start_step = 0
        self.history: list[dict[str, float]] = []

    # ---- set-up ----------------------------------------------------------------------------------------------------
    def start(self) -> None:
        from hybrid_core.placement import place
        from hybrid_core.runtime_env import set_worker_env
        from hybrid_core.stacks import DIR_ENV
        from hybrid_core.turnstile import Turnstile
        from hybrid_engines.ray_engines import launch_engines

        from hybrid_algos.kl import make_kl_controller

        from .rewards import RewardScorer
        from .memory_guard import WakeGuard
        from .roles import RoleGroup
        from .weight_sync import WeightSync
        from .workers.critic import CriticWorker
        from .workers.frozen import ReferenceWorker, RewardModelWorker
        from .workers.policy import PolicyWorker

        cfg, prep, plan = self.config, self.prep, self.prep.plan
        timeout = cfg.call_timeout_s
        clock = _SetupClock()
        self.setup_seconds = clock.seconds
        set_worker_env({DIR_ENV: self.log_dir})  # every worker's stacks land in the run's log folder
        self.placed = place(plan, timeout_s=timeout)
        clock.lap("placement group")
        self.turnstile = Turnstile.create(f"hybrid-turnstile-{uuid.uuid4().hex[:8]}", timeout_s=timeout)

        self.actor = RoleGroup("actor", PolicyWorker, self.placed, cfg, self.log_dir, timeout_s=timeout)
        self.groups.append(self.actor)
        self.critic = self.reference = self.reward_model = None
        if "critic" in plan.roles:
            self.critic = RoleGroup("critic", CriticWorker, self.placed, cfg, self.log_dir, timeout_s=timeout)
            self.groups.append(self.critic)
        if "reference" in plan.roles:
            self.reference = RoleGroup("reference", ReferenceWorker, self.placed, cfg, self.log_dir, timeout_s=timeout)
            self.groups.append(self.reference)
        if "reward" in plan.roles:
            self.reward_model = RoleGroup("reward", RewardModelWorker, self.placed, cfg, self.log_dir, timeout_s=timeout)
            self.groups.append(self.reward_model)

        # Models load concurrently; DeepSpeed roles rendezvous on their rank 0's node.
        pending = []
        for group, path in ((self.actor, prep.model_path), (self.critic, cfg.critic_pretrain or cfg.reward_pretrain or prep.model_path)):
            if group is None:
                continue
            import ray

            addr = ray.get(group.workers[0].where.remote(), timeout=timeout)["node_ip"]
            port = ray.get(group.workers[0].free_port.remote(), timeout=timeout)
            pending.append((group, "setup", (path, addr, port, prep.total_steps)))
        if self.reference is not None:
            pending.append((self.reference, "setup", (prep.model_path,)))
        if self.reward_model is not None:
            pending.append((self.reward_model, "setup", (cfg.reward_pretrain,)))
        clock.lap("role actors started")
        self._call_all(pending)
        clock.lap("role models loaded")
        # Each trainer role gives its GPU back before the engines start (they size their KV cache from free memory).
        self.memory = WakeGuard(plan, self.groups, timeout_s=timeout)
        sleepers = [g for g in self.groups if g.sleeps]
        slept = self._call_all([(g, "sleep", ()) for g in sleepers])
        for g in sleepers:
            self.memory.after_sleep(g.role, slept[: g.world_size])
            slept = slept[g.world_size:]

        engine_kwargs = self._engine_kwargs()
        self.engines = launch_engines(self.placed, role="rollout", backend=cfg.backend, engine_kwargs=engine_kwargs,
                                      timeout_s=timeout)
        self.engine_where = self.engines.call("where")
        rollout = plan.roles["rollout"]
        engine_sleeps = rollout.sleeps
        if engine_sleeps:
            self.memory.after_sleep("rollout", self.engines.sleep(1))
        clock.lap("engines started")

        self.weight_sync = WeightSync(prep.sync_mode, self.actor, self.engines, plan,
                                      bucket_bytes=cfg.weight_sync_bucket_mb << 20, backend=_sync_backend(cfg),
                                      timeout_s=timeout)
        self.weight_sync.setup()
        clock.lap("weight sync ready")

        tok = prep.tokenizer
        self.reward = RewardScorer(prep.reward_fn, lambda ids: tok.decode(ids, skip_special_tokens=False),
                                   normalize=cfg.normalize_reward, clip_range=tuple(cfg.reward_clip_range),
                                   name=cfg.reward_fn or f"of the {cfg.task} task", timeout_s=cfg.call_timeout_s)
        # Spans in wall-clock time so an outside sampler (GPU memory) can be matched to phases; kept on resume.
        self.timeline = TimelineWriter(os.path.join(prep.run_dir, "timeline.jsonl"), append=prep.resume_from is not None)
        kl_controller = make_kl_controller(cfg.init_kl_coef, target=cfg.kl_target, horizon=cfg.kl_horizon) \
            if cfg.uses_reference else None
        self.ctx = StepContext(
            config=cfg, actor=self.actor, engines=self.engines, weight_sync=self.weight_sync, reward=self.reward,
            turnstile=self.turnstile, pad_id=tok.pad_token_id, critic=self.critic, reference=self.reference,
            reward_model=self.reward_model, kl_controller=kl_controller,
            engine_gpus=sorted({g for w in rollout.workers for g in w.gpus}), engine_sleeps=engine_sleeps,
            engine_weights_awake=not engine_sleeps, memory=self.memory,
            on_phases=self.timeline)
        if prep.resume_from is not None:
            self._resume(prep.resume_from)

    def _engine_kwargs(self) -> dict[str, Any]:
        cfg = self.config
        kwargs: dict[str, Any] = {"model": self.prep.model_path, "seed": cfg.seed,
                                  "trust_remote_code": cfg.trust_remote_code}  # vLLM / SGLang take it as is
        if cfg.backend == "hf":
            kwargs["dtype"] = "bfloat16" if cfg.bf16 else "float32"
        else:
            kwargs.update(tensor_parallel_size=cfg.vllm_tensor_parallel_size,
                          gpu_memory_utilization=cfg.vllm_gpu_memory_utilization, enforce_eager=cfg.enforce_eager,
                          enable_prefix_caching=cfg.enable_prefix_caching, dtype="bfloat16" if cfg.bf16 else "auto",
                          max_model_len=self.prep.max_model_len,
                          enable_sleep_mode=self.prep.plan.roles["rollout"].sleeps)
        return kwargs

    def _call_all(self, calls) -> list:
        from hybrid_core.remote import get_all_with_timeout

        named = []
        for group, method, args in calls:
            for r, w in enumerate(group.workers):
                named.append((f"{group.role} rank {r}: {method}", getattr(w, method).remote(*args)))
        try:
            return get_all_with_timeout(named, self.config.call_timeout_s)
        except HybridError:
            for group, _, _ in calls:
                group.dump_stacks()
            raise

    # ---- the steps -------------------------------------------------------------------------------------------------
    def sampling(self, step: int):
        from hybrid_engines.protocol import SamplingParams

        cfg = self.config
        eos = self.prep.tokenizer.eos_token_id
        return SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                              max_new_tokens=self.prep.max_new_tokens, n=cfg.n_samples_per_prompt,
                              stop_token_ids=(eos,) if eos is not None else (), seed=cfg.seed * 1_000_003 + step)

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
        for step in range(self.start_step, total):
            metrics, _ = self.guarded(f"step {step + 1}", lambda: run_step(self.ctx, step, self.prompts_for(step),
                                                                           self.sampling(step)))
            self.history.append(metrics)
            if (step + 1) % cfg.logging_steps == 0 or step + 1 == total:
                _emit(callbacks, "on_step", metrics)
            if cfg.save_steps > 0 and (step + 1) % cfg.save_steps == 0:
                self.guarded(f"the checkpoint after step {step + 1}", lambda: self.save_checkpoint(step + 1))
                saved_at = step + 1
        # A run that can be continued is the default: the last step gets a checkpoint unless it has one already.
        if cfg.final_checkpoint and saved_at != max(total, self.start_step):
            end = max(total, self.start_step)
            self.guarded(f"the checkpoint after step {end}", lambda: self.save_checkpoint(end))
        final = self.guarded("saving the final model", self.save_final_model)
        latest = self.ckpt.latest()
        summary = {"steps": total, "start_step": self.start_step, "history": self.history,
                   "setup_seconds": self.setup_seconds, "final_model": final, "run_dir": self.prep.run_dir,
                   "plan": self.prep.plan}
        if latest is not None:  # only folders that exist: a summary never points at nothing
            summary.update(checkpoint_dir=self.ckpt.root, last_checkpoint=latest[0])
        return summary

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
            f.write("".join(f"{time.strftime('%H:%M:%S')} rollout engine {r}: pid {w['pid']} on {w.get('node_ip')} "
                            f"-> stacks-pid{w['pid']}.txt\n" for r, w in enumerate(self.engine_where)))
        time.sleep(0.5)  # the signal handlers write asynchronously

    # ---- checkpoints -----------------------------------------------------------------------------------------------
    def driver_state(self, next_step: int) -> dict[str, Any]:
        """Plain data only (saved as JSON): nothing read back from a checkpoint can run code."""
        from .resume import essentials

        kl = self.ctx.kl_controller
        return {"next_step": next_step, "kl": kl.state_dict() if kl is not None else None,
                "reward_norm": self.reward.state_dict(), "history": self.history, "config": self.config.to_dict(),
                "essentials": essentials(self.config)}

    def save_checkpoint(self, next_step: int) -> str:
        def save_roles(folder: str) -> None:
            for group in (self.actor, self.critic):
                if group is not None:
                    with self.awake(group):
                        group.call("save_checkpoint", os.path.join(folder, group.role), "state")

        return self.ckpt.save(next_step, save_roles, self.driver_state(next_step))

    @contextlib.contextmanager
    def awake(self, group) -> Iterator[None]:
        """DeepSpeed saves and loads from device memory: a sleeping role takes its turn and wakes for it."""
        if not group.sleeps:
            yield
            return
        self.turnstile.acquire(group.role, group.gpus, timeout_s=self.config.call_timeout_s)
        try:
            before = self.memory.before_wake(group.role) if self.memory is not None else None
            group.call("wake")
            if self.memory is not None:
                self.memory.after_wake(group.role, "all", before)
            yield
            slept = group.call("sleep")
            if self.memory is not None:
                self.memory.after_sleep(group.role, slept)
        except BaseException:
            release_quietly(self.turnstile, group.role, group.gpus)
            raise
        self.turnstile.release(group.role, group.gpus)

    def _resume(self, point) -> None:
        """Load ``point`` (a :class:`~.resume.ResumePoint` chosen and checked by ``prepare``) into every role."""
        path, state = point.path, point.state
        for group in (self.actor, self.critic):
            if group is not None:
                with self.awake(group):
                    group.call("load_checkpoint", os.path.join(path, group.role), "state")
        if self.ctx.kl_controller is not None and state["kl"] is not None:
            self.ctx.kl_controller.load_state_dict(state["kl"])
        self.reward.load_state_dict(state["reward_norm"])
        self.history = list(state["history"])
        self.start_step = int(state["next_step"])
        # The engines still hold the pretrained weights: give them the restored actor's. They are then left as a
        # step leaves them (fresh weights on the GPU, KV cache asleep), so the next step runs as it would have.
        with self.awake(self.actor):
            self.weight_sync.sync(wake_engines=self.ctx.engine_sleeps)
        if self.ctx.engine_sleeps and self.critic is not None and self.critic.sleeps:
            self.memory.after_sleep("rollout", self.engines.sleep(1))  # a step's critic turn needs the GPU too
        elif self.ctx.engine_sleeps:
            self.ctx.engine_weights_awake = True
            self.memory.mark_awake("rollout")
        log.info("resumed from %s at step %d", path, self.start_step)

    def save_final_model(self) -> str:
        """The trained policy in Hugging Face format, written atomically to ``<save_path>/final``."""
        from .checkpoint import CheckpointError, out_of_space

        final = os.path.join(self.prep.run_dir, "final")
        tmp = f"{final}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            with self.awake(self.actor):
                self.actor.call("save_pretrained", tmp, self.prep.model_path)
        except BaseException as error:
            shutil.rmtree(tmp, ignore_errors=True)  # an interrupted or failed save leaves nothing half-written
            if isinstance(error, Exception) and out_of_space(error, self.prep.run_dir):
                raise CheckpointError(f"no space left on device: the final model did not fit in {self.prep.run_dir}. "
                                      "Fix: free disk space (or keep fewer checkpoints: --max_ckpt_num), then "
                                      "--resume to save it.") from error
            raise
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        return final

    # ---- tear-down -------------------------------------------------------------------------------------------------
    def close(self, *, cluster_lost: bool = False) -> None:
        import ray

        if self.timeline is not None:
            self.timeline.close()
        if cluster_lost:  # every Ray call would wait out its timeout: Ray's shutdown ends the local processes
            return
        if self.engines is not None:
            try:
                self.engines.shutdown(timeout_s=min(60.0, self.config.call_timeout_s))  # then killed regardless
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
            self.placed.remove()


def _sync_backend(cfg: RLConfig) -> str:
    import torch

    return cfg.vllm_sync_backend if torch.cuda.is_available() else "gloo"
