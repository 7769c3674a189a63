"""bench/trainer_gpu.py on CPU (``--size small``, gloo): the FSDP2 variants train through the real engine and the
loss path the policy worker uses, and the table and JSON name each variant; a variant it does not know is refused.
DeepSpeed's variant needs its CUDA Adam (the GPU run's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "bench" / "trainer_gpu.py")
SMALL = ["--size", "small", "--device", "cpu", "--micro", "2", "--seq", "32", "--micro_batches", "2"]


def test_fsdp2_variants_train_and_are_tabled(tmp_path):
    variants = ["fsdp2", "fsdp2:keep+bf16reduce"]
    done = subprocess.run(
        [sys.executable, SCRIPT, *SMALL, "--steps", "2", "--variants", *variants, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "trainer_gpu.json").read_text())["results"]
    assert [r["variant"] for r in results] == variants
    for r in results:
        assert "error" not in r, r
        assert len(r["steps_s"]) == 2 and r["step_s"] > 0
        assert r["variant"] in done.stdout


def test_an_unknown_variant_is_refused(tmp_path):
    done = subprocess.run(
        [sys.executable, SCRIPT, *SMALL, "--steps", "1", "--variants", "fsdp2:fast", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode != 0 and "unknown options ['fast']" in done.stdout + done.stderr
