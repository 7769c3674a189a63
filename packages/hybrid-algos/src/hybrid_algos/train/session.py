"""The live job (:class:`TrainingSession`): the per-step driver — each step's prompts and sampling, the steps in
order (from the asynchronous producer's queue when there is one), checkpoints every ``--save_steps``, SIGTERM's
checkpoint, the residency refinement after steps 1, 2, 4, 8, ... — every remote call under the step's deadline
(:meth:`~TrainingSession.guarded`), and the tear-down. Its set-up is :mod:`.session_start`, its saves
:mod:`.session_saves`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import random
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hybrid_core.errors import HybridError

from .profiling import profile_folder, profiled_step
from .session_start import SessionStart
from .session_state import write_json
from .step import run_step

if TYPE_CHECKING:
    from .async_loop import AsyncRunner

log = logging.getLogger(__name__)


class TrainingSession(SessionStart):
    """The live job: placement group, turnstile, role groups, engines, weight sync, checkpoints."""

    # ---- the steps -------------------------------------------------------------------------------------------------
    def sampling(self, step: int):
        from hybrid_engines.protocol import SamplingParams

        rollout = self.settings.rollout
        eos = self.prep.tokenizer.eos_token_id
        seeded = self.seeded_sampling()
        return SamplingParams(
            temperature=rollout.temperature,
            top_p=rollout.top_p,
            top_k=rollout.top_k,
            max_new_tokens=self.prep.max_new_tokens,
            n=rollout.n_samples_per_prompt,
            stop_token_ids=(eos,) if eos is not None else (),
            seed=rollout.seed * 1_000_003 + step if seeded else None,
            logprobs=self.settings.algorithm.wants_engine_logprobs,
        )

    def prompts_for(self, step: int) -> list:
        """Step ``step``'s prompts: episode-seeded shuffles of the prompt set, so a resumed run sees the same order."""
        rollout = self.settings.rollout
        prompts, bs = self.prep.prompts, rollout.rollout_batch_size
        per_episode = len(prompts) // bs
        episode, index = divmod(step, per_episode)
        order = list(range(len(prompts)))
        random.Random(rollout.seed + episode).shuffle(order)
        return [prompts[i] for i in order[index * bs : (index + 1) * bs]]

    def run(self, callbacks: Sequence[Any]) -> dict[str, Any]:
        run = self.settings.run
        total = self.prep.total_steps
        saved_at = self.start_step if self.prep.resume_from is not None else None
        preemption = self.preemption
        if self.async_mode in ("split", "shared"):
            from .async_loop import AsyncRunner

            self.runner = AsyncRunner(self, self.async_mode, self.restored_queue, self.restored_in_flight)
            self.runner.start()
        owner = self.started_owner
        advisor = _share_advisor(self.prep.mps)
        for step in range(self.start_step, total):
            owner.tag = step
            # the asynchronous producer's batch of this step, if it has one
            producer = self.runner if self.runner is not None and self.runner.has(step) else None
            if preemption is not None:  # SIGTERM from here on lets the step (and its checkpoint) finish first
                preemption.deferring, preemption.step = True, step + 1  # (no gap between steps: off after the loop)
            try:
                with (
                    profiled_step(self.groups, profile_folder(self.prep.run_dir, step + 1))
                    if step + 1 == run.profile_step
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
            if advisor is not None and self.async_mode == "shared":  # both sides at once: the SM split matters
                metrics.update(_advise_shares(advisor, step, metrics))
            self.history.append(metrics)
            evaluated = "eval/reward_mean" in metrics  # an evaluation step is logged whatever --logging_steps says
            if (step + 1) % run.logging_steps == 0 or step + 1 == total or evaluated:
                emit(callbacks, "on_step", metrics)
            if run.save_steps > 0 and (step + 1) % run.save_steps == 0:
                owner.tag = f"checkpoint {step + 1}"
                self.guarded(f"the checkpoint after step {step + 1}", functools.partial(self.save_checkpoint, step + 1))
                saved_at = step + 1
            if preemption is not None and preemption.requested:
                self._stop_on_sigterm(step + 1, saved_at)
        if preemption is not None:
            preemption.deferring = False  # the final saves: SIGTERM stops them at once (the last checkpoint stands)
        # A run that can be continued is the default: the last step gets a checkpoint unless it has one already.
        end = max(total, self.start_step)
        if run.final_checkpoint and saved_at != end:
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
        mode, note = async_mode(self.settings.rollout, self.prep.plan, self.prep.residency)
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
        from .placement import replan
        from .sections import flag_words

        owner = self.started_owner
        plan = owner.plan
        with flag_words():  # a plan that no longer fits: core's error names the residency settings
            result = owner.refine(
                after_step,
                lambda overhead: replan(
                    self.settings, plan.layout, plan.gpu_bytes, overhead=overhead, host=plan.host, phases=plan.phases
                ),
            )
        if result is None:  # nothing to measure without CUDA (the guard is off)
            return {}
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
        self.prep.residency = refined  # the owner's already (owner.refine)
        write_json(os.path.join(self.prep.run_dir, "residency.json"), refined.to_dict())
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
            with deadline(self.settings.run.step_timeout_s, label):
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
                limit = min(10.0 if hurry else 60.0, self.settings.run.call_timeout_s)
                self.engines.shutdown(timeout_s=limit)  # then killed
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


def emit(callbacks: Sequence[Any], event: str, payload: Any) -> None:
    for cb in callbacks:
        fn = getattr(cb, event, None)
        if fn is not None:
            fn(payload)


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0].rstrip(".") if lines else type(error).__name__


def _share_advisor(mps: Any) -> Any:
    """A :class:`hybrid_core.mps_daemon.ShareAdvisor` when the run started its own MPS daemon, else None."""
    from hybrid_core.mps_daemon import ShareAdvisor

    return ShareAdvisor(mps.shares) if mps is not None and mps.start else None


def _advise_shares(advisor: Any, step: int, metrics: dict[str, float]) -> dict[str, float]:
    """The step's ``mps/*`` metrics from its phase times (the trainer side: its inference passes and training)."""
    trainer_s = metrics.get("time/train", 0.0) + metrics.get("time/infer", 0.0)
    found, note = advisor.observe(step, metrics.get("time/generate", 0.0), trainer_s)
    if note:
        log.info("note: %s", note)
    return found


def _refines_after(steps_done: int) -> bool:
    """Refine the residency plan after the 1st, 2nd, 4th, 8th, ... step of a run (``steps_done``: 0, 1, 3, 7, ...)."""
    return steps_done & (steps_done + 1) == 0
