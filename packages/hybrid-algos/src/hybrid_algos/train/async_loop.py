"""Asynchronous training: a producer thread on the driver generates the batches ahead of the trainer, the trainer
takes them in order, and the weights go over at the boundary between two steps.

One rule makes it exact and bounded: batch ``j`` is generated once the engines hold version ``j - N``
(``N = --async_max_staleness``), and the weight update after step ``t`` (to version ``t + 1``) waits until batch
``t + N`` -- the last one that version ``t`` must generate -- is done. Every batch is then generated with version
``max(0, j - N)`` whatever the timing, so a seeded run generates the same samples as another, a resumed run the same
as an uninterrupted one, and a sample is at most N versions old when it is trained on (checked before each step:
:func:`~.async_rollout.check_staleness`).

With ``--partial_rollout`` the update does not wait: a generation in flight is paused between two decoding steps
(:class:`hybrid_engines.protocol.PausableEngine`), the weights go over, and it resumes with them; its tokens carry
the version that sampled them, and the mismatch correction -- the engine's log-probs are the behaviour policy,
token by token -- covers both parts. Such runs depend on timing, so they are not reproducible step for step.

Checkpoints lose nothing (:meth:`AsyncRunner.checkpoint_state`): they keep every batch generated ahead of the trainer,
and the generation in flight (or due to start) as a record -- its step, weight version, prompts and sampling seed.
``--resume`` trains on the kept batches and makes the one in flight again first, from that record, with the
restored weights, which are the version the rule above gives it: the same batch, token for token, where the engine
seeds each sample (the built-in engine, or ``--seeded_sampling``). With partial rollouts, whose batches depend on
timing, it is made with the restored weights only.

Bounded: the trainer waits at most ``--step_timeout_s`` for a batch and the boundary as long for a generation to
end; past that the run ends with an error naming the rollout role and the step it was generating (with every
role's stacks). A failure in the producer ends the run with that failure, named the same way.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

from hybrid_core.errors import RemoteTimeout
from hybrid_core.stats import PhaseTimer

from .async_rollout import Batch, batch_from_json, batch_to_json, check_staleness, make_batch, staleness_metrics
from .dynamic_sampling import sample_rollout
from .step import train_on


class AsyncRunner:
    """The producer thread and the trainer's side of the queue (made by :class:`.session.TrainingSession`)."""

    def __init__(
        self, session: Any, mode: str, restored: list[dict] | None = None, in_flight: dict[str, Any] | None = None
    ):
        rollout = session.settings.rollout
        self.session, self.ctx, self.mode = session, session.ctx, mode
        self.max_staleness = rollout.async_max_staleness
        self.partial = rollout.partial_rollout
        self.timeout_s = session.settings.run.step_timeout_s
        self.total = session.prep.total_steps
        self.cv = threading.Condition()
        self.queue: dict[int, Batch] = {}
        for data in restored or []:
            batch = batch_from_json(data, session.prep.prompts)
            if batch.step >= session.start_step:
                self.queue[batch.step] = batch
        self.version = session.start_step  # the engines' weights: restored ones after a resume
        self.next_gen = max(self.queue, default=session.start_step - 1) + 1
        # The generation a checkpoint caught in flight (or due to start): the resumed producer makes it first, from
        # the prompts and seed the checkpoint recorded (see :meth:`checkpoint_state`).
        self.replay: tuple[int, list, int | None] | None = None
        if in_flight is not None:
            j, prompts, seed = _in_flight_from_json(in_flight, session.prep.prompts)
            if j == self.next_gen:
                self.replay = (j, prompts, seed)
        self.generating: int | None = None
        self.generating_what: tuple[list, int | None, int] | None = None  # its prompts, sampling seed, version
        self.holding = False  # a weight update is under way: no new generation starts
        self.error: BaseException | None = None
        self.stopped = False
        self.thread: threading.Thread | None = None
        self.paused = 0  # generations paused at this step's weight update (partial rollouts)
        session.engines.set_weight_version(self.version)

    # ---- producer ----------------------------------------------------------------------------------------------
    def start(self) -> None:
        self.thread = threading.Thread(target=self._produce, name="hybrid-rollout-producer", daemon=True)
        self.thread.start()

    def _produce(self) -> None:
        from hybrid_core.remote import deadline

        j: int | None = None
        try:
            while True:
                with self.cv:
                    while not self._may_generate():
                        if self.stopped or self.next_gen >= self.total:
                            return
                        self.cv.wait(1.0)
                    j, version = self.next_gen, self.version
                    prompts, sampling = self._inputs(j)
                    self.generating, self.generating_what = j, (prompts, sampling.seed, version)
                start = time.time()
                with deadline(self.timeout_s, f"generating step {j + 1} (asynchronous)"):
                    sampled = sample_rollout(self.ctx, j, prompts, sampling)
                batch = make_batch(j, sampled, version, start, time.time())
                with self.cv:
                    self.queue[j] = batch
                    self.generating, self.generating_what, self.next_gen = None, None, j + 1
                    self.cv.notify_all()
        except BaseException as error:  # the trainer re-raises it, named after the step it was generating
            with self.cv:
                self.error = error if j is None else _named(error, j)
                self.cv.notify_all()

    def _inputs(self, j: int) -> tuple[list, Any]:
        """Batch ``j``'s prompts and sampling parameters: the checkpoint's record of the generation it caught in
        flight, else the data order's (:meth:`.session.TrainingSession.prompts_for`: a function of --seed and the
        step, as is the sampling seed). Dynamic sampling's extra rounds draw theirs from (seed, step, round)."""
        import dataclasses

        sampling = self.session.sampling(j)
        if self.replay is not None and self.replay[0] == j:
            _, prompts, seed = self.replay
            return list(prompts), dataclasses.replace(sampling, seed=seed)
        return self.session.prompts_for(j), sampling

    def _may_generate(self) -> bool:
        return (
            not self.stopped
            and not self.holding
            and self.error is None
            and self.next_gen < self.total
            and self.version >= self.next_gen - self.max_staleness
        )

    # ---- trainer -----------------------------------------------------------------------------------------------
    def step(self, step: int) -> dict[str, float]:
        """Train on batch ``step`` (waiting for it), with the weight update at the end; the step's metrics."""
        t0 = time.perf_counter()
        batch = self.session.guarded(f"step {step + 1}: waiting for its rollout", lambda: self._take(step))
        waited = time.perf_counter() - t0
        age = check_staleness(batch, step, self.max_staleness)  # the trainer holds version `step` now
        timer = PhaseTimer()
        timer.spans.append(("generate", batch.start, batch.end))  # the timeline shows it next to the trainer's phases
        metrics, _ = self.session.guarded(
            f"step {step + 1}",
            lambda: train_on(
                self.ctx, step, batch.sampled, self.session.sampling(step), timer, t0, sync=lambda: self._boundary(step)
            ),
        )
        metrics.update(staleness_metrics(batch, step))
        metrics["async/staleness_max"] = float(age)
        metrics["async/wait_s"] = waited
        metrics["async/paused_generation"] = float(self.paused)  # partial rollouts: one was paused at the update
        self.paused = 0
        metrics["time/generate"] = batch.end - batch.start  # ran alongside the trainer: not part of time/step
        return metrics

    def _take(self, step: int) -> Batch:
        ends = time.monotonic() + self.timeout_s
        with self.cv:
            while step not in self.queue:
                self._raise_producer_error()
                left = ends - time.monotonic()
                if left <= 0 or (self.thread is not None and not self.thread.is_alive() and step not in self.queue):
                    raise RemoteTimeout(self._stalled(f"the batch of step {step + 1}"))
                self.cv.wait(min(left, 1.0))
            return self.queue.pop(step)

    def _boundary(self, step: int):
        """The weight update after ``step`` (to version ``step + 1``), between two generations or, with partial
        rollouts, in the middle of one."""
        engines, sync = self.session.engines, self.ctx.weight_sync
        last_needed = step + self.max_staleness  # the last batch generated with version `step`
        with self.cv:
            if not self.partial:  # wait for version `step`'s last batch (the producer may still have to start it)
                ends = time.monotonic() + self.timeout_s
                while self.generating is not None or (
                    self.next_gen <= last_needed and self.next_gen < self.total and not self.stopped
                ):
                    self._raise_producer_error()
                    left = ends - time.monotonic()
                    if left <= 0:
                        raise RemoteTimeout(self._stalled(f"the weight update after step {step + 1}"))
                    self.cv.wait(min(left, 1.0))
            self.holding = True  # no generation starts during the update
            in_flight = self.generating is not None
            self.paused = int(in_flight)
        try:
            if in_flight:  # partial rollouts: park the running generation; its tokens so far keep version `step`
                engines.pause_generation(timeout_s=self.timeout_s)
            try:
                stats = sync.sync(wake_engines=False)
                engines.set_weight_version(step + 1)
            finally:
                if in_flight:
                    engines.resume_generation(timeout_s=self.timeout_s)
        finally:
            with self.cv:
                self.version = step + 1
                self.holding = False
                self.cv.notify_all()
        return stats

    def _raise_producer_error(self) -> None:
        if self.error is not None:  # the engines' errors name the role and rank; _named adds the step
            raise self.error

    def _stalled(self, what: str) -> str:
        doing = (
            f"generating step {self.generating + 1}"
            if self.generating is not None
            else f"waiting to generate step {self.next_gen + 1} (engines at weight version {self.version})"
        )
        return (
            f"rollout (asynchronous producer): {what} did not come within {self.timeout_s:g} s "
            f"(--step_timeout_s); the producer is {doing}."
        )

    def has(self, step: int) -> bool:
        """Whether batch ``step`` comes from the producer (after :meth:`stop_producing`, only those it made)."""
        with self.cv:
            return not self.stopped or step in self.queue or self.generating == step

    def stop_producing(self) -> None:
        """No new generation (the run goes on in synchronous turns). Returns once a generation in flight has landed
        in the queue: from then on the residency owner may move the engines."""
        ends = time.monotonic() + self.timeout_s
        with self.cv:
            self.stopped = True
            self.cv.notify_all()
            while self.generating is not None:
                self._raise_producer_error()
                left = ends - time.monotonic()
                if left <= 0:
                    raise RemoteTimeout(self._stalled("the end of the generation in flight"))
                self.cv.wait(min(left, 1.0))

    # ---- checkpoints and tear-down -----------------------------------------------------------------------------
    def checkpoint_state(self, next_step: int) -> dict[str, Any]:
        """What a checkpoint that resumes at ``next_step`` keeps of the producer (JSON, in the driver state), taken at
        one moment: ``async_queue``, every batch generated ahead for steps >= ``next_step``, and ``async_in_flight``,
        the generation running (or due to start: the engines hold the version it needs) -- its step, the weight
        version it uses, its prompts (indices into the prompt set) and sampling seed -- or None. A resumed run trains
        on the queue and makes the generation in flight again first, from these prompts and this seed, with the
        restored weights: the version the rule gives it (see the module docstring), so it is the same batch."""
        prompts = self.session.prep.prompts
        index = {id(p): i for i, p in enumerate(prompts)}
        with self.cv:
            batches = [self.queue[j] for j in sorted(self.queue) if j >= next_step]
            if self.generating is not None and self.generating_what is not None:
                j, (step_prompts, seed, version) = self.generating, self.generating_what
            elif self._may_generate():  # the producer is about to start it
                j, version = self.next_gen, self.version
                step_prompts, sampling = self._inputs(j)
                seed = sampling.seed
            else:
                j = None
        in_flight = None
        if j is not None and j >= next_step:
            in_flight = {"step": j, "version": version, "prompts": [index[id(p)] for p in step_prompts], "seed": seed}
        return {"async_queue": [batch_to_json(b, index) for b in batches], "async_in_flight": in_flight}

    def close(self) -> None:
        with self.cv:
            self.stopped = True
            self.cv.notify_all()
        if self.thread is not None:
            self.thread.join(5.0)  # a generation in flight ends with the engines' shutdown


