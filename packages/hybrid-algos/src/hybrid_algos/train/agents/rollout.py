"""The multi-turn rollout of a step: every sample a conversation with its own environment, all of them at once.

:meth:`AgentRollout.run` is what the rollout phase calls instead of one ``engines.generate`` (see
:func:`hybrid_algos.train.dynamic_sampling.sample_rollout`); it runs inside the generate phase, with the engines
awake, and moves nothing on or off a GPU. Each sample is a coroutine on one event loop (a thread of the driver,
kept for the whole run so that environments may hold connections between steps): its environment calls all run
concurrently, and its generation requests are batched turn by turn (:mod:`.batcher`).

The driver waits for the loop with a watchdog: a loop blocked by a synchronous call inside an ``async def``, or
samples waiting on neither the engines nor an environment call, end the run with an error naming the agent file
instead of hanging until the step's deadline.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..rollout_settings import AgentSettings, RolloutSettings
from .batcher import Flush, TurnBatcher
from .conversation import Conversation, from_openrlhf
from .environment import ShapeError, coerce_reset, coerce_step
from .guard import CURRENT, AgentError, Guard, SampleFailed, SampleState, guard_instances
from .loader import AgentSpec
from .openrlhf_engine import AgentEngine, AgentSamplingParams
from .templates import TINY_CHAT_TEMPLATE, Renderer

log = logging.getLogger(__name__)

#: How long the event loop may stop answering, or the samples stop moving, beyond --agent_timeout_s (at most).
WATCHDOG_GRACE_S = 30.0


@dataclass
class AgentBatch:
    """One call's conversations (``conversations[g][j]``: sample ``j`` of prompt ``g``) and its timeline."""

    conversations: list[list[Conversation]]
    flushes: list[Flush]
    start: float  # time.perf_counter()
    end: float
    failures: list[str] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def reset_seconds(self) -> float:
        """Before the first turn's batch: the environments' resets."""
        return (self.flushes[0].start if self.flushes else self.end) - self.start

    @property
    def outputs(self) -> list[list[Any]]:
        return [[c.output() for c in group] for group in self.conversations]

    @property
    def rewards(self) -> torch.Tensor:
        return torch.tensor([c.reward for g in self.conversations for c in g], dtype=torch.float32)


