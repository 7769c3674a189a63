"""The run's own CUDA MPS (hybrid_core.mps_daemon): the decision for every mode, why a daemon cannot start, the
daemon's life against a stand-in ``nvidia-cuda-mps-control`` (no MPS on a CPU machine), the SM split, the advisor."""

from __future__ import annotations

import os
import stat

import pytest

from fake_mps import write_fake_control
from hybrid_core import mps_daemon as md
from hybrid_core.errors import ConfigError


# ---- decide ---------------------------------------------------------------------------------------------------------
def _probe(result):
    return lambda **kw: result


@pytest.mark.parametrize("async_mode", ["off", "sync", "split", "shared"])
@pytest.mark.parametrize("problem", [None, "no GPU"])
def test_off_decides_nothing_and_probes_nothing(async_mode, problem):
    def probe(**kw):
        raise AssertionError("off must not probe")

    assert md.decide("off", async_mode=async_mode, probe=probe) == md.MpsDecision()


@pytest.mark.parametrize("async_mode", ["off", "sync", "split", "shared"])
def test_on_that_cannot_start_is_refused_naming_run_mps(async_mode):
    with pytest.raises(ConfigError, match="no GPU here") as e:
        md.decide("on", async_mode=async_mode, probe=_probe("no GPU here"))
    assert e.value.field == "run.mps"


@pytest.mark.parametrize("async_mode", ["off", "sync", "split", "shared"])
def test_on_starts_whatever_the_mode_with_shares_only_when_shared(async_mode):
    d = md.decide("on", async_mode=async_mode, engine_share=60, probe=_probe(None))
    assert d.start and d.mode == "on" and "asked for" in d.note
    if async_mode == "shared":
        assert d.shares == (60, 40)
        assert d.engine_env() == {md.SHARE_ENV: "60"} and d.trainer_env() == {md.SHARE_ENV: "40"}
    else:  # the two sides take turns: a share would only slow each
        assert d.shares is None and d.engine_env() == d.trainer_env() == {}


@pytest.mark.parametrize("async_mode", ["off", "sync", "split", "shared"])
def test_auto_that_cannot_start_is_off_and_says_why(async_mode):
    d = md.decide("auto", async_mode=async_mode, probe=_probe("no GPU here"))
    assert not d.start and "auto: off" in d.note and "no GPU here" in d.note


@pytest.mark.parametrize("async_mode", ["off", "sync", "split"])
def test_auto_without_overlap_on_shared_gpus_is_off(async_mode):
    d = md.decide("auto", async_mode=async_mode, engine_share=60, probe=_probe(None))
    assert not d.start and f"asynchronous mode {async_mode}" in d.note and d.engine_env() == {}


def test_auto_with_overlap_on_shared_gpus_starts():
    d = md.decide("auto", async_mode="shared", probe=_probe(None))
    assert d.start and d.shares is None and "no SM shares" in d.note
    d = md.decide("auto", async_mode="shared", engine_share=30, probe=_probe(None))
    assert d.start and d.shares == (30, 70)


def test_decide_passes_the_joined_cluster_to_the_probe():
    seen = {}
    md.decide("auto", async_mode="shared", joined_cluster="10.0.0.1:6379", probe=lambda **kw: seen.update(kw))
    assert seen == {"joined_cluster": "10.0.0.1:6379"}


# ---- why_not --------------------------------------------------------------------------------------------------------
def _why(tmp_path, **over):
    kw = dict(
        env={md.PIPE_ENV: str(tmp_path / "none")},
        which=lambda name: "/usr/bin/" + name,
        gpus=lambda: 2,
        running=lambda: [],
    )
    kw.update(over)
    return md.why_not(**kw)


def test_why_not_is_none_when_everything_is_there(tmp_path, monkeypatch):
    monkeypatch.setattr(md, "DEFAULT_PIPE_DIRECTORY", str(tmp_path / "default"))
    assert _why(tmp_path) is None


