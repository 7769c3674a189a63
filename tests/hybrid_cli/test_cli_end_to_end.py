"""The real command, end to end: `hybrid grpo` trains 2 steps with a checkpoint after each (its own local Ray, the
built-in demo model, every role colocated on one fake GPU), then `--resume` continues the same run to step 3."""

import json
import os

import pytest

from hybrid_cli.main import main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]

SMALL = [
    "--task_length",
    "1",
    "--rollout_batch_size",
    "4",
    "--n_samples_per_prompt",
    "2",
    "--train_batch_size",
    "8",
    "--micro_train_batch_size",
    "8",
    "--save_steps",
    "1",
    "--seed",
    "7",
]


def _metrics(run):
    with open(run / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def _timeline(run):
    with open(run / "timeline.jsonl") as f:
        return [json.loads(line) for line in f]


def test_grpo_run_then_resume(tmp_path):
    import ray

    from hybrid_algos.train.deepspeed_ops import ensure_cpu_ops_built

    ensure_cpu_ops_built()  # a fresh clone compiles DeepSpeed's CPU ops once: not this test's subject
    run = tmp_path / "run"
    assert main(["grpo", "--max_steps", "2", "--save_path", str(run), *SMALL]) == 0
    assert not ray.is_initialized()  # the command stopped the Ray it started

    lines = _metrics(run)
    assert [m["step"] for m in lines] == [0, 1]
    for m in lines:
        assert 0.0 <= m["reward"] <= 1.0 and m["time/generate"] > 0 and m["time/train"] > 0 and "actor/pg_loss" in m
    checkpoints = run / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("step-")) == [
        "step-00000001",
        "step-00000002",
    ]
    assert json.loads((checkpoints / "latest.json").read_text())["step"] == 2
    assert (checkpoints / "step-00000002" / "COMPLETE.json").is_file()
    final = run / "final"
    assert (final / "config.json").is_file() and (final / "tokenizer_config.json").is_file()
    assert any(name.endswith(".safetensors") for name in os.listdir(final))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["start_step"] == 0
    timeline = _timeline(run)
    assert [t["step"] for t in timeline] == [0, 1]
    for t in timeline:  # each step's phases, in the order they ran, inside the step's own time
        phases = [p for p, _, _ in t["spans"]]
        assert phases.index("generate") < phases.index("train") < phases.index("sync")
        assert all(start <= end for _, start, end in t["spans"])
    assert max(e for _, _, e in timeline[0]["spans"]) <= min(s for _, s, _ in timeline[1]["spans"]) + 1e-3

    assert main(["grpo", "--max_steps", "3", "--resume", "--save_path", str(run), *SMALL]) == 0
    lines = _metrics(run)
    assert [m["step"] for m in lines] == [0, 1, 2]  # appended: steps 1-2 were not run again
    assert [t["step"] for t in _timeline(run)] == [0, 1, 2]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["start_step"] == 2 and summary["steps"] == 3
    assert json.loads((checkpoints / "latest.json").read_text())["step"] == 3
