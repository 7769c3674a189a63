"""A local run's Ray is closed to the network and to other users: every server of it (GCS, raylet, the driver, the
actors) listens on the loopback interface only, and it takes Ray's token authentication with a token of its own, so
a client without that token is turned away.

The local Ray is started by ``hybrid_core.cluster.connect`` in a fresh process (as ``hybrid grpo`` does), with no
RAY_AUTH_MODE in its environment (the user chose nothing); the test reads that process tree's listening sockets with
psutil, then tries to join the cluster from outside with no token, a wrong one, and the right one.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap

import pytest

psutil = pytest.importorskip("psutil")

LOCAL_RUN = textwrap.dedent("""
    import json, os, sys, time
    import psutil, ray
    from hybrid_core.cluster import connect

    info = connect(num_cpus=1, num_gpus=1, temp_dir=sys.argv[1])

    @ray.remote(num_cpus=0)
    class Worker:  # an actor serves gRPC like every role and engine of a run
        def pid(self):
            return os.getpid()

    worker = Worker.remote()
    pids = {os.getpid(), ray.get(worker.pid.remote(), timeout=60)}
    time.sleep(1)
    pids |= {p.pid for p in psutil.Process().children(recursive=True)}
    listening = []
    for conn in psutil.net_connections(kind="inet"):
        if conn.status == psutil.CONN_LISTEN and conn.pid in pids:
            listening.append([conn.laddr.ip, conn.laddr.port, psutil.Process(conn.pid).name(), conn.pid])
    print(json.dumps({"gcs": info.address, "node_ip": info.node_ip, "listening": listening,
                      "auth": os.environ.get("RAY_AUTH_MODE"), "token": os.environ.get("RAY_AUTH_TOKEN"),
                      "actor_pid": ray.get(worker.pid.remote(), timeout=60)}), flush=True)
    sys.stdin.readline()  # stay up while the test knocks on the door
    ray.shutdown()
""")

JOIN = textwrap.dedent("""
    import sys, ray
    try:
        ray.init(address=sys.argv[1])
        print("joined", ray.cluster_resources().get("GPU"))
    except Exception as e:
        print("refused", type(e).__name__, str(e)[:300], repr(e.__cause__)[:300])
""")


def _network_ips() -> list[str]:
    """This machine's IPv4 addresses other than loopback (where a remote attacker would knock)."""
    return [
        a.address
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family == socket.AF_INET and not a.address.startswith("127.")
    ]


def _env(**changes):
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_ADDRESS")}
    env.update({k: v for k, v in changes.items() if v is not None})
    return env


@pytest.mark.timeout(300)
def test_a_local_run_listens_on_loopback_only_and_requires_its_token(tmp_path):
    home = tmp_path / "home"  # no ~/.ray/auth_token of the machine's user can leak in
    home.mkdir()
    ray_dir = tempfile.mkdtemp(prefix="hyray", dir="/tmp")  # Ray's socket paths must stay under 108 bytes
    run = subprocess.Popen(
        [sys.executable, "-c", LOCAL_RUN, ray_dir],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(HOME=str(home)),
    )
    try:
        line = run.stdout.readline()
        assert line, run.stderr.read()[-3000:]
        report = json.loads(line)
        # every Ray server of the run, actor included, on the loopback interface
        names = {name for _, _, name, _ in report["listening"]}
        assert {"gcs_server", "raylet"} <= names and any(n.startswith("ray::Worker") for n in names), names
        for ip, port, name, _ in report["listening"]:
            assert ip in ("127.0.0.1", "::1", "::ffff:127.0.0.1"), (ip, port, name)
        assert report["node_ip"] == "127.0.0.1" and report["gcs"].startswith("127.0.0.1:")
        # token authentication on, with a token of the run's own
        assert report["auth"] == "token" and len(report["token"]) >= 32

        # nothing of the run answers on the machine's network address (ports another process on this machine
        # serves there, such as another Ray's fixed agent port, cannot tell us anything)
        ours = {pid for *_, pid in report["listening"]}
        taken = {
            c.laddr.port
            for c in psutil.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.pid not in ours
        }
        for ip in _network_ips():
            for _, port, name, _ in report["listening"]:
                if port in taken:
                    continue
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                    probe.settimeout(2)
                    assert probe.connect_ex((ip, port)) != 0, f"{name} answers on {ip}:{port}"

        def join(**auth):
            # a client on this machine (loopback, like the run), giving up after 2 tries instead of Ray's 20
            env = _env(HOME=str(home), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_NUM_REDIS_GET_RETRIES="2", **auth)
            out = subprocess.run(
                [sys.executable, "-c", JOIN, report["gcs"]], capture_output=True, text=True, timeout=120, env=env
            )
            return out.stdout.strip() or out.stderr[-500:], out.stderr

        for auth in (dict(RAY_AUTH_MODE="disabled"), dict(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 64)):
            answer, log = join(**auth)
            assert answer.startswith("refused"), (auth, answer)
            assert "InvalidAuthToken" in log or "Unauthenticated" in log, log[-1500:]  # turned away for the token
        assert join(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=report["token"])[0] == "joined 1.0"
    finally:
        if run.poll() is None:
            run.stdin.write("\n")
            run.stdin.flush()
            try:
                run.wait(timeout=60)
            except subprocess.TimeoutExpired:
                run.kill()
        shutil.rmtree(ray_dir, ignore_errors=True)


def test_joining_a_cluster_is_not_forced_onto_loopback(monkeypatch):
    """The local-only switch is on only while a local node starts: joining a real cluster later is unaffected."""
    from ray._private import ray_constants

    from hybrid_core import cluster

    monkeypatch.delenv(cluster.LOCAL_ONLY_ENV, raising=False)
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)  # as on a Linux machine outside the tests
    with cluster.loopback_only():
        assert os.environ[cluster.LOCAL_ONLY_ENV] == "0" and ray_constants.ENABLE_RAY_CLUSTER is False
    assert cluster.LOCAL_ONLY_ENV not in os.environ and ray_constants.ENABLE_RAY_CLUSTER is True


def test_a_users_own_auth_choice_is_kept():
    from hybrid_core import cluster

    env = {"RAY_AUTH_MODE": "disabled"}
    cluster.use_local_token(env)
    assert env == {"RAY_AUTH_MODE": "disabled"}
    env = {}
    cluster.use_local_token(env)
    assert env["RAY_AUTH_MODE"] == "token" and len(env["RAY_AUTH_TOKEN"]) == 64
    other = {}
    cluster.use_local_token(other)
    assert other["RAY_AUTH_TOKEN"] != env["RAY_AUTH_TOKEN"]  # a token of each run's own
