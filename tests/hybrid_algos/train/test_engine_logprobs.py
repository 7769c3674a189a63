"""The engines are asked for the sampled tokens' log-probs only where something uses them (they cost vLLM ~24 % of a
small model's generate call): the rollout correction, or ``--engine_logprobs`` for the mismatch metrics alone.
Real short runs of the loop (real Ray with a fake GPU, DeepSpeed, the built-in engine) and the config's refusal."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from tiny_runs import TINY

from hybrid_algos.train import GRPOConfig, train
from hybrid_algos.train.loop import TrainingSession
from hybrid_core.errors import ConfigError


def _sampling(**config):
    stand_in = SimpleNamespace(
        settings=GRPOConfig(**config).settings(),
        prep=SimpleNamespace(tokenizer=SimpleNamespace(eos_token_id=2), max_new_tokens=8),
    )
    stand_in.seeded_sampling = lambda: False
    return TrainingSession.sampling(stand_in, 0)


@pytest.mark.parametrize(
    "config, asked",
    [
        ({}, True),  # the correction is on by default and needs them
        ({"enable_vllm_is_correction": False}, False),
        ({"enable_vllm_is_correction": False, "engine_logprobs": True}, True),
        ({"engine_logprobs": True}, True),
    ],
)
def test_the_loop_asks_for_engine_logprobs_only_where_they_are_used(config, asked):
    assert _sampling(**config).logprobs is asked


def test_refusing_logprobs_the_correction_needs_names_both_flags():
    with pytest.raises(ConfigError, match="engine_logprobs") as e:
        GRPOConfig(engine_logprobs=False).validate()
    assert "--no_enable_vllm_is_correction" in str(e.value)
    GRPOConfig(engine_logprobs=False, enable_vllm_is_correction=False).validate()  # nothing needs them: fine


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_mismatch_metrics_come_with_the_logprobs_and_only_then(tmp_path, one_gpu_ray):
    def run(name, **changes):
        config = GRPOConfig(save_path=str(tmp_path / name), **{**TINY, "max_steps": 2}, **changes)
        return train(config)["history"]

    without = run("without", enable_vllm_is_correction=False)
    assert not any(k.startswith("mismatch/") or k.startswith("rollout/logprob_gap") for m in without for k in m)
    measured = run("measured", enable_vllm_is_correction=False, engine_logprobs=True)
    for m in measured:  # the same engine and trainer weights: the ratio is 1, and it was measured, not corrected
        assert m["mismatch/ratio_max"] == pytest.approx(1.0, abs=2e-3)
