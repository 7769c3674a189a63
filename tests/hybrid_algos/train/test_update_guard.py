"""One finiteness check per update in place of DeepSpeed's scan of every gradient tensor (update_guard.py), on real
DeepSpeed engines on the CPU (gloo): DeepSpeed's own scan is off under ZeRO-1/2 (the training loop's config), clean
updates pass and move the weights, a NaN loss stops the run before the optimizer sees it (the weights untouched), and
an inf gradient under finite losses stops it right after the step, naming the gradient norm."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("update_guard_worker.py")
CASES = [f"{stage},{case}" for stage in (1, 2, 3) for case in ("clean", "nan_loss", "inf_grad")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results() -> dict[tuple, dict]:
    env = {
        **os.environ,
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "CUDA_VISIBLE_DEVICES": "",
    }
    env.pop("LOCAL_WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, str(WORKER), *CASES], env=env, capture_output=True, text=True, timeout=600)
    rows = [json.loads(line[len("RESULT ") :]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and len(rows) == len(CASES), proc.stdout[-3000:] + proc.stderr[-3000:]
    return {(r["stage"], r["case"]): r for r in rows}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_clean_updates_pass_and_move_the_weights(results, stage):
    r = results[(stage, "clean")]
    assert "error" not in r, r
    assert r["raised"] is None and r["micro_steps_done"] == 4 and r["moved"]
    if stage < 3:  # ZeRO-1/2 take the flag; the loop's config turns their per-tensor scan off
        assert r["deepspeed_scan"] is False


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_nan_loss_never_reaches_the_optimizer(results, stage):
    r = results[(stage, "nan_loss")]
    assert "error" not in r, r
    assert r["raised"] and "micro-batch losses" in r["raised"] and "nan" in r["raised"]
    assert "actor rank 0, step 1" in r["raised"] and "--resume" in r["raised"]
    assert r["micro_steps_done"] == 1 and not r["moved"]  # stopped at the first update's boundary, nothing applied


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_an_inf_gradient_under_finite_losses_stops_the_run_after_the_step(results, stage):
    r = results[(stage, "inf_grad")]
    assert "error" not in r, r
    assert r["raised"] and "gradient norm" in r["raised"] and "last checkpoint" in r["raised"]
    assert r["micro_steps_done"] == 1