class AgentRollout:
    """Runs a step's samples as conversations with ``spec``'s environment (see the module docstring), under the
    rollout section's agent limits."""

    def __init__(self, spec: AgentSpec, rollout: RolloutSettings, tokenizer: Any, *, context_limit: int | None = None):
        self.spec, self.tokenizer = spec, tokenizer
        self.settings: AgentSettings = rollout.agent_settings(spec.builtin)
        chat = rollout.apply_chat_template or spec.builtin
        if spec.builtin and not getattr(tokenizer, "chat_template", None):
            tokenizer.chat_template = TINY_CHAT_TEMPLATE  # the tiny tokenizer's messages: the tasks' prompt format
        self.renderer = Renderer(tokenizer, chat_template=chat and spec.kind == "environment")
        self.context_limit = context_limit
        self.guard = Guard(spec.source, self.settings.timeout_s, self.settings.on_error, self.settings.max_turns)
        if spec.kind == "openrlhf":
            guard_instances(spec.executor, self.guard)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._beat = time.monotonic()
        self._heartbeat: asyncio.Task[None] | None = None  # the loop's heartbeat task (_start_loop)
        self._broken: str | None = None

    # ---- the driver's side ---------------------------------------------------------------------------------------
    def run(self, engines: Any, prompts: Sequence[Any], sampling: Any, step: int) -> AgentBatch:
        """``sampling.n`` conversations per prompt; ``sampling.max_new_tokens`` bounds each whole response."""
        if self._broken:
            raise AgentError(self._broken)
        loop = self._start_loop()
        self.renderer.stop_ids.update(sampling.stop_token_ids)
        states: list[SampleState] = []
        batcher = TurnBatcher(engines, sampling, context_limit=self.context_limit)
        done: concurrent.futures.Future = concurrent.futures.Future()
        context = contextvars.copy_context()  # the step's deadline (hybrid_core.remote) reaches the engine calls
        holder: dict[str, asyncio.Task] = {}

        def start() -> None:
            task = context.run(loop.create_task, self._rollout(batcher, list(prompts), sampling, step, states))
            holder["task"] = task
            task.add_done_callback(lambda t: _settle(done, t))

        loop.call_soon_threadsafe(start)
        progress = [time.monotonic(), 0]
        while True:
            try:
                batch = done.result(timeout=0.5)
            except concurrent.futures.TimeoutError:
                self._watch(batcher, states, progress, loop, holder)
                continue
            warn_cut_samples(batch, self.spec.source, self.settings.max_turns, self.spec.builtin)
            return batch

    def close(self) -> None:
        """Stop the event loop (its tasks cancelled first). A loop a blocking call holds is left to the process."""
        loop, thread = self._loop, self._thread
        self._loop = self._thread = None
        if loop is None or thread is None or self._broken:
            return

        async def cancel_all() -> None:
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in others:
                t.cancel()
            await asyncio.gather(*others, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(cancel_all(), loop).result(timeout=10)
        except Exception:  # tearing down: a stuck task must not hide what ended the run
            log.debug("agent loop: cancelling its tasks failed", exc_info=True)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        if not thread.is_alive():
            loop.close()

    def _start_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is not None:
            return self._loop
        loop = asyncio.new_event_loop()

        async def heartbeat() -> None:
            while True:
                self._beat = time.monotonic()
                await asyncio.sleep(0.25)

        def serve() -> None:
            asyncio.set_event_loop(loop)
            # the loop keeps only a weak reference to its tasks: this one is kept until the loop ends
            self._heartbeat = loop.create_task(heartbeat())
            loop.run_forever()

        self._beat = time.monotonic()
        self._thread = threading.Thread(target=serve, name="hybrid-agent-loop", daemon=True)
        self._thread.start()
        self._loop = loop
        return loop

    def _watch(self, batcher: TurnBatcher, states: list[SampleState], progress: list, loop, holder) -> None:
        """Raise when the loop is blocked, or when no sample has moved for longer than any call may take."""
        now = time.monotonic()
        limit = self.settings.timeout_s + min(WATCHDOG_GRACE_S, self.settings.timeout_s)
        source = self.spec.source
        if now - self._beat > limit:
            self._broken = (
                f"agent {source}: the environments' event loop has been blocked for {now - self._beat:.0f} "
                "s: a reset or step defined with async def makes a blocking call (time.sleep, requests, "
                "subprocess.run...). Fix: await asynchronous I/O (asyncio.sleep, aiohttp, "
                "asyncio.create_subprocess_exec), or make the method a plain def (hybrid then runs it in "
                "a thread)."
            )
            raise AgentError(self._broken)
        moved = (len(batcher.flushes), sum(s.turns for s in states), batcher.live)
        if moved != progress[1] or batcher.busy or any(s.env_calls for s in states):
            progress[0], progress[1] = now, moved
            return
        if now - progress[0] > limit and batcher.live > 0:
            stuck = [s.index for s in states if s.env_calls == 0][:8]
            task = holder.get("task")
            if task is not None:
                loop.call_soon_threadsafe(task.cancel)
            raise AgentError(
                f"agent {source}: {batcher.live} samples (e.g. {stuck}) have waited {now - progress[0]:.0f} "
                "s on neither the engine nor an environment call. Fix: the executor's execute must "
                "only await llm_engine.generate and its AgentInstance (or give what else it awaits a "
                "timeout)."
            )

    # ---- the event loop's side -----------------------------------------------------------------------------------
    async def _rollout(
        self, batcher: TurnBatcher, prompts: list, sampling: Any, step: int, states: list[SampleState]
    ) -> AgentBatch:
        t0 = time.perf_counter()
        n = sampling.n
        flat = [(g, prompt) for g, prompt in enumerate(prompts) for _ in range(n)]
        states += [SampleState(step, i, prompt.text) for i, (_, prompt) in enumerate(flat)]
        batcher.add_samples(len(flat))  # all at once: the first batch waits for every sample's first turn
        tasks = [
            asyncio.get_running_loop().create_task(self._sample(batcher, prompt, state, sampling))
            for (_, prompt), state in zip(flat, states)
        ]
        finished, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        errors = [e for t in finished if not t.cancelled() and (e := t.exception()) is not None]
        if errors:
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            raise errors[0]
        conversations: list[list[Conversation]] = [[] for _ in prompts]
        for (g, _), t in zip(flat, tasks):
            conversations[g].append(t.result())
        failures = [c.failed for group in conversations for c in group if c.failed]
        if failures and len(failures) == len(flat):
            raise AgentError(
                f"agent {self.spec.source}: every sample of step {step + 1} failed; the first: {failures[0]}"
            )
        return AgentBatch(conversations, list(batcher.flushes), t0, time.perf_counter(), failures)

    async def _sample(self, batcher: TurnBatcher, prompt: Any, state: SampleState, sampling: Any) -> Conversation:
        CURRENT.set(state)
        try:
            if self.spec.kind == "openrlhf":
                return await self._openrlhf_sample(batcher, prompt, state, sampling)
            return await self._native_sample(batcher, prompt, state, sampling.max_new_tokens)
        except SampleFailed as e:
            log.warning("%s", e)
            return Conversation(list(prompt.prompt_ids), failed=str(e), turns=state.turns)
        finally:
            batcher.sample_done()

    async def _native_sample(self, batcher: TurnBatcher, prompt: Any, state: SampleState, budget: int) -> Conversation:
        guard, spec, settings = self.guard, self.spec, self.settings
        try:
            assert spec.factory is not None  # kind "environment" (not "openrlhf"): the loader gave its factory
            env = spec.factory()
        except Exception as e:
            log.error("agent %s: creating the environment raised:", spec.source, exc_info=e)
            guard.fail(
                state,
                "creating the environment",
                f"raised {type(e).__name__}: {e}",
                "the class (or factory) must build with no arguments",
                e,
            )
        try:
            first = None
            if callable(getattr(env, "reset", None)):
                first = await guard.call(state, "reset", env.reset, prompt.text, prompt.label)
                try:
                    first = coerce_reset(first)
                except ShapeError as e:
                    guard.shape(state, "reset", e, "return the first message as a str, or None to keep the prompt")
            conv = Conversation(list(prompt.prompt_ids) if first is None else self.renderer.first_message(first))
            while True:
                left = budget - len(conv.response)
                out = await batcher.generate(
                    conv.prompt_ids + conv.response, min(left, settings.turn_tokens or left), sample=state.index
                )
                state.turns = conv.turns = conv.turns + 1
                conv.add_turn(out.token_ids, out.logprobs, out.weight_versions)
                conv.finish_reason = out.finish_reason
                answer = await guard.call(state, "step", env.step, self.renderer.action_text(out.token_ids))
                try:
                    result = coerce_step(answer)
                except ShapeError as e:
                    guard.shape(state, "step", e, "return StepResult(feedback=str, reward=float, done=bool)")
                conv.reward += result.reward
                conv.score, conv.info = conv.reward, result.info
                if result.done:
                    break
                if conv.turns >= settings.max_turns:
                    conv.hit_max_turns = state.hit_max_turns = True
                    break
                reply = self.renderer.feedback(result.feedback, result.role, out.token_ids)
                if len(conv.response) + len(reply) >= budget:  # no room for the reply and another turn
                    conv.overflow_tokens = len(conv.response) + len(reply) + 1 - budget
                    conv.finish_reason = "length"
                    break
                conv.add_feedback(reply)
            return conv
        finally:
            await _close(env, spec.source)

    async def _openrlhf_sample(
        self, batcher: TurnBatcher, prompt: Any, state: SampleState, sampling: Any
    ) -> Conversation:
        settings, budget = self.settings, sampling.max_new_tokens
        engine = AgentEngine(
            batcher, state, self.tokenizer, self.renderer, budget, settings.turn_tokens, max_turns=settings.max_turns
        )
        params = AgentSamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_tokens=settings.turn_tokens or budget,
            min_tokens=sampling.min_new_tokens,
        )
        max_length = len(self.renderer.encode(prompt.text)) + budget
        try:
            result = await self.spec.executor.execute(
                prompt.text, prompt.label, params, max_length, self.tokenizer, engine
            )
        except (SampleFailed, AgentError):
            raise
        except Exception as e:
            log.error("agent %s: AgentExecutor.execute raised (%s):", self.spec.source, state.where(), exc_info=e)
            self.guard.fail(
                state,
                "AgentExecutor.execute",
                f"raised {type(e).__name__}: {e}",
                "fix the executor (the traceback is in the log above)",
                e,
            )
        try:
            conv = from_openrlhf(result, engine.generations, budget)
        except ShapeError as e:
            self.guard.shape(
                state,
                "AgentExecutor.execute",
                e,
                "return the dict OpenRLHF's MultiTurnAgentExecutor "
                "returns (observation_tokens, action_ranges, reward, scores, ...)",
            )
        conv.hit_max_turns = state.hit_max_turns
        if state.env_done:  # OpenRLHF appends a last reply after done: cutting it ends nothing
            conv.overflow_tokens = 0
        conv.info = {**state.extra, **conv.info}
        return conv


