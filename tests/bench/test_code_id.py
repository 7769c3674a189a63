"""Every RESULTS.md row names the code that measured it: bench/_common.py's code_id(), a hash of packages/*/src
computed from the tree (the lent GPU machine's copy has no .git), written into the unit cell by append_results and
by engines_gpu.py's own record(), and read back by bench/readme_figures.py."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import engines_gpu  # noqa: E402
from _common import Row, append_results, code_id  # noqa: E402


def _tree(root: Path) -> Path:
    """A checkout's shape: two packages' sources, their tests, the benches, the tests, a README."""
    files = {
        "packages/hybrid-core/src/hybrid_core/__init__.py": "VERSION = 1\n",
        "packages/hybrid-core/src/hybrid_core/sub/deep.py": "def f():\n    return 1\n",
        "packages/hybrid-engines/src/hybrid_engines/vllm.py": "ENGINE = 'vllm'\n",
        "packages/hybrid-core/src/hybrid_core/data/table.json": "{}\n",
        "packages/hybrid-core/tests/test_x.py": "def test(): pass\n",
        "packages/hybrid-core/pyproject.toml": "[project]\nname = 'hybrid-core'\n",
        "bench/weight_sync.py": "print('bench')\n",
        "bench/RESULTS.md": "| metric | value | unit | device | date | command |\n",
        "tests/bench/test_y.py": "def test(): pass\n",
        "README.md": "# hybrid\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_code_id_is_the_same_for_a_copy_of_the_tree_without_git(tmp_path):
    here = _tree(tmp_path / "here")
    (here / ".git").mkdir()
    (here / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    lent = tmp_path / "lent"
    shutil.copytree(here, lent, ignore=shutil.ignore_patterns(".git"))  # what the GPU machine gets
    got = code_id(here)
    assert got == code_id(lent)
    assert len(got) == 10 and int(got, 16) >= 0


def test_code_id_ignores_everything_outside_packages_src_python(tmp_path):
    root = _tree(tmp_path)
    before = code_id(root)
    (root / "bench" / "weight_sync.py").write_text("print('measured differently')\n")
    (root / "bench" / "RESULTS.md").write_text("| a new row |\n")
    (root / "tests" / "bench" / "test_y.py").write_text("def test(): assert 0\n")
    (root / "README.md").write_text("# changed\n")
    (root / "packages/hybrid-core/tests/test_x.py").write_text("def test(): assert 0\n")
    (root / "packages/hybrid-core/pyproject.toml").write_text("[project]\nname = 'other'\n")
    (root / "packages/hybrid-core/src/hybrid_core/data/table.json").write_text('{"a": 1}\n')
    cache = root / "packages/hybrid-core/src/hybrid_core/__pycache__"
    cache.mkdir()
    (cache / "stale.py").write_text("X = 2\n")  # an interpreter's cache, not in the lent copy
    assert code_id(root) == before


def test_code_id_changes_with_any_package_source_file(tmp_path):
    root = _tree(tmp_path)
    seen = {code_id(root)}
    deep = root / "packages/hybrid-core/src/hybrid_core/sub/deep.py"
    deep.write_text("def f():\n    return 2\n")  # an edit, nested
    seen.add(code_id(root))
    (root / "packages/hybrid-engines/src/hybrid_engines/new.py").write_text("")  # a new (even empty) module
    seen.add(code_id(root))
    deep.rename(deep.with_name("renamed.py"))  # the same bytes under another name
    seen.add(code_id(root))
    assert len(seen) == 4


def test_append_results_tags_each_row_and_readme_figures_reads_it_back(tmp_path, readme_figures):
    gen = readme_figures
    scratch = tmp_path / "RESULTS.md"
    rows = [
        Row("weight sync GB/s", 98.8, "GB/s (CUDA IPC buckets; median)"),
        Row("not a figure", 1.0, "s", record=False),
    ]
    assert append_results(rows, "NVIDIA H200", path=scratch, command="python bench/weight_sync.py") == 1
    assert append_results(rows[:1], "NVIDIA H200", path=scratch, code="0123456789") == 1
    lines = scratch.read_text().splitlines()
    assert lines[0] == "| metric | value | unit | device | date | command |"
    assert all(len(line.strip().strip("|").split("|")) == 6 for line in lines)  # still six columns
    assert f"| GB/s (CUDA IPC buckets; median); code {code_id()} |" in lines[2]
    got = gen.read_results(scratch)
    assert [(r.code, r.unit) for r in got] == [
        (code_id(), "GB/s (CUDA IPC buckets; median)"),
        ("0123456789", "GB/s (CUDA IPC buckets; median)"),
    ]


def test_engines_gpu_record_tags_rows_with_the_code_that_measured(tmp_path, readme_figures):
    gen = readme_figures
    scratch = tmp_path / "RESULTS.md"
    results = {
        "command": "python bench/engines_gpu.py --record",
        "date": "2026-12-03",
        "device": "NVIDIA H200",
        "metrics": {"vllm wake s": 0.41, "vllm sleep level 1 GiB left": None},
    }
    assert engines_gpu.record(results, scratch) == 1  # no JSON code (an old run's): this tree's
    assert engines_gpu.record({**results, "code": "abcdef0123"}, scratch) == 1  # --append-from of a device run
    got = gen.read_results(scratch)
    assert [(r.metric, r.value, r.unit, r.code) for r in got] == [
        ("vllm wake s", 0.41, "s", code_id()),
        ("vllm wake s", 0.41, "s", "abcdef0123"),
    ]
