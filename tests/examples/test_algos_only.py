"""examples/algos_only.py: the hybrid-algos math in a plain PyTorch loop learns with every estimator, and loads
nothing but torch and hybrid_algos (here ray/transformers/deepspeed are installed; the example must not import them).
tests/packaging/test_wheels.py also runs it in a fresh virtualenv holding only torch and the hybrid-algos wheel."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "algos_only.py"
HEAVY = ("ray", "transformers", "deepspeed", "hybrid_core", "hybrid_engines", "hybrid_algos.train")

# Run the example as __main__, then report which heavy modules it loaded.
PROBE = f"""
import runpy, sys
try:
    runpy.run_path({str(EXAMPLE)!r}, run_name="__main__")
except SystemExit as e:
    code = e.code
else:
    code = 0
print("HEAVY:", ",".join(m for m in {HEAVY!r} if m in sys.modules) or "none")
sys.exit(code)
"""


def test_algos_only_learns_with_every_estimator_and_imports_torch_only(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    lines = result.stdout.splitlines()
    assert "OK" in lines and "HEAVY: none" in lines, result.stdout
    seen = {}
    for line in lines:
        m = re.fullmatch(r"(\w+) +reward ([\d.]+) -> ([\d.]+)", line)
        if m:
            seen[m.group(1)] = (float(m.group(2)), float(m.group(3)))
    assert set(seen) == {"grpo", "rloo", "reinforce_plus_plus", "gae"}, result.stdout
    for estimator, (before, after) in seen.items():
        assert before < 0.2 and after > 0.6, f"{estimator}: {before} -> {after}"
