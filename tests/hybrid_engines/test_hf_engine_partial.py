"""Partial rollouts on the built-in engine: a weight update lands in the middle of a generation, which keeps its rows
and KV cache, goes on with the new weights, and marks every token with the version of the weights that sampled it.

The engine's decoding loop is stopped at a chosen forward pass (a gate around its pause point), so the update lands
after exactly that many tokens; the log-probabilities the engine reports are then checked, token by token, against
the model each token's version names: the old one for the tokens before the update, the new one (reading the cache
the old one wrote, as a paused engine keeps it) for the tokens after.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from hybrid_core.weight_sync import IpcBucketSender
from hybrid_engines import PausableEngine, SamplingParams
from hybrid_engines.hf_engine import EngineStateError, HFEngine

VOCAB = 96
NEW = 16
PROMPTS = [[5, 17, 3], [40, 2, 9, 11, 63, 7, 1]]
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=NEW, n=2, seed=11)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_model(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            initializer_range=0.2,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        )
    ).eval()


class Gate:
    """Stops the engine's decoding loop before its ``at``-th forward pass until released (the pause point runs
    after the gate, so a pause asked for while the loop waits here parks it exactly there)."""

    def __init__(self, engine: HFEngine, at: int):
        self.calls, self.at = 0, at
        self.reached, self.go = threading.Event(), threading.Event()
        inner = engine._before_forward

        def gated() -> int:
            self.calls += 1
            if self.calls == self.at:
                self.reached.set()
                assert self.go.wait(30), "the test never released the gate"
            return inner()

        engine._before_forward = gated


def in_thread(fn, *args):
    box: dict = {}

    def run():
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # handed to the test thread
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def send(engine: HFEngine, model: LlamaForCausalLM) -> None:
    """A weight sync through the engine's own path (CPU shared-memory buckets, as a colocated trainer sends them)."""
    sender = IpcBucketSender(4096, device="cpu")
    try:
        sender.send(list(model.named_parameters()), deliver=engine.update_weights_from_ipc, wait=lambda result: None)
    finally:
        sender.close()


@torch.no_grad()
def logprobs_with_switch(
    old: LlamaForCausalLM, new: LlamaForCausalLM, prompt: list[int], tokens: list[int], switch: int
) -> list[float]:
    """Log-probs of ``tokens`` after ``prompt``: the old model's forwards for the prompt and the first ``switch - 1``
    tokens as inputs, the new model's for the rest, on the cache the old model wrote (what a kept generation sees)."""
    ids = torch.tensor([prompt + tokens])
    cache = DynamicCache(config=old.config)
    cut = len(prompt) + switch - 1  # positions the old model's forwards read
    first = old(input_ids=ids[:, :cut], past_key_values=cache, use_cache=True).logits
    rest = new(input_ids=ids[:, cut:-1], past_key_values=cache, use_cache=True).logits
    logits = torch.cat([first[:, len(prompt) - 1 :], rest], dim=1)[0].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1).tolist()


def test_a_weight_update_mid_generation_keeps_the_rows_and_marks_each_tokens_version():
    old, new = tiny_model(0), tiny_model(1)
    engine = HFEngine(tiny_model(0), device="cpu")
    assert isinstance(engine, PausableEngine)
    uninterrupted = engine.generate(PROMPTS, PARAMS)
    at = 7  # the prefill is forward 1: tokens 0..5 come from the old weights, 6.. from the new ones
    gate = Gate(engine, at)
    thread, box = in_thread(engine.generate, PROMPTS, PARAMS)
    assert gate.reached.wait(30)
    pauser, paused = in_thread(engine.pause_generation, 30.0)
    deadline = time.monotonic() + 10
    while not engine._paused:  # the pause is asked for before the loop leaves the gate
        assert time.monotonic() < deadline
        time.sleep(0.01)
    gate.go.set()
    pauser.join(30)
    assert paused.get("value") == {"parked": 1, "version": 0}, paused
    send(engine, new)  # allowed: the only decoding loop is parked
    engine.set_weight_version(1)
    engine.resume_generation()
    thread.join(60)
    assert "error" not in box, box.get("error")
    outputs = box["value"]

    for p, (prompt, outs) in enumerate(zip(PROMPTS, outputs)):
        for j, out in enumerate(outs):
            assert len(out.token_ids) == NEW and out.finish_reason == "length"
            # the rows were kept: the same sample goes on, its first tokens are the uninterrupted run's
            switch = at - 1
            assert out.weight_versions == [0] * switch + [1] * (NEW - switch)
            assert out.token_ids[:switch] == uninterrupted[p][j].token_ids[:switch]
            expected = logprobs_with_switch(old, new, prompt, out.token_ids, switch)
            assert out.logprobs == pytest.approx(expected, abs=1e-4)
    # the new weights changed what was sampled after the update (same uniforms, other logits)
    assert any(o.token_ids != u.token_ids for outs, uouts in zip(outputs, uninterrupted) for o, u in zip(outs, uouts))
    # and later calls run on the new weights from their first token
    after = engine.generate(PROMPTS, PARAMS)
    assert all(o.weight_versions == [1] * NEW for outs in after for o in outs)


def test_weights_cannot_change_under_a_running_loop_and_a_pause_reaches_every_loop():
    engine = HFEngine(tiny_model(0), device="cpu")
    gate = Gate(engine, 3)
    thread, box = in_thread(engine.generate, PROMPTS, PARAMS)
    assert gate.reached.wait(30)
    with pytest.raises(EngineStateError, match="pause_generation"):
        send(engine, tiny_model(1))  # the loop is between two steps, not parked: refused, nothing loaded
    with pytest.raises(EngineStateError, match="pause_generation"):
        engine.sleep(1)
    gate.go.set()
    thread.join(60)
    assert "error" not in box and all(o.weight_versions == [0] * NEW for outs in box["value"] for o in outs)


def test_a_pause_with_nothing_running_parks_the_next_generation_until_resumed():
    engine = HFEngine(tiny_model(0), device="cpu")
    assert engine.pause_generation(5.0) == {"parked": 0, "version": 0}
    thread, box = in_thread(engine.generate, PROMPTS, PARAMS)
    deadline = time.monotonic() + 10
    while engine._parked < 1:  # parked before its prefill
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.01)
    send(engine, tiny_model(1))
    engine.set_weight_version(3)
    engine.resume_generation()
    thread.join(60)
    assert all(o.weight_versions == [3] * NEW for outs in box["value"] for o in outs)
    reference = HFEngine(tiny_model(1), device="cpu").generate(PROMPTS, PARAMS)
    assert [[o.token_ids for o in outs] for outs in box["value"]] == [[o.token_ids for o in outs] for outs in reference]


def test_a_pause_that_is_never_resumed_ends_the_generation_with_an_error():
    engine = HFEngine(tiny_model(0), device="cpu")
    engine.pause_timeout_s = 0.3
    engine.pause_generation(5.0)
    with pytest.raises(EngineStateError, match="never resumed"):
        engine.generate(PROMPTS, PARAMS)
    engine.resume_generation()
    assert engine.generate(PROMPTS, PARAMS)[0][0].weight_versions == [0] * NEW
