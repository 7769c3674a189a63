"""The vLLM adapter's partial-rollout loop on CPU: generate calls from several threads share one stepping loop, a
pause stops it at a step boundary and puts vLLM's scheduler in its ``keep`` pause, and each token is marked with the
weight version of the step that sampled it.

vLLM cannot run here, so ``StepLLM`` stands in for ``vllm.LLM`` with the behaviour the adapter relies on (checked
against vLLM 0.26's source by ``tests/hybrid_engines/contracts/test_vllm_contract.py``): ``LLMEngine.add_request``
/ ``step`` returning delta outputs, one token per running request per step, ``sleep(level=0, mode="keep")``
freezing every request until ``wake_up(tags=["scheduling"])``, and a prefix-cache reset that fails while requests
hold blocks. Its "model" samples ``(prompt sum + position + 10 x weights) % 50``, so which weights sampled a token is
visible in the token itself.
"""

from __future__ import annotations

import sys
import threading
import time
import types
from types import SimpleNamespace

import pytest

from hybrid_engines import PausableEngine
from hybrid_engines.hf_engine import EngineStateError
from hybrid_engines.protocol import SamplingParams


class FakeSamplingParams:
    def __init__(self, **kw):
        self.kw, self.output_kind = kw, "final"

    def clone(self):
        return FakeSamplingParams(**self.kw)


class StepEngine:
    """``LLMEngine``: requests advance one token per step; outputs are deltas (the adapter asks for them)."""

    def __init__(self, llm):
        self.llm, self.requests, self.steps = llm, {}, 0
        self.gate_at, self.reached, self.go = None, threading.Event(), threading.Event()

    def add_request(self, request_id, prompt, params):
        assert prompt["type"] == "tokens" and params.output_kind == "delta"
        self.requests[request_id] = {"prompt": prompt["prompt_token_ids"], "sp": params.kw, "made": 0}

    def abort_request(self, request_ids):
        for r in request_ids:
            self.requests.pop(r, None)

    def step(self):
        self.steps += 1
        if self.steps == self.gate_at:
            self.reached.set()
            assert self.go.wait(30)
        if self.llm.paused:  # keep: nothing is scheduled, every request stays
            return []
        outs = []
        for rid, r in list(self.requests.items()):
            token = (sum(r["prompt"]) + r["made"] + 10 * self.llm.weights) % 50
            r["made"] += 1
            finished = r["made"] == r["sp"]["max_tokens"]
            done = SimpleNamespace(
                token_ids=[token],
                logprobs=[{token: SimpleNamespace(logprob=-0.1 * self.llm.weights)}],
                finish_reason="length" if finished else None,
            )
            outs.append(SimpleNamespace(request_id=rid, outputs=[done], finished=finished))
            if finished:
                del self.requests[rid]
        time.sleep(0.002)
        return outs


class StepLLM:
    def __init__(self, **kwargs):
        self.kwargs, self.calls, self.paused, self.weights = kwargs, [], False, 0
        self.llm_engine = StepEngine(self)

    def _preprocess_cmpl_one(self, prompt, tokenization_kwargs=None):
        return {"type": "tokens", **prompt}

    def sleep(self, level, mode="abort"):
        self.calls.append(("sleep", level, mode))
        assert (level, mode) == (0, "keep")
        self.paused = True

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags)))
        self.paused = False

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))
        return not self.llm_engine.requests  # vLLM cannot reset while requests hold blocks

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        raise AssertionError(f"no worker here ({method})")


@pytest.fixture
def engine(monkeypatch):
    fake = types.ModuleType("vllm")
    fake.LLM = StepLLM
    fake.SamplingParams = FakeSamplingParams
    fake.sampling_params = SimpleNamespace(RequestOutputKind=SimpleNamespace(DELTA="delta"))
    monkeypatch.setitem(sys.modules, "vllm", fake)
    from hybrid_engines.vllm_engine import VLLMEngine

    return VLLMEngine("/nonexistent/model", enforce_eager=True, pausable=True)


