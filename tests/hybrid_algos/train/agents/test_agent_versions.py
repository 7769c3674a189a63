"""Multi-turn samples keep the weight version of every token (partial rollouts: turns of one sample can straddle a
weight update), so the staleness bound and ``async/mixed_version_samples`` see them."""

from __future__ import annotations

from types import SimpleNamespace

from hybrid_algos.train.agents.batcher import _cut
from hybrid_algos.train.agents.conversation import Conversation, from_openrlhf
from hybrid_algos.train.agents.openrlhf_engine import Generation
from hybrid_algos.train.async_rollout import make_batch, staleness_metrics
from hybrid_engines import GenerationOutput


def test_turns_from_two_weight_versions_make_a_mixed_sample():
    conv = Conversation([1, 2])
    conv.add_turn([5, 6], [-0.1, -0.2], versions=[3, 3])
    conv.add_feedback([7, 8])
    conv.add_turn([9], [-0.3], versions=[4])
    out = conv.output()
    assert out.weight_versions == [3, 3, 3, 3, 4]  # the reply carries the version of the turn it answers
    batch = make_batch(0, SimpleNamespace(outputs=[[out]]), version=3)
    assert batch.oldest == 3 and batch.newest == 4
    metrics = staleness_metrics(batch, trainer_version=4)
    assert metrics["async/mixed_version_samples"] == 1.0 and metrics["async/staleness_max"] == 1.0


def test_a_turn_without_versions_leaves_the_sample_to_the_batch_version():
    conv = Conversation([1])
    conv.add_turn([5], [-0.1], versions=[2])
    conv.add_feedback([7])
    conv.add_turn([9, 10], [-0.3, -0.4], versions=None)  # an engine that marks none
    assert conv.output().weight_versions is None
    batch = make_batch(0, SimpleNamespace(outputs=[[conv.output()]]), version=6)
    assert batch.versions == [[[6, 6, 6, 6]]]


def test_openrlhf_executor_results_take_the_versions_of_the_engine_turns():
    tokens = [1, 2, 5, 6, 7, 9]  # prompt [1, 2], action [5, 6], tool reply [7], action [9]
    gens = [Generation(2, [5, 6], [-0.1, -0.2], [3, 3]), Generation(5, [9], [-0.3], [5])]
    conv = from_openrlhf({"observation_tokens": tokens, "action_ranges": [(2, 4), (5, 6)], "reward": 1.0}, gens, 16)
    assert conv.output().weight_versions == [3, 3, 3, 5]
    # an action the engine did not produce as given: nothing to vouch for
    edited = [Generation(2, [5, 8], [-0.1, -0.2], [3, 3]), gens[1]]
    conv = from_openrlhf({"observation_tokens": tokens, "action_ranges": [(2, 4), (5, 6)], "reward": 1.0}, edited, 16)
    assert conv.output().weight_versions is None


def test_a_turn_cut_at_its_cap_keeps_its_versions_aligned():
    out = GenerationOutput([1], [5, 6, 7], [-0.1, -0.2, -0.3], "stop", weight_versions=[2, 2, 3])
    cut = _cut(out, 2)
    assert cut.token_ids == [5, 6] and cut.weight_versions == [2, 2] and cut.finish_reason == "length"


def test_the_rollout_passes_the_engine_s_versions_through(tmp_path):
    from transformers import AutoTokenizer

    from hybrid_algos.train.agents import AgentRollout, builtin_agent
    from hybrid_algos.train.config import GRPOConfig
    from hybrid_algos.train.tasks import EOS, task_from_config
    from hybrid_algos.train.tiny import save_tiny_model
    from hybrid_engines import HFEngine, SamplingParams

    path = save_tiny_model(str(tmp_path / "tiny"), seed=3)
    engine, tok = HFEngine(path, device="cpu", dtype="float32"), AutoTokenizer.from_pretrained(path)
    engine.set_weight_version(7)
    cfg = GRPOConfig(
        task="lookup",
        task_length=1,
        rollout_batch_size=4,
        n_samples_per_prompt=4,
        train_batch_size=16,
        micro_train_batch_size=16,
        seed=7,
    ).validate()
    agent = AgentRollout(builtin_agent(cfg), cfg.rollout_settings(), tok, context_limit=256)
    try:
        batch = agent.run(
            engine,
            task_from_config(cfg).prompts(4, seed=1),
            SamplingParams(max_new_tokens=14, n=4, stop_token_ids=(EOS,), seed=5),
            step=0,
        )
    finally:
        agent.close()
    outs = [o for group in batch.outputs for o in group]
    assert any(o.extra["turns"] > 1 for o in outs)  # multi-turn samples among them
    assert all(o.weight_versions == [7] * len(o.token_ids) for o in outs)
