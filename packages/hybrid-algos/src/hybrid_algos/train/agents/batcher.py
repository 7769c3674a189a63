"""Many conversations, one engine call per turn: the samples' generation requests, gathered into batches.

Each sample runs as its own coroutine and asks for its next turn with ``await batcher.generate(...)``. A batch goes
to the engines when *every* sample still running is waiting for a turn; until then the others are still in their
environment step (which all run concurrently). So the n-th batch holds exactly the samples' n-th turns, whatever
the timing of the environments:

* reproducible: a batch's contents, order and seed depend on the samples, not on which environment answered first
  (requests are ordered by their sample's index, not by arrival), and the engines key each row's randomness on its
  prompt and its repeats within the call (hybrid_engines' ``row_seed``), so identical contexts in one batch (the n
  samples of a prompt in turn 1, or two samples whose turns so far are the same) still differ -- and each sample
  gets the same one of them in every run;
* efficient on a batch engine: one call per turn, split over the engines by EngineGroup. Each conversation is
  sent whole every turn; vLLM's prefix cache (``--enable_prefix_caching``) finds the turns before in its cache.

A turn's new-token cap differs per sample (what is left of its budget); a batch asks the engines for the largest
cap and cuts each completion to its own (the tokens kept are exactly what a call with that cap would sample first).
Requests whose context plus that cap would pass ``context_limit`` (the model's positions) go in another call.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import struct
import time
from dataclasses import dataclass
from typing import Any

from hybrid_engines.protocol import GenerationOutput, SamplingParams


@dataclass(frozen=True)
class TurnSampling:
    """The sampling settings of one request (OpenRLHF agents may change them between turns)."""

    temperature: float
    top_p: float
    top_k: int
    min_new_tokens: int = 0


@dataclass
class Flush:
    """One batch sent to the engines: when, how many rows, how many new tokens came back."""

    index: int
    start: float
    end: float = 0.0
    rows: int = 0
    new_tokens: int = 0


@dataclass
class _Request:
    key: tuple[int, int]  # (the sample's index, or the arrival order when none is given; arrival) -- the batch order
    context: list[int]
    cap: int
    sampling: TurnSampling
    future: asyncio.Future


class TurnBatcher:
    """Gathers the generation requests of ``live`` samples (see the module docstring)."""

    def __init__(
        self, engines: Any, params: SamplingParams, *, context_limit: int | None = None, clock=time.perf_counter
    ):
        self.engines, self.params, self.context_limit, self.clock = engines, params, context_limit, clock
        self.live = 0
        self.flushes: list[Flush] = []
        self._waiting: list[_Request] = []
        self._busy = False
        self._arrivals = 0

    @property
    def busy(self) -> bool:
        """A batch is at the engines."""
        return self._busy

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def add_samples(self, count: int) -> None:
        """``count`` samples start (before any of them asks for a turn)."""
        self.live += count

    def sample_done(self) -> None:
        self.live -= 1
        self._maybe_flush()

    def default_sampling(self) -> TurnSampling:
        p = self.params
        return TurnSampling(p.temperature, p.top_p, p.top_k, p.min_new_tokens)

    async def generate(
        self, context: list[int], cap: int, sampling: TurnSampling | None = None, *, sample: int | None = None
    ) -> GenerationOutput:
        """The next turn of one sample: at most ``cap`` new tokens after ``context``. ``sample``: the sample's index
        in the step, which orders the batch (without it, arrival does, and timing may change the results)."""
        if cap < 1:
            raise ValueError(f"a turn needs room for at least one new token (cap {cap})")
        if self.context_limit is not None:
            cap = min(cap, self.context_limit - len(context))
            if cap < 1:
                raise ValueError(
                    f"the context ({len(context)} tokens) fills the model's {self.context_limit} positions"
                )
        future = asyncio.get_running_loop().create_future()
        self._arrivals += 1
        key = (self._arrivals if sample is None else sample, self._arrivals)
        self._waiting.append(_Request(key, list(context), cap, sampling or self.default_sampling(), future))
        self._maybe_flush()
        return await future

    def _maybe_flush(self) -> None:
        if self._waiting and not self._busy and len(self._waiting) >= self.live:
            batch, self._waiting = sorted(self._waiting, key=lambda r: r.key), []
            self._busy = True
            asyncio.get_running_loop().create_task(self._flush(batch))

    async def _flush(self, batch: list[_Request]) -> None:
        record = Flush(len(self.flushes), self.clock(), rows=len(batch))
        self.flushes.append(record)
        try:
            outputs = await asyncio.to_thread(self._generate, batch, record.index)
        except BaseException as e:  # the engines failed: every sample of the batch gets the error
            for r in batch:
                if not r.future.done():
                    r.future.set_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))
            if not isinstance(e, Exception):
                raise
        else:
            record.new_tokens = sum(len(o.token_ids) for o in outputs)
            for r, out in zip(batch, outputs):
                if not r.future.done():
                    r.future.set_result(out)
        finally:
            record.end = self.clock()
            self._busy = False
            self._maybe_flush()

    def _generate(self, batch: list[_Request], index: int) -> list[GenerationOutput]:
        """One engine call per distinct sampling setting (usually one), split where contexts reach the limit."""
        out: list[GenerationOutput | None] = [None] * len(batch)
        groups: dict[TurnSampling, list[int]] = {}
        for i, r in enumerate(batch):
            groups.setdefault(r.sampling, []).append(i)
        call = 0
        for sampling, members in groups.items():
            for part, cap in self._parts(batch, members):
                params = dataclasses.replace(
                    self.params,
                    n=1,
                    max_new_tokens=cap,
                    temperature=sampling.temperature,
                    top_p=sampling.top_p,
                    top_k=sampling.top_k,
                    min_new_tokens=min(sampling.min_new_tokens, cap),
                    seed=_call_seed(self.params.seed, index, call),
                )
                call += 1
                results = self.engines.generate([batch[i].context for i in part], params)
                for i, samples in zip(part, results):
                    out[i] = _cut(samples[0], batch[i].cap)
        return out  # type: ignore[return-value]

    def _parts(self, batch: list[_Request], members: list[int]) -> list[tuple[list[int], int]]:
        order = sorted(members, key=lambda i: (-batch[i].cap, i))
        parts = []
        while order:
            cap = batch[order[0]].cap
            fits = [i for i in order if self.context_limit is None or len(batch[i].context) + cap <= self.context_limit]
            parts.append((sorted(fits), cap))
            order = [i for i in order if i not in set(fits)]
        return parts


def _cut(out: GenerationOutput, cap: int) -> GenerationOutput:
    if len(out.token_ids) <= cap:
        return out
    return dataclasses.replace(
        out,
        token_ids=list(out.token_ids[:cap]),
        logprobs=list(out.logprobs[:cap]) if out.logprobs is not None else None,
        weight_versions=(list(out.weight_versions[:cap]) if out.weight_versions is not None else None),
        finish_reason="length",
    )


def _call_seed(seed: int | None, flush: int, call: int) -> int | None:
    if seed is None:
        return None
    digest = hashlib.blake2b(struct.pack("<qqq", seed, flush, call), digest_size=8, person=b"hybrid-turn").digest()
    return int.from_bytes(digest, "little") >> 1