def test_why_not_names_each_missing_part(tmp_path, monkeypatch):
    monkeypatch.setattr(md, "DEFAULT_PIPE_DIRECTORY", str(tmp_path / "default"))
    assert "not on PATH" in _why(tmp_path, which=lambda name: None)
    assert "no CUDA GPU" in _why(tmp_path, gpus=lambda: 0)
    assert "10.1.1.1:6379" in _why(tmp_path, joined_cluster="10.1.1.1:6379")
    assert "pid 123, 456" in _why(tmp_path, running=lambda: [123, 456])
    pipe = tmp_path / "theirs"
    pipe.mkdir()
    os.mkfifo(pipe / "control")
    assert str(pipe) in _why(tmp_path, env={md.PIPE_ENV: str(pipe)})  # someone else's daemon serves the GPUs


def test_why_not_looks_its_probes_up_when_called(tmp_path, monkeypatch):
    monkeypatch.setattr(md, "DEFAULT_PIPE_DIRECTORY", str(tmp_path / "default"))
    monkeypatch.setattr(md, "cuda_gpu_count", lambda: 0)
    assert "no CUDA GPU" in md.why_not(env={}, which=lambda n: "/x", running=lambda: [])


# ---- the daemon -----------------------------------------------------------------------------------------------------
def test_the_daemon_opens_its_pipe_in_private_folders_and_stop_removes_them(tmp_path):
    binary = write_fake_control(tmp_path)
    daemon = md.MpsDaemon(str(tmp_path / "run" / "logs" / "mps"), str(tmp_path / "tmp"), binary=binary)
    env = daemon.start()
    assert env == {md.PIPE_ENV: daemon.pipe_dir, md.LOG_ENV: str(tmp_path / "run" / "logs" / "mps")}
    assert daemon.pipe_dir.startswith(str(tmp_path / "tmp"))
    assert stat.S_ISFIFO(os.stat(os.path.join(daemon.pipe_dir, "control")).st_mode)
    assert stat.S_IMODE(os.stat(daemon.pipe_dir).st_mode) == 0o700
    root = os.path.dirname(daemon.pipe_dir)
    daemon.stop()
    assert not os.path.exists(root)
    daemon.stop()  # idempotent: no second quit
    calls = (tmp_path / "run" / "logs" / "mps" / "calls").read_text().splitlines()
    assert calls == ["-d", ""]  # started once, quit once
    assert os.path.isdir(tmp_path / "run" / "logs" / "mps")  # the log stays with the run


def test_a_daemon_that_fails_is_a_config_error_and_leaves_nothing(tmp_path, monkeypatch):
    binary = write_fake_control(tmp_path)
    monkeypatch.setenv("FAKE_MPS_FAIL", "no GPU")
    daemon = md.MpsDaemon(str(tmp_path / "log"), str(tmp_path / "tmp"), binary=binary)
    with pytest.raises(ConfigError, match=r"run\.mps.*status 3 \(cannot start: no GPU\)"):
        daemon.start()
    assert os.listdir(tmp_path / "tmp") == [] and not daemon.running


def test_a_daemon_that_never_opens_its_pipe_is_a_config_error(tmp_path):
    binary = tmp_path / "silent"
    binary.write_text("#!/bin/sh\nexit 0\n")
    binary.chmod(0o755)
    daemon = md.MpsDaemon(str(tmp_path / "log"), str(tmp_path / "tmp"), binary=str(binary))
    with pytest.raises(ConfigError, match=r"run\.mps.*did not open its pipe"):
        daemon.start(timeout_s=0.3)
    assert os.listdir(tmp_path / "tmp") == []


def test_a_missing_binary_is_a_config_error(tmp_path):
    daemon = md.MpsDaemon(str(tmp_path / "log"), str(tmp_path / "tmp"), binary=str(tmp_path / "absent"))
    with pytest.raises(ConfigError, match=r"run\.mps.*did not start"):
        daemon.start()
    assert os.listdir(tmp_path / "tmp") == []


