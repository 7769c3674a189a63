"""Evaluation during training on the command line: ``--dry-run`` prints the evaluation (its prompts, its steps) and
the eval phase of the residency plan; bad evaluation input stops before Ray starts, naming the flag; OpenRLHF's
``--eval.*`` / ``--eval_*`` flags are honoured; the eval/ metrics reach every sink (metrics.jsonl, TensorBoard, W&B).
"""

from __future__ import annotations

import glob
import json
import os
import time

import pytest

from hybrid_cli.main import load_config, main
from hybrid_cli.metrics import MetricsLogger


@pytest.fixture
def held_out(tmp_path) -> str:
    path = tmp_path / "held_out.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"<bos> s{s} <sep>", "label": [s]}) + "\n" for s in range(4)))
    return str(path)


def _eval_flags(path: str) -> list[str]:
    return ["--eval_dataset", path, "--input_key", "prompt", "--label_key", "label"]


def test_dry_run_prints_the_evaluation_and_its_phase(held_out, tmp_path, capsys):
    argv = ["grpo", "--dry-run", "--save_path", str(tmp_path / "run"), *_eval_flags(held_out), "--eval_steps", "8"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    text = " ".join(out.split())  # the console wraps long lines
    assert "evaluation: 4 prompts from" in text and "4 samples each at temperature 0.6" in text
    assert "after steps 8, 16, 24, 32 (every 8, and the last)" in text and "eval/pass@4" in text
    eval_rows = [line for line in out.splitlines() if line.strip().startswith("eval ") and "peak" in line]
    assert len(eval_rows) == 1 and "rollout[" in eval_rows[0], out  # the residency plan's eval phase
    assert main(["grpo", "--dry-run", "--save_path", str(tmp_path / "plain")]) == 0
    out = capsys.readouterr().out
    assert "evaluation:" not in out and not [line for line in out.splitlines() if line.strip().startswith("eval ")]


def test_eval_steps_minus_one_evaluates_once_at_the_end_and_says_openrlhf_would_not(held_out, tmp_path, capsys):
    assert main(["grpo", "--dry-run", "--save_path", str(tmp_path / "run"), *_eval_flags(held_out)]) == 0
    text = " ".join(capsys.readouterr().out.split())  # the console wraps long lines
    assert "once, after the last step (32; --eval_steps -1: OpenRLHF's PPO would not evaluate at all)" in text


@pytest.mark.parametrize(
    "extra, field, fragment",
    [
        (["--eval_dataset", "/no/such/eval.jsonl"], "eval_dataset", "no file or folder at '/no/such/eval.jsonl'"),
        (["--eval_steps", "0"], "eval_steps", "must be -1 (once, after the last step) or a whole number >= 1"),
        (["--eval_steps", "-3"], "eval_steps", "got -3"),
        (["--eval_n_samples_per_prompt", "0"], "eval_n_samples_per_prompt", "must be a whole number >= 1"),
        (["--input_key", "question"], "input_key", "has no key 'question'"),
        (["--async_train"], "eval_dataset", "not built for an asynchronous run (--async_train) yet"),
    ],
)
def test_bad_evaluation_input_stops_before_ray(held_out, tmp_path, capsys, extra, field, fragment):
    import ray

    argv = ["grpo", "--dry-run", "--save_path", str(tmp_path / "run"), *_eval_flags(held_out), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"hybrid: error: {field}: " in err and fragment in err and "Fix:" in err, err
    assert not ray.is_initialized()


def test_an_eval_dataset_needs_the_prompt_key(held_out, tmp_path, capsys):
    argv = ["grpo", "--dry-run", "--save_path", str(tmp_path / "run"), "--eval_dataset", held_out]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "eval_dataset" in err and "--input_key (the field that holds a prompt) is not given" in err, err


@pytest.mark.parametrize("dotted", [True, False])
def test_openrlhf_eval_flags_are_honoured(held_out, tiny_model_dir, dotted):
    if dotted:
        argv = ["--actor.model_name_or_path", tiny_model_dir, "--data.input_key", "prompt", "--eval.dataset", held_out]
        argv += ["--eval.steps", "5", "--eval.temperature", "1.0", "--eval.n_samples_per_prompt", "2"]
        argv += ["--eval.split", "test"]
    else:
        argv = ["--pretrain", tiny_model_dir, "--actor_num_gpus_per_node", "1", "--input_key", "prompt"]
        argv += ["--eval_dataset", held_out, "--eval_steps", "5", "--eval_temperature", "1.0"]
        argv += ["--eval_n_samples_per_prompt", "2", "--eval_split", "test"]
    config, _, notes = load_config("ppo", argv)
    assert (config.eval_dataset, config.eval_steps, config.eval_temperature) == (held_out, 5, 1.0)
    assert (config.eval_n_samples_per_prompt, config.eval_split) == (2, "test")
    assert not any("eval" in n and "has no effect" in n for n in notes), notes


def test_openrlhf_eval_defaults_are_openrlhf_s(held_out, tiny_model_dir):
    """A dotted line that gives only the dataset gets OpenRLHF 0.11.2's other evaluation defaults (hybrid's too)."""
    argv = ["--actor.model_name_or_path", tiny_model_dir, "--data.input_key", "prompt", "--eval.dataset", held_out]
    config, _, _ = load_config("ppo", argv)
    assert (config.eval_steps, config.eval_split, config.eval_temperature, config.eval_n_samples_per_prompt) == (
        -1,
        "train",
        0.6,
        4,
    )


def test_eval_metrics_reach_every_sink(tmp_path, monkeypatch):
    """One step's record with the evaluation in it, through the run's metrics writer: a line of metrics.jsonl, scalars
    of TensorBoard's event file, and a W&B run (offline: no network here; its log file holds the keys)."""
    pytest.importorskip("tensorboard")
    wandb = pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    record = {"step": 3, "reward": 0.5, "eval/reward_mean": 0.75, "eval/pass@4": 1.0, "eval/response_length": 2.0}
    logger = MetricsLogger(str(tmp_path), tensorboard=True, wandb_key="True")
    logger.on_start({"run_dir": str(tmp_path)})
    logger.on_step(record)
    logger.on_end({})
    line = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert {k: line[k] for k in record} == record
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    for key in ("eval/reward_mean", "eval/pass@4", "eval/response_length"):
        assert [(e.step, e.value) for e in events.Scalars(key)] == [(3, record[key])]
    keys = ("eval/reward_mean", "eval/pass@4", "eval/response_length")
    # W&B's own service process writes the offline file; on a loaded machine it may still be flushing after finish()
    # returns (seen in CI beside another job): wait for it, a bound that only catches a writer that never writes
    deadline, data, runs = time.monotonic() + 120, b"", []
    while time.monotonic() < deadline:
        runs = glob.glob(os.path.join(tmp_path, "wandb", "offline-run-*", "run-*.wandb"))
        data = open(runs[0], "rb").read() if len(runs) == 1 else b""
        if all(key.encode() in data for key in keys):
            break
        time.sleep(0.5)
    assert len(runs) == 1, wandb.__version__
    assert all(key.encode() in data for key in keys)


def test_yaml_keys_are_the_flags_names(held_out, tmp_path):
    """--config FILE.yaml: hybrid's names and OpenRLHF's dotted ones, as on the command line."""
    path = tmp_path / "run.yaml"
    path.write_text(
        f"eval_dataset: {held_out}\ninput_key: prompt\nlabel_key: label\neval_steps: 8\n"
        "eval_pass_threshold: 0.5\neval.n_samples_per_prompt: 2\n"
    )
    config, _, _ = load_config("grpo", ["--config", str(path)])
    assert (config.eval_dataset, config.eval_steps, config.eval_pass_threshold) == (held_out, 8, 0.5)
    assert config.eval_n_samples_per_prompt == 2


def test_the_display_shows_the_evaluation():
    from rich.console import Console

    from hybrid_cli.progress import step_line, summary_table

    record = {"step": 3, "reward": 0.5, "kl": 0.01, "eval/reward_mean": 0.75, "eval/pass@4": 1.0, "time/eval": 0.2}
    line = step_line(record)
    assert "eval 0.750  pass@4 1.000" in line and "eval 0.20s" in line
    console = Console(width=200, record=True)
    console.print(summary_table([{"step": 0, "reward": 0.1}, record]))
    text = console.export_text()
    assert "eval reward first / last / best" in text and "0.750 / 0.750 / 0.750" in text
