"""The packaging tests build with hatchling in an isolated environment and install torch and the siblings into
fresh virtualenvs: they need pip's package index. A machine without one (an offline GPU box whose GPUs are hidden
for a CPU run, say) skips them, saying why, instead of failing on a name-resolution error."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.fixture(scope="session")
def package_index(tmp_path_factory) -> None:
    """Skip unless pip can fetch the build backend from its configured index (or find-links) right now."""
    out = tmp_path_factory.mktemp("index-probe")
    env = {**os.environ, "PIP_RETRIES": "0", "PIP_DEFAULT_TIMEOUT": "10"}  # an unreachable index fails in seconds
    probe = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--no-cache-dir",
            "-d",
            str(out),
            "hatchling>=1.24",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.skip(
            f"pip's package index is not reachable from this machine ({last}); these tests build wheels "
            "with hatchling and install torch into fresh virtualenvs"
        )