def test_daemon_for_run_sets_the_workers_env_and_takes_it_back_however_the_run_ends(tmp_path, monkeypatch):
    from hybrid_core import runtime_env

    monkeypatch.setattr(runtime_env, "_extra", {})
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    write_fake_control(tmp_path)
    decision = md.MpsDecision("on", True, "note", (60, 40))
    run = md.daemon_for_run(decision, str(tmp_path / "log"), str(tmp_path / "tmp"))
    with pytest.raises(KeyboardInterrupt), run as daemon:
        env = runtime_env.worker_env_vars({})
        assert env[md.PIPE_ENV] == daemon.pipe_dir and env[md.LOG_ENV] == str(tmp_path / "log")
        assert env[md.SHARE_ENV] == "40"  # the trainers'; the engines add their own
        assert runtime_env.worker_runtime_env(decision.engine_env())["env_vars"][md.SHARE_ENV] == "60"
        raise KeyboardInterrupt
    assert not daemon.running and os.listdir(tmp_path / "tmp") == []
    assert not {md.PIPE_ENV, md.LOG_ENV, md.SHARE_ENV} & set(runtime_env.worker_env_vars({}))


@pytest.mark.parametrize("decision", [None, md.MpsDecision(), md.MpsDecision("auto", note="auto: off")])
def test_daemon_for_run_without_a_start_starts_nothing(tmp_path, decision):
    with md.daemon_for_run(decision, str(tmp_path / "log"), str(tmp_path / "tmp")) as daemon:
        assert daemon is None
    assert not os.path.exists(tmp_path / "log") and not os.path.exists(tmp_path / "tmp")


# ---- SM shares ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("generate_s", "train_s", "expected"),
    [
        (1.0, 1.0, (50, 50)),
        (3.0, 1.0, (75, 25)),
        (1.0, 2.0, (35, 65)),  # 33.3 rounds to 35
        (100.0, 1.0, (90, 10)),  # never below the floor
        (0.0, 5.0, (10, 90)),
        (0.0, 0.0, (50, 50)),
        (float("nan"), 1.0, (50, 50)),
        (-1.0, 1.0, (50, 50)),
    ],
)
def test_choose_sm_shares_rounds_and_bounds(generate_s, train_s, expected):
    assert md.choose_sm_shares(generate_s, train_s) == expected


def test_choose_sm_shares_honours_its_step_and_floor():
    engine, trainer = md.choose_sm_shares(1.0, 2.0, step=10, floor=40)
    assert (engine, trainer) == (40, 60)


# ---- the advisor ----------------------------------------------------------------------------------------------------
def test_share_advisor_suggests_once_then_again_on_drift():
    advisor = md.ShareAdvisor((60, 40))
    notes = []
    times = [(9.0, 1.0), (3.0, 1.0), (3.0, 1.0), (3.0, 1.0), (3.1, 1.0), (1.0, 1.0), (1.0, 1.0)]
    history = []
    for step, (g, t) in enumerate(times):
        metrics, note = advisor.observe(step, g, t)
        history.append(metrics)
        notes.append(note)
        assert metrics["mps/engine_pct"] == 60 and metrics["mps/trainer_pct"] == 40
    assert notes[:3] == [None, None, None]  # the warm-up step, then a window of three
    assert "mps/phase_ratio" not in history[2]
    assert "engines 75 %, trainers 25 %" in notes[3] and "run.mps_engine_share 75" in notes[3]
    assert "engines 60 %, trainers 40 %" in notes[3]  # what the processes keep
    assert history[3]["mps/suggested_engine_pct"] == 75 and history[3]["mps/drift"] == 0
    assert notes[4] is None and notes[5] is None  # the median (3.0 then 3.0) has not moved
    assert "more than 25%" in notes[6] and history[6]["mps/drift"] == 1  # median 1.0: a new split
    assert history[6]["mps/suggested_engine_pct"] == 50


def test_share_advisor_without_applied_shares_says_none_and_skips_empty_phases():
    advisor = md.ShareAdvisor(None, warmup=0, window=1)
    metrics, note = advisor.observe(0, 0.0, 1.0)
    assert note is None and metrics == {"mps/engine_pct": 100.0, "mps/trainer_pct": 100.0}
    metrics, note = advisor.observe(1, 1.0, 1.0)
    assert "no share (every SM for each)" in note and metrics["mps/suggested_engine_pct"] == 50