def expected(prompt, n, weights_at):
    return [(sum(prompt) + k + 10 * weights_at(k)) % 50 for k in range(n)]


def run(engine, prompts, params):
    box = {}

    def target():
        try:
            box["out"] = engine.generate(prompts, params)
        except BaseException as e:
            box["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, box


def test_built_for_partial_rollouts_without_async_scheduling(engine):
    assert engine.llm.kwargs["async_scheduling"] is False and isinstance(engine, PausableEngine)


def test_calls_from_two_threads_share_the_steps_and_come_back_in_prompt_order(engine):
    params = SamplingParams(max_new_tokens=6, n=2, seed=1)
    a, box_a = run(engine, [[1, 2], [5]], params)
    b, box_b = run(engine, [[7, 7, 7]], SamplingParams(max_new_tokens=9))
    a.join(30), b.join(30)
    assert "error" not in box_a and "error" not in box_b
    for prompt, outs in zip([[1, 2], [5]], box_a["out"]):
        for o in outs:
            assert o.token_ids == expected(prompt, 6, lambda k: 0) and o.weight_versions == [0] * 6
            assert o.prompt_token_ids == prompt and o.finish_reason == "length"
    assert box_b["out"][0][0].token_ids == expected([7, 7, 7], 9, lambda k: 0)
    # one engine step served both calls: far fewer steps than the calls' tokens one after the other
    assert engine.llm.llm_engine.steps < 6 + 9 + 4


def test_a_pause_keeps_the_requests_and_the_tokens_after_it_carry_the_new_version(engine):
    fake = engine.llm
    fake.llm_engine.gate_at = 5  # four steps done (four tokens per row), the fifth waits at the gate
    thread, box = run(engine, [[3, 4], [9]], SamplingParams(max_new_tokens=10, n=2))
    assert fake.llm_engine.reached.wait(30)
    with pytest.raises(EngineStateError, match="pause_generation"):
        engine.update_weights_from_ipc([])  # refused while the loop steps
    result = {}
    t = threading.Thread(target=lambda: result.update(p=engine.pause_generation(10.0)), daemon=True)
    t.start()
    time.sleep(0.05)
    fake.llm_engine.go.set()  # the gated step finishes (a fifth token), then the loop stops
    t.join(30)
    assert result["p"] == {"parked": 4, "version": 0} and ("sleep", 0, "keep") in fake.calls
    steps = fake.llm_engine.steps
    time.sleep(0.1)
    assert fake.llm_engine.steps == steps and thread.is_alive()  # nothing steps while paused
    fake.weights = 1  # the weight update lands here
    engine.set_weight_version(1)
    engine.reset_prefix_cache()  # requests hold blocks: deferred, not an error
    assert ("reset_prefix_cache",) not in fake.calls
    engine.resume_generation()
    assert ("wake_up", ("scheduling",)) in fake.calls
    thread.join(30)
    assert "error" not in box, box.get("error")
    for prompt, outs in zip([[3, 4], [9]], box["out"]):
        for o in outs:
            assert o.weight_versions == [0] * 5 + [1] * 5
            assert o.token_ids == expected(prompt, 10, lambda k: 0 if k < 5 else 1)
            assert o.logprobs == [0.0] * 5 + [-0.1] * 5
    engine.generate([[1]], SamplingParams(max_new_tokens=1))
    assert ("reset_prefix_cache",) in fake.calls  # done once nothing was in flight


def test_sleep_is_refused_while_requests_are_in_flight(engine):
    fake = engine.llm
    fake.llm_engine.gate_at = 2
    thread, box = run(engine, [[1]], SamplingParams(max_new_tokens=4))
    assert fake.llm_engine.reached.wait(30)
    with pytest.raises(EngineStateError, match="in flight"):
        engine.sleep(1)
    fake.llm_engine.go.set()
    thread.join(30)
    assert box["out"][0][0].weight_versions == [0] * 4
