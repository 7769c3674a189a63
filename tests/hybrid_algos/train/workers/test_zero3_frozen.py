"""Under --zero_stage 3 the reference and the reward model are sharded over their role's ranks, as OpenRLHF shards
them (issue 34): on a real two-rank gloo group with DeepSpeed, each rank holds half of the parameters (what the
memory model counts), scores what the whole model scores, and its shards sleep and wake for the residency plan."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("zero3_frozen_worker.py")
pytestmark = pytest.mark.timeout(300)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    import torch
    from transformers import AutoTokenizer, LlamaForSequenceClassification

    from hybrid_algos.train.tiny import save_tiny_model, tiny_model_config

    folder = tmp_path_factory.mktemp("zero3-frozen")
    policy = save_tiny_model(str(folder / "policy"))
    reward = str(folder / "reward")
    torch.manual_seed(1)
    LlamaForSequenceClassification(tiny_model_config(num_labels=1)).save_pretrained(reward)
    AutoTokenizer.from_pretrained(policy).save_pretrained(reward)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env.pop("LOCAL_WORLD_SIZE", None)  # with it set, DeepSpeed's CPU path runs ~10x slower
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(rank), "2", str(port), policy, reward, str(folder / "logs")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=280)
        lines = [json.loads(line[len("RESULT ") :]) for line in stdout.splitlines() if line.startswith("RESULT ")]
        assert proc.returncode == 0 and len(lines) == 1, stdout[-3000:] + stderr[-3000:]
        out += lines
    return out


def test_each_rank_holds_half_of_each_frozen_model(ranks):
    for r in ranks:
        assert r["sharded"] == [True, True]
        for held, total in zip(r["held"], r["total"]):
            # DeepSpeed pads each parameter's partition to a whole number of elements per rank: at most a few
            assert total / 2 <= held <= total / 2 + 64, r
    from hybrid_algos.train.recipes import PPO
    from hybrid_algos.train.tiny import tiny_model_config
    from hybrid_core.residency.memory import Workload, model_shape, size_role

    # the plan's bytes for one of these ranks: the same half
    shape = model_shape(tiny_model_config())
    size = size_role(
        "reference",
        shape,
        Workload(zero_stage=3),
        kind="frozen",
        phases=PPO.residency_phases(),
        ranks=2,
        tp=1,
        gpu_bytes=80 * 2**30,
    )
    assert size.states["params"] == 2 * ranks[0]["total"][0] / 2


def test_sharded_models_score_what_the_whole_models_score(ranks):
    for r in ranks:
        assert r["logprob_gap"] < 1e-2 and r["score_gap"] < 1e-2, r


def test_the_shards_sleep_and_wake_for_the_residency_plan(ranks):
    for r in ranks:
        assert r["offloaded_bytes"] >= 2 * r["held"][0]  # this rank's bf16 shards (and the rotary buffers) went
        assert r["refused_asleep"] == "AsleepError"  # not a gather from freed memory
        assert r["after_wake_gap"] == 0.0


def test_one_rank_trainers_keep_zero3_when_a_frozen_model_has_several_ranks():
    """--zero_stage 3 with one rank per trainer runs ZeRO-1 (nothing to partition); a reference on two GPUs is
    partitioned by ZeRO-3, so there the stage stays and the plan counts half of the reference per GPU."""
    from hybrid_algos.train.config import GRPOConfig
    from hybrid_algos.train.placement import build_plan, build_residency
    from hybrid_algos.train.tiny import tiny_model_config
    from hybrid_core.residency.memory import count_params

    def planned(**kw):
        config = GRPOConfig(
            bf16=True,
            zero_stage=3,
            actor_num_gpus_per_node=1,
            vllm_num_engines=1,
            colocate_all_models=False,
            vllm_enable_sleep=False,
            **kw,
        ).validate()
        placement = build_plan(config)
        plan, run = build_residency(config, placement, None, prompt_len=16, generate_len=16, gpu_bytes=80 * 2**30)
        return placement, plan, run

    placement, plan, run = planned(ref_num_gpus_per_node=2)
    assert run.zero_stage == 3
    for gpu in placement.roles["reference"].gpus:
        (share,) = plan.layout[gpu]
        assert share.size.states["params"] == 2 * count_params(tiny_model_config()) / 2  # bf16, over 2 ranks
    _, _, run = planned(ref_num_gpus_per_node=1)
    assert run.zero_stage == 1  # every role has one rank: demoted, as before