def _settle(future: concurrent.futures.Future, task: asyncio.Task) -> None:
    if future.done():
        return
    if task.cancelled():
        future.set_exception(AgentError("the agent rollout was cancelled"))
    elif task.exception() is not None:
        future.set_exception(task.exception())
    else:
        future.set_result(task.result())


async def _close(env: Any, source: str) -> None:
    """An environment's ``close()`` (plain or async), if it has one; a failure there is logged, not raised."""
    close = getattr(env, "close", None)
    if not callable(close):
        return
    try:
        result = close()
        if asyncio.iscoroutine(result):
            await asyncio.wait_for(result, 10)
    except Exception as e:
        log.warning("agent %s: close() raised %s: %s", source, type(e).__name__, e)


# ---- metrics -----------------------------------------------------------------------------------------------------
def summarize(batches: Sequence[AgentBatch]) -> dict[str, float]:
    """The step's agent metrics (``agent/...``) over every conversation generated (all dynamic-sampling rounds).

    Per turn ``t``: ``agent/turn{t}/generate_s`` (the engines' time for that turn's batch), ``env_s`` (from the
    end of that batch to the next one: the environments' steps), ``samples`` (conversations that reached it),
    ``model_tokens`` / ``env_tokens`` (means over those)."""
    convs = [c for b in batches for g in b.conversations for c in g]
    if not convs:
        return {}
    n = len(convs)
    seconds = sum(b.seconds for b in batches)
    gen_s = sum(f.end - f.start for b in batches for f in b.flushes)
    model = sum(sum(c.action_mask) for c in convs)
    total = sum(len(c.response) for c in convs)
    m: dict[str, float] = {
        "agent/turns": sum(c.turns for c in convs) / n,
        "agent/turns_max": float(max(c.turns for c in convs)),
        "agent/model_tokens": model / n,
        "agent/env_tokens": (total - model) / n,
        "agent/rollout_s": seconds,
        "agent/generate_s": gen_s,
        "agent/env_s": max(seconds - gen_s, 0.0),
        "agent/reset_s": sum(b.reset_seconds for b in batches),
        "agent/tokens_per_s": model / seconds if seconds > 0 else 0.0,
        "agent/max_turns_frac": sum(c.hit_max_turns for c in convs) / n,
        "agent/overflow_frac": sum(c.overflow_tokens > 0 for c in convs) / n,
        "agent/failed_samples": float(sum(c.failed is not None for c in convs)),
        "agent/score": sum(c.score for c in convs) / n,
    }
    by_turn: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for c in convs:
        for t, seg in enumerate(c.segments(), start=1):
            by_turn[t].append(seg)
    for b in batches:
        for k, f in enumerate(b.flushes):
            nxt = b.flushes[k + 1].start if k + 1 < len(b.flushes) else b.end
            key = f"agent/turn{f.index + 1}"
            m[f"{key}/generate_s"] = m.get(f"{key}/generate_s", 0.0) + (f.end - f.start)
            m[f"{key}/env_s"] = m.get(f"{key}/env_s", 0.0) + max(nxt - f.end, 0.0)
    for t, segs in sorted(by_turn.items()):
        m[f"agent/turn{t}/samples"] = float(len(segs))
        m[f"agent/turn{t}/model_tokens"] = sum(s[0] for s in segs) / len(segs)
        m[f"agent/turn{t}/env_tokens"] = sum(s[1] for s in segs) / len(segs)
    infos: dict[str, list[float]] = defaultdict(list)
    for c in convs:
        for name, value in c.info.items():
            infos[name].append(value)
    m.update({f"agent/info/{k}": sum(v) / len(v) for k, v in infos.items()})
    return m


def warn_cut_samples(batch: AgentBatch, source: str, max_turns: int, builtin: bool) -> None:
    """One warning per kind of cut sample in a call, naming the agent file and the fix."""
    convs = [c for g in batch.conversations for c in g]
    cut = sum(c.hit_max_turns for c in convs)
    if cut and not builtin:  # the built-in task's model may call its tool until the last turn: that is its choice
        log.warning(
            "agent %s: %d of %d samples were not done after --max_turns %d turns and ended there (their "
            "reward is what their turns earned). Fix: end episodes (done=True), or raise --max_turns.",
            source,
            cut,
            len(convs),
            max_turns,
        )
    over = [c for c in convs if c.overflow_tokens]
    if over:
        log.warning(
            "agent %s: in %d of %d samples the environment's reply did not fit the response budget "
            "(--generate_max_len, turns and replies together; %d tokens over at most); those samples ended "
            "there. Fix: keep replies short (cut long tool output), or raise --generate_max_len.",
            source,
            len(over),
            len(convs),
            max(c.overflow_tokens for c in over),
        )
