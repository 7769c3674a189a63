"""The docs' code runs: every runnable block of the READMEs (rules in readme_blocks.py) in a fresh interpreter, from
an empty folder, under a deadline; the blocks that cannot run here still compile and import only names that exist;
every package README has its sections and its Public API table names only things that import."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from readme_blocks import PACKAGES, ROOT, all_blocks, api_names, hybrid_imports, resolve

BLOCKS = all_blocks()
RUN = [b for b in BLOCKS if b.runs]
NOT_RUN = [b for b in BLOCKS if b.lang == "python" and not b.runs]
DEADLINE_S = 300  # the docs promise seconds; the deadline only guards against a hang on a loaded CI machine (a
# block that starts a local Ray took over 120 s on a 2-core machine running another job)


def _env() -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)  # the environment's `hybrid` script and python come first
    return {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    }


@pytest.mark.parametrize("block", RUN, ids=[b.id for b in RUN])
def test_block_runs(block, tmp_path: Path) -> None:
    if block.lang == "python":
        script = tmp_path / "block.py"
        script.write_text(block.code)
        cmd = [sys.executable, str(script)]
    else:
        cmd = ["bash", "-euo", "pipefail", "-c", block.code]
    start = time.monotonic()
    result = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=DEADLINE_S)
    assert result.returncode == 0, (
        f"{block.id} failed (exit {result.returncode}):\n{block.code}\n--- stdout\n"
        f"{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}"
    )
    assert result.stdout.strip(), f"{block.id} printed nothing: a README example should show its result"
    print(f"{block.id}: {time.monotonic() - start:.1f} s")


@pytest.mark.parametrize("block", NOT_RUN, ids=[b.id for b in NOT_RUN])
def test_block_not_run_still_matches_the_api(block) -> None:
    compile(block.code, block.id, "exec")
    for module, name in hybrid_imports(block.code):
        assert hasattr(resolve(module), name), f"{block.id}: `from {module} import {name}`: no such name"


@pytest.mark.parametrize("package", PACKAGES)
def test_package_readme_has_install_example_and_api(package: str) -> None:
    readme = ROOT / "packages" / package / "README.md"
    text = readme.read_text()
    for section in ("## Install", "## Public API"):
        assert section in text, f"{readme} has no '{section}' section"
    assert "(written with the package)" not in text, f"{readme} is still the placeholder"
    assert f"pip install {package}" in text or f'pip install "{package}' in text, f"{readme}: no install line"
    own = [b for b in RUN if b.path == readme]
    assert own, f"{readme} has no example the test suite runs"


@pytest.mark.parametrize("package", PACKAGES)
def test_public_api_table_names_exist(package: str) -> None:
    readme = ROOT / "packages" / package / "README.md"
    names = api_names(readme)
    assert len(names) >= 5, f"{readme}: the Public API table lists only {names}"
    missing = []
    for name in names:
        try:
            resolve(name)
        except (ImportError, AttributeError) as e:
            missing.append(f"{name} ({type(e).__name__}: {e})")
    assert not missing, f"{readme} lists names that do not exist: {missing}"


def test_marker_rules_are_applied() -> None:
    # A python block marked "not run" must say why; a bash block is never run unless marked.
    for block in BLOCKS:
        if block.mark == "not run":
            line = block.path.read_text().splitlines()[block.line - 2]
            assert ":" in line, f"{block.id}: say why it is not run: <!-- not run: reason -->"
    assert any(b.lang == "bash" and not b.runs for b in BLOCKS)  # e.g. the install lines
