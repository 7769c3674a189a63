"""bench/lora_gpu.py on CPU (``--engine hf --tiny``): both phases in processes of their own, each with a trainer
process handing shared-memory buckets to the built-in engine -- the adapter alone, then the merged full weights --,
and the check that the engine generates with the adapter (its log-probs are the merged model's, not the base's).
vLLM is the GPU run's; the script's orchestration, rows and verdict are what this checks."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("peft")  # the built-in engine applies adapters through PEFT


@pytest.mark.slow
def test_the_lora_bench_runs_both_phases_and_checks_the_adapter(tmp_path):
    command = [sys.executable, str(ROOT / "bench" / "lora_gpu.py"), "--engine", "hf", "--tiny", "--size", "357m"]
    command += ["--workdir", str(tmp_path / "peer"), "--syncs", "2", "--prompts", "3", "--new-tokens", "6"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    for metric in ("lora sync s 357M tiny", "lora full-weights sync s 357M tiny", "lora sync speedup vs full 357M"):
        assert metric in out, out
    assert "OK: the engine generates with the adapter" in out, out
    adapter_mb, full_mb = (
        float(re.search(rf"^{metric} 357M tiny\s+([\d.]+)", out, re.M).group(1))
        for metric in ("lora adapter MB", "lora full-weights MB")
    )
    assert 0 < adapter_mb < full_mb  # what each sync sent: the adapter's bytes against the whole model's
