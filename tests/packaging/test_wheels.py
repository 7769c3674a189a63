"""Each package builds a wheel and installs alone into a fresh virtualenv; the math of hybrid-algos needs torch only.

These install real wheels from the index (torch from the CPU build through PIP_CONSTRAINT), so they take a few
minutes; each package gets its own venv, as a user who installs just that package would have.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "hybrid-core": "hybrid_core",
    "hybrid-engines": "hybrid_engines",
    "hybrid-algos": "hybrid_algos",
    "hybrid-cli": "hybrid_cli",
}
HEAVY = ("ray", "transformers", "deepspeed", "hybrid_core", "hybrid_engines")


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert result.returncode == 0, (
        f"{' '.join(map(str, cmd))} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    return result


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory, package_index) -> Path:
    out = tmp_path_factory.mktemp("wheels")
    for dist in PACKAGES:
        _run([sys.executable, "-m", "build", "--wheel", "--outdir", str(out), str(ROOT / "packages" / dist)])
    return out


def _fresh_venv(path: Path) -> Path:
    _run([sys.executable, "-m", "virtualenv", "-q", str(path)])
    return path / "bin" / "python"


def _install_alone(python: Path, wheelhouse: Path, dist: str, extra: str = "") -> None:
    (wheel,) = wheelhouse.glob(f"{dist.replace('-', '_')}-*.whl")
    # Siblings resolve from the local wheelhouse (they are not on the index); everything else from the index.
    env = {**os.environ, "PIP_CONSTRAINT": str(ROOT / "constraints" / "cpu.txt")}
    _run([str(python), "-m", "pip", "install", "-q", "--find-links", str(wheelhouse), f"{wheel}{extra}"], env=env)


@pytest.mark.slow
@pytest.mark.parametrize("dist", list(PACKAGES))
def test_each_wheel_installs_alone_and_imports(dist: str, wheelhouse: Path, tmp_path: Path) -> None:
    python = _fresh_venv(tmp_path / "venv")
    _install_alone(python, wheelhouse, dist)
    module = PACKAGES[dist]
    out = _run([str(python), "-c", f"import {module}; print({module}.__version__)"]).stdout.strip()
    assert out == _version_in_repo(dist)
    if dist == "hybrid-cli":
        help_text = _run([str(python.parent / "hybrid"), "--help"]).stdout
        assert "ppo" in help_text and "grpo" in help_text


@pytest.mark.slow
def test_algos_math_imports_torch_only(wheelhouse: Path, tmp_path: Path) -> None:
    python = _fresh_venv(tmp_path / "venv")
    _install_alone(python, wheelhouse, "hybrid-algos")
    installed = _run([str(python), "-m", "pip", "list", "--format=freeze"]).stdout.lower()
    for heavy in ("ray", "transformers", "deepspeed", "hybrid-core", "hybrid-engines"):
        assert f"\n{heavy}==" not in f"\n{installed}", f"hybrid-algos alone pulled in {heavy}"
    probe = textwrap.dedent(
        f"""
        import sys
        import hybrid_algos
        from hybrid_algos import get_advantage_estimator, ppo_policy_loss
        loaded = sorted(m for m in {HEAVY!r} if m in sys.modules)
        print(",".join(loaded) or "none")
        """
    )
    assert _run([str(python), "-c", probe]).stdout.strip() == "none"


def test_algos_math_loads_no_heavy_module_even_when_installed() -> None:
    # In the full workspace env ray/transformers/deepspeed ARE installed: importing the math must still not load them.
    probe = f"import sys, hybrid_algos; print(','.join(m for m in {HEAVY!r} if m in sys.modules) or 'none')"
    assert _run([sys.executable, "-c", probe]).stdout.strip() == "none"


def _version_in_repo(dist: str) -> str:
    init = ROOT / "packages" / dist / "src" / PACKAGES[dist] / "__init__.py"
    for line in init.read_text().splitlines():
        if line.startswith("__version__"):
            return line.split("=", 1)[1].strip().strip("\"'")
    raise AssertionError(f"no __version__ in {init}")


@pytest.mark.slow
def test_algos_only_example_runs_with_torch_and_hybrid_algos_alone(wheelhouse: Path, tmp_path: Path) -> None:
    # examples/algos_only.py is what a downstream project importing only hybrid-algos does: it must run (and learn)
    # in a venv holding just torch and the hybrid-algos wheel, and load none of the heavy modules.
    python = _fresh_venv(tmp_path / "venv")
    _install_alone(python, wheelhouse, "hybrid-algos")
    installed = _run([str(python), "-m", "pip", "list", "--format=freeze"]).stdout.lower()
    for heavy in ("ray", "transformers", "deepspeed", "hybrid-core", "hybrid-engines"):
        assert f"\n{heavy}==" not in f"\n{installed}", f"hybrid-algos alone pulled in {heavy}"
    example = ROOT / "examples" / "algos_only.py"
    probe = textwrap.dedent(
        f"""
        import runpy, sys
        code = 0
        try:
            runpy.run_path({str(example)!r}, run_name="__main__")
        except SystemExit as e:
            code = e.code
        print("HEAVY:", ",".join(m for m in {HEAVY!r} if m in sys.modules) or "none")
        sys.exit(code)
        """
    )
    result = _run([str(python), "-c", probe], cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.stdout.splitlines()[-2:] == ["OK", "HEAVY: none"], result.stdout