def _in_flight_from_json(data: dict[str, Any], prompts: Any) -> tuple[int, list, int | None]:
    from .checkpoint import CheckpointError

    try:
        seed = data["seed"]
        return int(data["step"]), [prompts[int(i)] for i in data["prompts"]], None if seed is None else int(seed)
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise CheckpointError(
            f"the checkpoint's record of the generation in flight is damaged ({type(e).__name__}: {e}). "
            "Fix: resume from an earlier checkpoint (delete this one), or start fresh."
        ) from None


def _named(error: BaseException, step: int) -> BaseException:
    """The producer's failure, saying it happened generating batch ``step`` (the trainer, which raises it, is at an
    earlier step: its own label names that one). A hybrid error becomes one of its type whose message starts with
    it (``error`` its cause); any other (a bug: its traceback is what matters) is kept, with a note on 3.11+."""
    from hybrid_core.errors import ConfigError, HybridError

    what = f"the asynchronous rollout producer, generating step {step + 1}"
    try:
        if isinstance(error, ConfigError):
            named: BaseException = type(error)(error.field, f"{what}: {error.problem}", error.fix)
        elif isinstance(error, HybridError):
            named = type(error)(f"{what}: {error}")
            named.__dict__.update(error.__dict__)  # e.g. dump_stacks
        else:
            return _noted(error, what)
    except TypeError:  # an error type with its own constructor arguments
        return _noted(error, what)
    named.__cause__ = error
    return named


def _noted(error: BaseException, what: str) -> BaseException:
    if sys.version_info >= (3, 11):  # add_note is 3.11's (3.10 raises the error without the note)
        error.add_note(f"(raised by {what})")
    return error
