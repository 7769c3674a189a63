"""The one clock of peer comparisons (bench/_common.py): wall time between step ends, the same warm-up dropped on
every side, at least five measured steps; ours is read off metrics.jsonl's wall_time with it (bench/e2e_gpu.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from _common import median_step, steady_step_times  # noqa: E402


def test_step_k_is_the_time_between_the_ends_of_steps_k_minus_1_and_k():
    ends = [10.0, 12.0, 13.5, 14.5, 16.0, 17.0, 19.0, 20.0, 21.5]
    assert steady_step_times(ends, warmup=2) == [1.5, 1.0, 1.5, 1.0, 2.0, 1.0, 1.5]  # steps 3-9 (1, 2 dropped)
    assert steady_step_times(ends, warmup=1) == [2.0, 1.5, 1.0, 1.5, 1.0, 2.0, 1.0, 1.5]
    assert median_step(ends, warmup=2) == pytest.approx(1.5)
    with pytest.raises(ValueError):
        steady_step_times(ends, warmup=0)  # step 1 has no start on this clock


def test_fewer_than_five_measured_steps_give_no_figure():
    assert median_step([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], warmup=2) is None  # 4 measured
    assert median_step([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], warmup=2) == 1.0


def test_ours_is_timed_between_step_ends_with_everything_the_step_cost(tmp_path):
    """A step whose metrics say 1 s but which took 3 s of wall time (a checkpoint, the refinement) counts 3 s."""
    import e2e_gpu

    rows, wall = [], 100.0
    for k in range(8):
        wall += 3.0 if k == 5 else 1.0
        rows.append({"time/step": 1.0, "wall_time": wall, "reward": 0.0, "response_len": 4})
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = e2e_gpu.summarize(str(path), warmup=2)
    assert out["step_s_inside"] == 1.0
    assert out["steady_steps"] == 6
    assert out["step_s"] == 1.0  # the median of [1, 1, 1, 3, 1, 1]
    rows[6]["wall_time"] += 2.0
    rows[7]["wall_time"] += 4.0
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert e2e_gpu.summarize(str(path), warmup=2)["step_s"] == 2.0  # median of [1, 1, 1, 3, 3, 3]: not 1.0
