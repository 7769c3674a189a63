"""Multi-turn rollouts with the real built-in engine (tiny model) and real environments, no Ray: the conversation's
tokens (model turns with the engine's log-probs, environment replies rendered through the chat template and masked
out), concurrency of the environment steps, reproducibility whatever the environments' timing, the per-turn
timeline in the metrics, and dynamic sampling (DAPO) over conversations."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest
import torch

from hybrid_algos.train.agents import AgentRollout, StepResult, builtin_agent, summarize
from hybrid_algos.train.agents.loader import AgentSpec
from hybrid_algos.train.agents.templates import TINY_CHAT_TEMPLATE, Renderer
from hybrid_algos.train.config import GRPOConfig
from hybrid_algos.train.dynamic_sampling import sample_rollout, shape_rewards
from hybrid_algos.train.experience import Rollout
from hybrid_algos.train.tasks import BOS, EOS, FIRST_SYMBOL_ID, SEP
from hybrid_engines import HFEngine, SamplingParams

PAD = 0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoTokenizer

    from hybrid_algos.train.tiny import save_tiny_model

    path = save_tiny_model(str(tmp_path_factory.mktemp("tiny")), seed=3)
    return HFEngine(path, device="cpu", dtype="float32"), AutoTokenizer.from_pretrained(path)


def _config(**changes) -> GRPOConfig:
    settings = dict(
        task="lookup",
        task_length=1,
        rollout_batch_size=4,
        n_samples_per_prompt=4,
        train_batch_size=16,
        micro_train_batch_size=16,
        seed=7,
    )
    return GRPOConfig(**{**settings, **changes}).validate()


def _lookup(tiny, **changes):
    engine, tok = tiny
    cfg = _config(**changes)
    from hybrid_algos.train.tasks import task_from_config

    prompts = task_from_config(cfg).prompts(8, seed=1)
    rollout = AgentRollout(builtin_agent(cfg), cfg.rollout_settings(), tok, context_limit=256)
    return engine, rollout, prompts


def _sampling(n=4, budget=14, seed=5):
    return SamplingParams(max_new_tokens=budget, n=n, stop_token_ids=(EOS,), seed=seed)


def test_lookup_conversations_interleave_model_turns_and_masked_tool_replies(tiny):
    engine, agent, prompts = _lookup(tiny)
    try:
        batch = agent.run(engine, prompts[:4], _sampling(), step=0)
    finally:
        agent.close()
    convs = [c for group in batch.conversations for c in group]
    assert len(batch.conversations) == 4 and all(len(g) == 4 for g in batch.conversations)
    multi = [c for c in convs if c.turns > 1]
    assert multi, "an untrained policy calls the tool in some samples (any non-symbol first token)"
    for prompt, group in zip(prompts, batch.conversations):
        for c in group:
            assert c.prompt_ids == prompt.prompt_ids
            assert len(c.response) == len(c.action_mask) == len(c.logprobs) <= 7  # 2 turns of 2 tokens, a reply of 3
            segments = c.segments()
            assert len(segments) == c.turns and all(m >= 1 for m, _ in segments)
            pos = 0
            for model, env in segments:
                turn = c.response[pos : pos + model]
                assert all(lp < 0 for lp in c.logprobs[pos : pos + model])  # the engine's own log-probs
                reply = c.response[pos + model : pos + model + env]
                assert c.logprobs[pos + model : pos + model + env] == [0.0] * env
                assert c.action_mask[pos : pos + model + env] == [1] * model + [0] * env
                if env:  # the tool's answer through the tiny chat template: "<sep> s_v" (the turn closed first)
                    closing = [] if turn[-1] == EOS else [EOS]
                    assert reply == [*closing, SEP, FIRST_SYMBOL_ID + prompt.label]
                    assert turn[0] < FIRST_SYMBOL_ID  # it was a call, not an answer
                pos += model + env
            assert segments[-1][1] == 0  # nothing after the last turn
            answer = c.response[pos - segments[-1][0]]
            answered = answer >= FIRST_SYMBOL_ID
            assert c.reward == float(answered and answer == FIRST_SYMBOL_ID + prompt.label and c.turns > 1)
            assert c.info == {"tool_calls": float(c.turns - 1 if answered else c.turns)}
    # what the trainer gets: the environment's tokens attended to, masked out, without engine log-probs
    outputs = batch.outputs
    from hybrid_algos.train.dynamic_sampling import Sampled

    rollout = Sampled(prompts[:4], outputs).rollout(PAD)
    c = multi[0]
    b = convs.index(c)
    R = rollout.response_len
    assert rollout.action_mask[b, : len(c.response)].tolist() == [float(m) for m in c.action_mask]
    assert rollout.attention_mask[b, -R:][: len(c.response)].tolist() == [1] * len(c.response)
    env_positions = torch.tensor(c.action_mask + [1] * (R - len(c.response))) == 0
    assert (rollout.engine_logprobs[b][env_positions] == 0).all()


def test_environment_steps_run_concurrently(tiny):
    engine, tok = tiny
    cfg = _config(task="copy", agent_func_path=None)
    in_flight = {"now": 0, "most": 0}

    class SlowTool:
        async def reset(self, prompt, label):
            return None

        async def step(self, action):
            in_flight["now"] += 1
            in_flight["most"] = max(in_flight["most"], in_flight["now"])
            await asyncio.sleep(0.2)
            in_flight["now"] -= 1
            return StepResult(feedback="s1", reward=1.0, done=False)

    spec = AgentSpec("environment", "slow_tool.py", factory=SlowTool)
    agent = AgentRollout(
        spec, cfg.replace(max_turns=2, max_new_tokens_per_turn=3).rollout_settings(), tok, context_limit=256
    )
    from hybrid_algos.train.tasks import SyntheticTask

    prompts = SyntheticTask("copy", prompt_symbols=1).prompts(4, seed=0)
    try:
        batch = agent.run(engine, prompts, _sampling(n=4, budget=12), step=0)
    finally:
        agent.close()
    assert in_flight["most"] == 16  # every sample's step at once, not one after another
    assert all(c.turns == 2 and c.hit_max_turns for g in batch.conversations for c in g)
    assert all(c.reward == 2.0 for g in batch.conversations for c in g)  # the sum of the turns' rewards
    assert len(batch.flushes) == 2  # one engine call per turn for all 16 conversations


def test_conversations_do_not_depend_on_the_environments_timing(tiny):
    """The n-th batch holds the samples' n-th turns whatever answers first: same seed, same conversations."""
    engine, tok = tiny
    cfg = _config()

    def make(jitter: bool):
        from hybrid_algos.train.agents.lookup import LookupEnvironment

        class Jittery(LookupEnvironment):
            async def step(self, action):  # async, with random delays: environments answer in any order
                if jitter:
                    await asyncio.sleep(random.random() * 0.05)
                return super().step(action)

        return AgentSpec("environment", "the built-in 'lookup' task", factory=Jittery, builtin=True)

    from hybrid_algos.train.tasks import task_from_config

    prompts = task_from_config(cfg).prompts(4, seed=2)
    results = []
    for jitter in (False, True, True):
        agent = AgentRollout(make(jitter), cfg.rollout_settings(), tok, context_limit=256)
        try:
            batch = agent.run(engine, prompts, _sampling(seed=11), step=0)
        finally:
            agent.close()
        results.append([(c.response, c.action_mask, c.reward) for g in batch.conversations for c in g])
    assert results[0] == results[1] == results[2]
    assert any(len(set(tuple(r[0]) for r in results[0][i * 4 : (i + 1) * 4])) > 1 for i in range(4))  # samples differ


