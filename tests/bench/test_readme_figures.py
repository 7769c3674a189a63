"""README's measured table is what bench/readme_figures.py makes of bench/RESULTS.md, and the generator's rules hold:
the median of the newest date's rows (misses included), variants kept apart, unmeasured metrics said to be so."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("readme_figures", ROOT / "bench" / "readme_figures.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["readme_figures"] = module
    spec.loader.exec_module(module)
    return module


def test_readme_table_matches_results():
    gen = _generator()
    assert gen.main(["--check"]) == 0, "README.md's measured table is stale: python bench/readme_figures.py --write"


def test_every_figure_metric_is_a_results_metric_or_said_unmeasured():
    gen = _generator()
    table = gen.render(gen.read_results())
    measured = {r.metric for r in gen.read_results()}
    for fig in gen.FIGURES:
        if fig.metric not in measured:
            assert f"not measured yet (`{fig.metric}`)" in table


def test_median_of_the_newest_date_with_misses_and_range(tmp_path):
    gen = _generator()
    results = tmp_path / "RESULTS.md"
    results.write_text(
        "| metric | value | unit | device | date | command |\n| --- | --- | --- | --- | --- | --- |\n"
        "| speedup vs TRL x | 2.50 | x (old code) | NVIDIA H100 80GB HBM3 | 2026-11-20 | `a` |\n"
        "| speedup vs TRL x | 0.90 | x (a miss) | NVIDIA H100 80GB HBM3 | 2026-11-24 | `b` |\n"
        "| speedup vs TRL x | 1.59 | x (the best) | NVIDIA H100 80GB HBM3 | 2026-11-24 | `b` |\n"
        "| speedup vs TRL x | 1.15 | x | NVIDIA H100 80GB HBM3 | 2026-11-24 | `b` |\n"
        "| generate overhead vs vLLM alone % | 40.0 | % (old variant) | NVIDIA H100 80GB HBM3 | 2026-11-24 | `c` |\n"
        "| generate overhead vs vLLM alone % | 0.3 | % (no log-probs on either side) | NVIDIA H100 | 2026-11-24 "
        "| `c` |\n",
        encoding="utf-8",
    )
    rows = gen.read_results(results)
    line = next(ln for ln in gen.render(rows).splitlines() if "vs TRL 1.16" in ln)
    # the median of the newest date's three rows, not the best one and not the older 2.50
    assert "**1.15 x** (range 0.9-1.59) | 3 | goal >= 1.5: missed" in line
    over = next(ln for ln in gen.render(rows).splitlines() if "without log-probs" in ln)
    assert "**0.3 %** | 1 |" in over  # the old variant's 40 % is another measurement, not averaged in


def test_check_fails_on_a_hand_edited_figure(tmp_path, monkeypatch):
    gen = _generator()
    readme = tmp_path / "README.md"
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    readme.write_text(text.replace("**1.15 x**", "**1.59 x**", 1), encoding="utf-8")
    monkeypatch.setattr(gen, "README", readme)
    assert gen.main(["--check"]) == 1


def test_a_failed_measurement_is_shown_as_a_miss(tmp_path):
    gen = _generator()
    results = tmp_path / "RESULTS.md"
    results.write_text(
        "| metric | value | unit | device | date | command |\n| --- | --- | --- | --- | --- | --- |\n"
        "| speedup vs TRL default x | failed | x (TRL default: CUDA out of memory in 3 of 3 turns) | NVIDIA H100 | "
        "2026-12-02 | `a` |\n",
        encoding="utf-8",
    )
    line = next(ln for ln in gen.render(gen.read_results(results)).splitlines() if "at its default (no sleep)" in ln)
    assert "**failed** (x (TRL default: CUDA out of memory" in line and ">= 1.5: no figure" in line
    assert "not measured yet" not in line
