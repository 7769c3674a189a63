"""Environment hygiene on a real local Ray: every worker sees the variables hybrid forwards (from the driver's
environment and from set_worker_env), Ray's temp/log folder is where we say, its logs rotate at the size we say, and
a worker's stacks can be asked for by signal."""

import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from hybrid_core import runtime_env
from hybrid_core.runtime_env import set_worker_env, worker_env_vars, worker_runtime_env

pytestmark = pytest.mark.timeout(180)


class EnvProbe:
    def env(self) -> dict:
        return dict(os.environ)

    def pid(self) -> int:
        return os.getpid()

    def stuck_in_a_phase(self, seconds: float) -> None:
        time.sleep(seconds)


def test_forwarding_rules_without_ray(monkeypatch):
    monkeypatch.setattr(runtime_env, "_extra", {})
    env = worker_env_vars({"LD_LIBRARY_PATH": "/x", "NCCL_DEBUG": "INFO", "HOME": "/root", "HYBRID_A": "1"})
    assert env == {"LD_LIBRARY_PATH": "/x", "NCCL_DEBUG": "INFO", "HYBRID_A": "1", "TOKENIZERS_PARALLELISM": "false"}
    set_worker_env({"MY_FLAG": "2"})
    assert worker_env_vars({})["MY_FLAG"] == "2"
    with pytest.raises(Exception, match="not a valid environment variable name"):
        set_worker_env({"1BAD": "x"})


def test_real_workers_see_the_environment_and_ray_uses_our_temp_dir(tmp_path, tmp_path_factory, monkeypatch):
    import ray

    from hybrid_core.cluster import connect
    from hybrid_core.stacks import request_dump, stack_file

    assert not ray.is_initialized()
    monkeypatch.setattr(runtime_env, "_extra", {})
    for name in ("RAY_ROTATION_MAX_BYTES", "RAY_ROTATION_BACKUP_COUNT"):
        monkeypatch.delenv(name, raising=False)
    temp = Path(tempfile.mkdtemp(prefix="hyray", dir="/tmp"))  # short: Ray's socket paths must stay under 108 bytes
    info = connect(num_cpus=1, temp_dir=str(temp), log_max_mb=7, log_backups=1)
    try:
        assert info.started_here
        # Set after Ray started, as on a cluster started from another shell: only the runtime env can carry them.
        lib = os.pathsep.join(p for p in (os.environ.get("LD_LIBRARY_PATH"), "/opt/hybrid-test/lib") if p)
        here = os.path.dirname(os.path.abspath(__file__))  # the workers import EnvProbe from this file through it
        path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), here, "/opt/hybrid-test/py") if p)
        monkeypatch.setenv("LD_LIBRARY_PATH", lib)
        monkeypatch.setenv("PYTHONPATH", path)
        monkeypatch.setenv("NCCL_DEBUG", "WARN")
        monkeypatch.setenv("HYBRID_STACKS_DIR", str(tmp_path / "logs"))
        monkeypatch.setenv("SOMETHING_PRIVATE", "not for workers")
        set_worker_env({"HYBRID_FROM_FLAG": "set via set_worker_env", "CUSTOM_LIB_DIR": "/opt/custom"})

        probe = ray.remote(EnvProbe).options(runtime_env=worker_runtime_env(), num_cpus=0).remote()
        env = ray.get(probe.env.remote(), timeout=60)
        assert env["LD_LIBRARY_PATH"] == lib and env["PYTHONPATH"] == path and env["NCCL_DEBUG"] == "WARN"
        assert env["HYBRID_FROM_FLAG"] == "set via set_worker_env" and env["CUSTOM_LIB_DIR"] == "/opt/custom"
        assert "SOMETHING_PRIVATE" not in env
        # bounded logs: Ray's processes (and so its workers) run with our rotation settings
        assert env["RAY_ROTATION_MAX_BYTES"] == str(7 << 20) and env["RAY_ROTATION_BACKUP_COUNT"] == "1"
        # Ray's temp and log folder is the one given
        session = temp / "session_latest"
        assert session.is_symlink() and (session / "logs").is_dir()
        assert any(name.startswith("raylet") for name in os.listdir(session / "logs"))

        # stacks on request: the setup hook registered the signal handler in the worker
        pid = ray.get(probe.pid.remote(), timeout=30)
        probe.stuck_in_a_phase.remote(20)
        time.sleep(2)
        assert request_dump(pid)
        dump = stack_file(str(tmp_path / "logs"), pid)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and "stuck_in_a_phase" not in _read(dump):
            time.sleep(0.2)
        assert "stuck_in_a_phase" in _read(dump)
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return ""
