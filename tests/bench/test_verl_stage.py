"""bench/verl_stage.py and bench/sessions/verl_session.sh on CPU: the carried wheels are installed only where the
environment verl runs under lacks their modules (real pip, real wheels built here), the import pre-flight names vLLM's
server, and the session's `check` phase runs the pre-flight alone."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import verl_stage  # noqa: E402


def make_wheel(folder: Path, dist: str, version: str, modules: dict[str, str], top_level: list[str] | None = None):
    """A minimal valid pure-Python wheel: ``modules`` maps a path in the wheel to its text."""
    info = f"{dist.replace('-', '_')}-{version}.dist-info"
    path = folder / f"{dist.replace('-', '_')}-{version}-py3-none-any.whl"
    files = dict(modules)
    files[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n"
    files[f"{info}/WHEEL"] = "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    if top_level is not None:
        files[f"{info}/top_level.txt"] = "\n".join(top_level) + "\n"
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


def stage(args: list[str], pythonpath: list[Path]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in pythonpath)}
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / "verl_stage.py"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_wheel_modules_reads_the_library_and_leaves_a_wheels_examples_and_tests_out(tmp_path):
    # TransferQueue's wheel lists its examples and tests as top-level packages beside the library
    listed = make_wheel(
        tmp_path,
        "transfer-thing",
        "0.1",
        {"transfer_thing/__init__.py": "", "tests/__init__.py": ""},
        top_level=["recipe", "tests", "transfer_thing"],
    )
    assert verl_stage.wheel_modules(str(listed)) == ("transfer-thing", "0.1", ["transfer_thing"])
    # no top_level.txt: read from the layout (a package, a single-file module; metadata folders left out)
    bare = make_wheel(tmp_path, "two-mods", "2.0", {"pkg_a/__init__.py": "", "single.py": "", "tests/t.py": ""})
    assert verl_stage.wheel_modules(str(bare)) == ("two-mods", "2.0", ["pkg_a", "single"])


def test_install_absent_never_shadows_what_the_environment_has_and_restages_only_a_new_version(tmp_path):
    wheels, image, target = tmp_path / "w", tmp_path / "image", tmp_path / "site-verl"
    wheels.mkdir()
    old_beta = make_wheel(wheels, "beta", "1.0", {"beta/__init__.py": "V = 1\n"})
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--target",
            str(image),
            str(old_beta),
        ],
        check=True,
        timeout=120,
    )
    (wheels / old_beta.name).unlink()
    alpha = make_wheel(wheels, "alpha", "1.0", {"alpha/__init__.py": "V = 1\n"})
    beta = make_wheel(wheels, "beta", "2.0", {"beta/__init__.py": "V = 2\n"})
    path = [target, image]  # verl's order: its own site first, then what the session already has

    first = stage(["--install-absent", str(alpha), str(beta), "--target", str(target)], path)
    assert first.returncode == 0, first.stderr
    assert (target / "alpha" / "__init__.py").is_file()
    assert not (target / "beta").exists()  # the image's beta 1.0 stays the one imported
    assert "install alpha-1.0" in first.stdout and "alpha absent" in first.stdout
    assert "skip    beta-2.0" in first.stdout
    assert f"beta already provided by {os.path.realpath(image)} (beta 1.0; carried 2.0 not installed)" in first.stdout
    assert "1 to install" in first.stdout and "1 skipped" in first.stdout

    again = stage(["--install-absent", str(alpha), str(beta), "--target", str(target)], path)
    assert again.returncode == 0, again.stderr
    assert "alpha 1.0 already staged" in again.stdout and "0 to install" in again.stdout

    (wheels / "new").mkdir()
    alpha2 = make_wheel(wheels / "new", "alpha", "1.1", {"alpha/__init__.py": "V = 11\n"})
    newer = stage(["--install-absent", str(alpha2), "--target", str(target)], path)
    assert newer.returncode == 0, newer.stderr
    assert "alpha 1.0 in" in newer.stdout and "replaced by 1.1" in newer.stdout
    assert (target / "alpha" / "__init__.py").read_text() == "V = 11\n"


def test_the_preflight_names_vllms_server_and_knows_whether_vllm_is_staged(tmp_path):
    # verl's vLLM rollout starts vLLM's OpenAI server: its modules failed on the GPU where the LLM path did not
    for mod in (
        "vllm.entrypoints.cli.serve",
        "vllm.entrypoints.openai.api_server",
        "verl.workers.rollout.vllm_rollout.vllm_async_server",
    ):
        assert mod in verl_stage.CHECK_MODULES
    assert any(w.startswith("model-hosting-container-standards==") for w in verl_stage.WHEELS)
    assert stage(["--vllm-staged"], [tmp_path]).returncode == (0 if verl_stage.vllm_staged() else 1)
    fake = tmp_path / "with_vllm"
    (fake / "vllm").mkdir(parents=True)
    (fake / "vllm" / "__init__.py").write_text("")
    assert stage(["--vllm-staged"], [fake]).returncode == 0


@pytest.mark.skipif(verl_stage.vllm_staged(), reason="here vLLM is importable: the point is a missing module")
def test_session_check_phase_runs_the_preflight_alone_and_fails_on_a_missing_module(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "VERL_SITE": str(tmp_path / "site-verl"), "PY": sys.executable}
    session = ROOT / "bench" / "sessions" / "verl_session.sh"
    done = subprocess.run(
        ["bash", str(session), "check"], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "import FAIL vllm.entrypoints.openai.api_server" in done.stdout
    assert "verl import check:" in done.stdout and "failed" in done.stdout