def test_per_turn_timeline_in_the_metrics(tiny):
    engine, agent, prompts = _lookup(tiny)
    try:
        batch = agent.run(engine, prompts[:4], _sampling(), step=0)
    finally:
        agent.close()
    m = summarize([batch])
    turns = [c.turns for g in batch.conversations for c in g]
    assert m["agent/turn1/samples"] == 16 and m["agent/turns"] == pytest.approx(sum(turns) / 16)
    assert m["agent/turns_max"] == max(turns)
    for t in range(1, max(turns) + 1):
        assert m[f"agent/turn{t}/samples"] == sum(x >= t for x in turns)
        assert m[f"agent/turn{t}/generate_s"] > 0 and m[f"agent/turn{t}/env_s"] >= 0
        assert m[f"agent/turn{t}/model_tokens"] >= 1
    convs = [c for g in batch.conversations for c in g]
    assert m["agent/env_tokens"] == pytest.approx(sum(len(c.response) - sum(c.action_mask) for c in convs) / 16)
    assert m["agent/generate_s"] == pytest.approx(sum(m[f"agent/turn{t}/generate_s"] for t in range(1, max(turns) + 1)))
    assert m["agent/rollout_s"] >= m["agent/generate_s"] and m["agent/tokens_per_s"] > 0
    assert "agent/info/tool_calls" in m


