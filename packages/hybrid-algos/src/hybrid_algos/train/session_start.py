"""A session's set-up (:meth:`SessionStart.start`): the placement group, one role group per worker role of the
recipe with its model loaded, the residency owner, the engines (their constructor arguments from the engine
adapter), the weight sync, the reward scorer and the step's context; a resumed run then loads its checkpoint.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from typing import TYPE_CHECKING, Any

from .prepare import max_positions
from .session_saves import SessionSaves
from .session_state import write_json
from .step import StepContext
from .timeline import TimelineWriter

if TYPE_CHECKING:
    from .agents import AgentRollout

log = logging.getLogger(__name__)


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


class SessionStart(SessionSaves):
    """The set-up part of :class:`~.session.TrainingSession` (a resumed run's set-up ends with loading its checkpoint:
    :class:`~.session_saves.SessionSaves`)."""

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

        settings, prep, plan = self.settings, self.prep, self.prep.plan
        run, rollout, algo = settings.run, settings.rollout, settings.algorithm
        timeout = run.call_timeout_s
        clock = _SetupClock()
        self.setup_seconds = clock.seconds
        set_worker_env({DIR_ENV: self.log_dir})  # every worker's stacks land in the run's log folder
        from .sections import flag_words

        with flag_words():  # core's errors name the placement's settings
            self.placed = placed = place(plan, timeout_s=timeout)
        os.makedirs(self.log_dir, exist_ok=True)
        write_json(os.path.join(self.log_dir, "placement.json"), placed.layout())  # which node got what
        clock.lap("placement group")
        self.turnstile = Turnstile.create(f"hybrid-turnstile-{uuid.uuid4().hex[:8]}", timeout_s=timeout)

        def role(name: str, cls: type):
            return RoleGroup(name, cls, placed, settings, self.log_dir, timeout_s=timeout)

        # One role group per worker role of the recipe (trainers and frozen models; the engines come below)
        self.roles = {spec.name: role(spec.name, spec.worker_class()) for spec in prep.recipe.workers}
        self.groups.extend(self.roles.values())
        self.actor = self.roles["actor"]
        self.critic = self.roles.get("critic")  # the other trainer, if any: checkpoints save both

        # Models load concurrently; DeepSpeed roles rendezvous on their rank 0's node (the frozen ones too: under
        # ZeRO-3 they are sharded over their ranks, workers/zero3_frozen.py; otherwise they leave the address unused).
        pending = []
        for spec in prep.recipe.workers:
            group, path = self.roles[spec.name], prep.model_folders[spec.name]
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
            overlap=settings.residency.overlap,
        )
        owner.guard = WakeGuard(probes, owner.holders, timeout_s=timeout)
        owner.to_phase_state(prep.recipe.work_phase("generate"))
        self.async_mode, self.async_note = prep.async_mode, prep.async_note
        if self.async_note:  # a fall-back to synchronous turns is also in the plan's notes (prepare)
            log.log(logging.WARNING if self.async_mode == "sync" else logging.INFO, "%s", self.async_note)
        write_json(os.path.join(prep.run_dir, "residency.json"), residency.to_dict())  # what each phase may use

        pausing = rollout.partial_rollout and self.async_mode in ("split", "shared")
        # partial rollouts: an engine takes the pause, the weight update and the resume while a generate runs
        self.engines = engines = launch_engines(
            placed,
            role="rollout",
            backend=settings.engine.backend,
            engine_kwargs=self._engine_kwargs(),
            timeout_s=timeout,
            max_concurrency=4 if pausing else 1,
            env_vars=prep.mps.engine_env() if prep.mps else None,  # their SM share under the run's MPS daemon
        )
        self.engine_where = engines.call("where")
        owner.add_role("rollout", engines)
        clock.lap("engines started")

        self.weight_sync = WeightSync(
            prep.sync.mode,
            self.actor,
            engines,
            plan,
            bucket_bytes=settings.sync.bucket_bytes,
            backend=prep.sync.group_backend,
            transport=prep.sync.transport,
            timeout_s=timeout,
            verify=settings.sync.verify,
            adapter_only=_adapter_spec(prep) is not None,
        )
        self.weight_sync.setup()
        clock.lap("weight sync ready")

        tok = prep.tokenizer
        self.reward = RewardScorer(
            prep.reward_fn,
            lambda ids: tok.decode(ids, skip_special_tokens=False),
            normalize=algo.normalize_reward,
            clip_range=(*algo.reward_clip,),  # a tuple (a --config file gives a list)
            name=settings.models.reward_fn or f"of the {settings.models.task} task",
            timeout_s=timeout,
        )
        # Spans in wall-clock time so an outside sampler (GPU memory) can be matched to phases; kept on resume.
        self.timeline = TimelineWriter(
            os.path.join(prep.run_dir, "timeline.jsonl"), append=prep.resume_from is not None
        )
        kl_controller = (
            make_kl_controller(algo.kl_coef, target=algo.kl_target, horizon=algo.kl_horizon)
            if algo.uses_reference
            else None
        )
        self.agent: AgentRollout | None = None
        if prep.agent is not None:
            from .agents import AgentRollout

            limit = max_positions(prep.model_path)
            self.agent = AgentRollout(prep.agent, rollout, tok, context_limit=limit)
        self.ctx = StepContext(
            settings=settings,
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
            evaluation=self._evaluation(),
        )
        if prep.resume_from is not None:
            self._resume(prep.resume_from)

    def _evaluation(self) -> Any:
        """The run's evaluation (:mod:`.evaluation`), or None without held-out prompts: the rollout's sampling at the
        evaluation's temperature and samples per prompt."""
        from .evaluation import make_evaluation

        rollout = self.settings.rollout
        if not self.prep.eval_prompts:
            return None
        return make_evaluation(
            self.prep.eval_prompts,
            self.settings.evaluation,
            self.sampling(0),  # type: ignore[attr-defined]  # TrainingSession's (the step's sampling)
            total_steps=self.prep.total_steps,
            seed=rollout.seed,
            samples_per_step=rollout.samples_per_step,
        )

    def _engine_kwargs(self) -> dict[str, Any]:
        """Every engine's constructor arguments: the adapter's own (``engine_kwargs(settings, plan)``) from the
        run's engine section and what the run's plan says of the engines."""
        from hybrid_engines.adapter import EnginePlan
        from hybrid_engines.registry import engine_spec

        settings = self.settings
        plan = EnginePlan(
            model_path=self.prep.model_path,
            max_model_len=self.prep.max_model_len,
            shares_gpus=bool(self.prep.plan.shared_gpus("rollout")),
            seeded_sampling=self.seeded_sampling(),
            partial_rollout=settings.rollout.partial_rollout,
            lora=_adapter_spec(self.prep),  # adapter-only sync under LoRA
            max_images_per_prompt=settings.rollout.max_images_per_prompt,
        )
        return engine_spec(settings.engine.backend).engine_kwargs(settings.engine, plan)

    def seeded_sampling(self) -> bool:
        """A seed per sample? ``--seeded_sampling``, or where it is cheap (the built-in engine): vLLM / SGLang sample
        seeded requests one by one, and are seeded once from --seed instead."""
        from hybrid_engines.registry import engine_spec

        engine = self.settings.engine
        return engine_spec(engine.backend).seeds_samples(engine)


def _adapter_spec(prep: Any) -> Any:
    """The LoRA adapter the engines apply when the run's syncs carry it alone (``Prepared.lora_sync``), else None."""
    choice = getattr(prep, "lora_sync", None)  # a Prepared has it; stand-ins of one may not
    return choice.spec if choice is not None else None
