"""Asynchronous training's plain-data part (no Ray): the staleness bound, the queue's JSON form for checkpoints, and
the mode a run takes -- split, shared GPUs (the residency plan keeps the engines next to the trainer) or synchronous
turns where they do not fit."""

from __future__ import annotations

import json
import os

import pytest
import torch
from tiny_runs import TINY

from hybrid_algos.train.async_rollout import (
    StalenessError,
    async_mode,
    batch_from_json,
    batch_to_json,
    check_staleness,
    make_batch,
    staleness_metrics,
)
from hybrid_algos.train.checkpoint import CheckpointError
from hybrid_algos.train.config import GRPOConfig
from hybrid_algos.train.dynamic_sampling import Sampled
from hybrid_algos.train.placement import build_plan, build_residency
from hybrid_engines.protocol import GenerationOutput


class P:  # a prompt of the run's prompt set (only its identity matters to the queue)
    def __init__(self, ids):
        self.prompt_ids = ids


def _batch(step, version, versions=None):
    prompts = [P([1, 2]), P([3])]
    outputs = [
        [GenerationOutput([1, 2], [5, 6, 7], [-0.5, -0.25, -1.0], "stop", weight_versions=versions)] for _ in prompts
    ]
    return prompts, make_batch(step, Sampled(prompts, outputs, torch.tensor([1.0, 0.0]), {"reward/x": 0.5}), version)


def test_a_sample_older_than_the_bound_is_never_trained_on():
    _, batch = _batch(step=3, version=2)
    assert check_staleness(batch, trainer_version=3, max_staleness=1) == 1
    with pytest.raises(
        StalenessError,
        match=r"step 4: .*version 2 .*version 4 \(2 versions old, more than "
        r"--async_max_staleness 1\)",
    ):
        check_staleness(batch, trainer_version=4, max_staleness=1)
    # partial rollouts: a sample's oldest token decides
    _, mixed = _batch(step=5, version=4, versions=[3, 4, 4])
    assert mixed.oldest == 3 and mixed.newest == 4
    with pytest.raises(StalenessError):
        check_staleness(mixed, trainer_version=5, max_staleness=1)
    metrics = staleness_metrics(mixed, 5)
    assert metrics["async/staleness_max"] == 2 and metrics["async/mixed_version_samples"] == 2
    assert metrics["async/staleness_mean"] == pytest.approx((2 + 1 + 1) / 3)


def test_the_queue_round_trips_through_json_exactly():
    prompts, batch = _batch(step=7, version=6, versions=[5, 6, 6])
    pool = [P([9]), *prompts]
    data = json.loads(json.dumps(batch_to_json(batch, {id(p): i for i, p in enumerate(pool)})))
    back = batch_from_json(data, pool)
    assert back.step == 7 and back.version == 6 and back.versions == batch.versions
    assert [p is q for p, q in zip(back.sampled.prompts, prompts)] == [True, True]  # the run's own prompt objects
    assert back.sampled.outputs == batch.sampled.outputs and back.sampled.metrics == {"reward/x": 0.5}
    assert torch.equal(back.sampled.scores, batch.sampled.scores)
    # a multi-turn sample's mask of the model's own tokens comes back too (without it a resumed agent run would train
    # on the environment's tokens)
    agent_out = GenerationOutput(
        [1, 2],
        [5, 8, 9, 6],
        [-0.5, 0.0, 0.0, -1.0],
        "stop",
        extra={
            "action_mask": [1, 0, 0, 1],
            "agent_failed": False,
            "agent_reward": 1.0,
            "turns": 2,
            "score": torch.tensor(0.5),
        },
    )
    agent_batch = make_batch(8, Sampled(prompts, [[agent_out], [agent_out]], torch.tensor([1.0, 1.0]), {}), 7)
    agent_back = batch_from_json(
        json.loads(json.dumps(batch_to_json(agent_batch, {id(p): i for i, p in enumerate(pool)}))), pool
    )
    assert agent_back.sampled.outputs[0][0].extra == {
        "action_mask": [1, 0, 0, 1],
        "agent_failed": False,
        "agent_reward": 1.0,
        "turns": 2,
        "score": 0.5,
    }
    rollout = agent_back.sampled.rollout(pad_id=0)  # the trainer's batch: the environment's tokens are masked out
    assert rollout.action_mask[0].tolist()[:4] == [1.0, 0.0, 0.0, 1.0]
    del data["outputs"][0][0]["token_ids"]
    with pytest.raises(CheckpointError, match="queue of generated batches is damaged"):
        batch_from_json(data, pool)


def _plan(**overrides):
    config = GRPOConfig(save_path="/tmp/unused", **{**TINY, **overrides}).validate()
    placement = build_plan(config)
    residency, config = build_residency(config, placement, None, prompt_len=4, generate_len=4)
    return config, placement, residency


def test_the_mode_follows_the_placement_and_the_residency_plan():
    assert async_mode(*_plan())[0] == "off"
    config, placement, residency = _plan(
        async_train=True, colocate_all_models=False, vllm_num_engines=1, init_kl_coef=0.0
    )
    assert async_mode(config, placement, residency)[0] == "split" and placement.num_gpus == 2
    # shared GPUs with room: the plan keeps the engine's weights and KV cache resident in every phase
    config, placement, residency = _plan(async_train=True)
    assert async_mode(config, placement, residency)[0] == "shared"
    assert not residency.sleeps("rollout")
    # the engines asked to sleep: synchronous turns, and the run says why
    config, placement, residency = _plan(async_train=True, vllm_enable_sleep=True)
    mode, note = async_mode(config, placement, residency)
    assert mode == "sync" and "synchronous turns" in note and residency.sleeps("rollout")


def test_shared_gpus_too_small_for_both_fall_back_to_turns():
    """A GPU that holds the trainer and the engine in turns but not both at once: the plan moves the engine and the
    run takes turns; with more memory the planner keeps the engine resident (moving the trainer's spare state if it
    must) and the two run together."""
    base = dict(
        async_train=True,
        tiny_model=dict(hidden_size=1024, intermediate_size=2048, num_hidden_layers=8),
        gpu_context_gb=0.0,
        zero_stage=0,
    )
    config, placement, residency = _plan(gpu_memory_gb=1.7, **base)
    mode, _note = async_mode(config, placement, residency)
    assert residency.fits() and residency.sleeps("rollout") and mode == "sync", residency.describe_moves()
    config, placement, residency = _plan(gpu_memory_gb=2.0, **base)
    assert (
        residency.fits() and not residency.sleeps("rollout") and async_mode(config, placement, residency)[0] == "shared"
    )
    # without --async_train the same GPU lets the engine sleep if that is cheaper: the pins are asked only for async
    config, placement, residency = _plan(gpu_memory_gb=2.0, **{**base, "async_train": False})
    assert residency.fits() and async_mode(config, placement, residency)[0] == "off"


def test_the_shared_mode_says_whether_cuda_mps_lets_both_run_at_once(tmp_path, monkeypatch):
    """Without MPS the two processes' kernels take turns on the GPU (measured: 1.16x on one H100 vs 1.31x under MPS),
    so the run's note says which case it is in."""
    config, placement, residency = _plan(async_train=True)
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    mode, note = async_mode(config, placement, residency)
    assert mode == "shared" and "CUDA MPS is not running" in note and "take turns" in note
    os.mkfifo(tmp_path / "control")  # what a running control daemon leaves in its pipe folder
    mode, note = async_mode(config, placement, residency)
    assert mode == "shared" and f"CUDA MPS is running ({tmp_path})" in note