def test_chat_template_renders_replies_after_the_model_s_own_stop_token(tiny):
    _, tok = tiny
    tok = tok.__class__.from_pretrained(tok.name_or_path)
    # a template whose assistant turn closes with two tokens and whose generation prompt is one
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] }} <eos> <pad> "
        "{% else %}<bos> {{ m['content'] }} {% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<sep> {% endif %}"
    )
    r = Renderer(tok, chat_template=True)
    s = lambda i: FIRST_SYMBOL_ID + i  # noqa: E731
    assert r.feedback("s5", "user", [s(1), EOS]) == [PAD, BOS, s(5), SEP]  # the model's <eos> is kept, not doubled
    assert r.feedback("s5 s6", "user", [s(1), s(2)]) == [EOS, PAD, BOS, s(5), s(6), SEP]  # a cut turn is closed
    assert r.first_message("s3") == [BOS, s(3), SEP]
    assert r.action_text([s(1), s(2), EOS]) == "s1 s2"
    plain = Renderer(tok, chat_template=False)
    assert plain.feedback("s5", "user", [s(1), EOS]) == [s(5)]  # no template: the text's tokens, as OpenRLHF does
    tiny_tok = tok.__class__.from_pretrained(tok.name_or_path)
    tiny_tok.chat_template = TINY_CHAT_TEMPLATE
    tiny_renderer = Renderer(tiny_tok, chat_template=True)
    assert tiny_renderer.feedback("s5", "user", [s(1), EOS]) == [BOS, s(5), SEP]
    assert tiny_renderer.feedback("s5", "tool", [s(1), s(2)]) == [EOS, SEP, s(5)]


def test_environment_can_rewrite_the_prompt(tiny):
    engine, tok = tiny
    cfg = _config(task="copy", agent_func_path=None)

    class Rewrites:
        def reset(self, prompt, label):  # a plain def: run in a thread
            return "s7 s7"

        def step(self, action):
            return {"feedback": "", "reward": 0.5, "done": True}

    agent = AgentRollout(
        AgentSpec("environment", "rewrites.py", factory=Rewrites), cfg.rollout_settings(), tok, context_limit=256
    )
    from hybrid_algos.train.tasks import SyntheticTask

    prompts = SyntheticTask("copy", prompt_symbols=1).prompts(2, seed=0)
    try:
        batch = agent.run(engine, prompts, _sampling(n=2, budget=4), step=0)
    finally:
        agent.close()
    want = list(tok("s7 s7")["input_ids"])  # no chat template in this run: encoded as plain prompts are
    assert all(c.prompt_ids == want and c.reward == 0.5 and c.turns == 1 for g in batch.conversations for c in g)
    from hybrid_algos.train.dynamic_sampling import Sampled

    rollout = Sampled(prompts, batch.outputs).rollout(PAD)
    P = rollout.sequences.size(1) - rollout.response_len
    assert rollout.sequences[0, P - len(want) : P].tolist() == want


def test_from_generations_with_action_masks_and_sample_prompts():
    r = Rollout.from_generations(
        [[1, 4], [1, 5]],
        [[[6, 2, 1, 7, 3, 8]], [[9]]],
        PAD,
        logprobs=[[[-1.0, -2.0, 5.0, 5.0, 5.0, -3.0]], [[-0.5]]],
        action_masks=[[[1, 1, 0, 0, 0, 1]], [None]],
        sample_prompts=[[[1, 4, 4]], [[1, 5]]],
    )
    assert r.action_mask.tolist() == [[1, 1, 0, 0, 0, 1], [1, 0, 0, 0, 0, 0]]
    assert r.engine_logprobs.tolist() == [[-1.0, -2.0, 0.0, 0.0, 0.0, -3.0], [-0.5, 0, 0, 0, 0, 0]]
    assert r.sequences[0].tolist() == [1, 4, 4, 6, 2, 1, 7, 3, 8] and r.attention_mask[0].sum() == 9
    assert r.sequences[1, :3].tolist() == [PAD, 1, 5]
    with pytest.raises(ValueError, match="action mask of 2 tokens for a response of 1"):
        Rollout.from_generations([[1]], [[[5]]], PAD, action_masks=[[[1, 0]]])


def test_dynamic_sampling_over_conversations(tiny):
    engine, tok = tiny
    cfg = _config(dynamic_filtering=True, n_samples_per_prompt=4)
    from hybrid_algos.train.tasks import task_from_config

    pool = task_from_config(cfg).prompts(64, seed=11)
    agent = AgentRollout(builtin_agent(cfg), cfg.rollout_settings(), tok, context_limit=256)
    ctx = SimpleNamespace(settings=cfg.settings(), engines=engine, agent=agent, reward=None, prompt_pool=pool)
    try:
        out = sample_rollout(ctx, 0, pool[:4], _sampling(seed=3))
    finally:
        agent.close()
    from hybrid_algos import informative_groups

    m = out.metrics
    assert m["dynamic_sampling/rounds"] >= 2 and m["dynamic_sampling/generated_prompts"] > 4  # most groups score 0
    if m["dynamic_sampling/filled_groups"] == 0:
        assert informative_groups(out.scores, n_samples_per_prompt=4).all()
    assert torch.equal(out.scores, torch.tensor([o.extra["agent_reward"] for g in out.outputs for o in g]))
    assert m["agent/turn1/samples"] == 4 * m["dynamic_sampling/generated_prompts"]  # every round's conversations
    rollout = out.rollout(PAD)
    assert rollout.batch_size == 16 and (rollout.action_mask.sum(-1) >= 1).all()
    _, mask, _ = shape_rewards(cfg.algorithm_settings(), out.outputs, out.scores, 14)
    assert mask is None


def test_a_batch_is_ordered_by_sample_not_by_arrival(tiny):
    """Two samples with the same context in one turn get different completions (row seeds count repeats within a
    call); which one gets which must not depend on which environment answered first."""
    engine, _ = tiny
    from hybrid_algos.train.agents.batcher import TurnBatcher

    context = [5, 6, 7]

    async def turn(order):
        batcher = TurnBatcher(engine, _sampling(n=1, budget=6, seed=13))
        batcher.add_samples(2)
        calls = {}
        for sample in order:  # arrival order; the flush happens when both are waiting
            calls[sample] = asyncio.ensure_future(batcher.generate(context, 6, sample=sample))
            await asyncio.sleep(0)
        return {sample: (await call).token_ids for sample, call in calls.items()}

    forward, backward = asyncio.run(turn([0, 1])), asyncio.run(turn([1, 0]))
    assert forward[0] != forward[1]  # the same context, two different samples
    assert forward == backward
