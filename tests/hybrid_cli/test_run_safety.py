"""A run folder is safe: one run at a time holds it, ``--overwrite`` deletes only what a run of hybrid wrote, no
credential is written into it, a damaged checkpoint file is found and skipped, and a resume does not repeat steps.

One real run of ``hybrid grpo`` (the built-in demo model, a local Ray with a fake GPU) in a subprocess, then a
resumed run in this process; the other checks are on the functions that decide. ``wandb`` is not installed in CI
(and needs its servers): a stub module stands in for it, writing into the run folder what wandb writes there (the
config it is given and the command line).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

from hybrid_algos.train import marks
from hybrid_algos.train.checkpoint import CheckpointManager
from hybrid_algos.train.redact import REDACTED, hide_in_argv, redact, redact_argv, secrets_of
from hybrid_algos.train.run_folder import refuse_or_clear
from hybrid_algos.train.run_lock import LOCK
from hybrid_cli.main import main
from hybrid_cli.metrics import MetricsLogger

SMALL = [
    "--task_length",
    "1",
    "--rollout_batch_size",
    "4",
    "--n_samples_per_prompt",
    "2",
    "--train_batch_size",
    "8",
    "--micro_train_batch_size",
    "8",
    "--seed",
    "7",
    "--no_use_tensorboard",
]

WANDB_STUB = """
import json, os, sys

def login(key=None, relogin=False):
    with open(os.environ["WANDB_STUB_LOG"], "a") as f:
        f.write(json.dumps({"login": key}) + "\\n")

class _Run:
    def log(self, data, step=None):
        pass

    def finish(self):
        pass

def init(project=None, name=None, config=None, dir=None, resume=None, **kwargs):
    files = os.path.join(dir, "wandb", "run-stub", "files")
    os.makedirs(files, exist_ok=True)
    with open(os.path.join(files, "wandb-metadata.json"), "w") as f:
        json.dump({"args": sys.argv[1:]}, f)  # as wandb records the command line
    with open(os.path.join(files, "config.json"), "w") as f:
        json.dump(config, f)
    return _Run()
"""


def _steps(path):
    with open(path) as f:
        return [json.loads(line)["step"] for line in f]


def _tagged(tag):
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if f"HYBRID_TEST_TAG={tag}".encode() in f.read().split(b"\0") and int(entry) != os.getpid():
                    found.append(int(entry))
        except OSError:
            continue
    return found


def _kill_tagged(tag):
    for pid in _tagged(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ---- the decisions, without a run -------------------------------------------------------------------------------
def test_a_folder_of_user_files_is_refused_even_with_overwrite_and_nothing_is_deleted(tmp_path, capsys):
    run = tmp_path / "mine"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "important.txt").write_text("keep")
    (run / "final").mkdir()
    (run / "final" / "report.md").write_text("keep too")
    for extra in ([], ["--overwrite"]):
        assert main(["grpo", "--max_steps", "1", "--save_path", str(run), *extra, *SMALL]) == 2
        err = capsys.readouterr().err
        assert "final/, which no hybrid run wrote" in err and "Move it out of the folder" in err, err
        assert "pass --overwrite" not in err
    assert (run / "logs" / "important.txt").read_text() == "keep"
    assert (run / "final" / "report.md").read_text() == "keep too"
    assert not (run / LOCK).exists()  # a refused start leaves no lock behind


def test_overwrite_removes_what_a_run_claimed_and_keeps_the_rest(tmp_path):
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "important.txt").write_text("keep")  # the user's: the run writes its logs beside it
    mgr = CheckpointManager(str(run / "checkpoints"))
    refuse_or_clear(str(run), mgr, overwrite=False, resuming=False)  # a first run claims what it will write
    assert "metrics.jsonl" in marks.claimed(str(run)) and "logs" not in marks.claimed(str(run))
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    (run / "final").mkdir()
    (run / "final" / "model.safetensors").write_text("weights")
    (run / "tensorboard").mkdir()
    (run / "tensorboard" / "events").write_text("e")
    mgr.save(1, lambda folder: None, {"next_step": 1})
    refuse_or_clear(str(run), mgr, overwrite=True, resuming=False)
    assert sorted(os.listdir(run)) == [marks.MARKS, "checkpoints", "logs"]
    assert os.listdir(run / "logs") == ["important.txt"] and mgr.latest() is None


def test_metrics_of_a_resumed_run_start_at_its_checkpoint(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    first = MetricsLogger(str(run), tensorboard=True)
    first.on_start({"run_dir": str(run), "start_step": 0})
    for step in range(24):
        first.on_step({"step": step, "reward": float(step)})
    first._jsonl.write('{"step": 24, "rew')  # killed mid-write
    first.close()
    second = MetricsLogger(str(run), tensorboard=True)
    second.on_start({"run_dir": str(run), "start_step": 20})  # the checkpoint of step 20
    for step in range(20, 30):
        second.on_step({"step": step, "reward": 100.0 + step})
    second.close()
    assert _steps(run / "metrics.jsonl") == list(range(30))
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    scalars = events.Scalars("reward")  # steps 20..23 of the first run purged: each step once
    assert [e.step for e in scalars] == list(range(30))
    assert scalars[21].value == 121.0 and scalars[19].value == 19.0


def test_credentials_are_taken_out_of_what_is_written():
    from hybrid_algos.train import GRPOConfig

    key = "wandb-key-" + uuid.uuid4().hex
    config = GRPOConfig(use_wandb=key, reward_fn="http://bob:hunter22@rm.example/score?token=abc123")
    assert set(secrets_of(config)) == {key, "hunter22", "abc123"}
    dumped = json.dumps(redact(config.to_dict()))
    assert key not in dumped and "hunter22" not in dumped and "abc123" not in dumped and REDACTED in dumped
    assert redact({"use_wandb": "True", "note": f"key {key}"}) == {"use_wandb": "True", "note": f"key {REDACTED}"}
    assert redact_argv(["hybrid", "--use_wandb", key, f"--use_wandb={key}", "--use_wandb", "True"]) == [
        "hybrid",
        "--use_wandb",
        REDACTED,
        f"--use_wandb={REDACTED}",
        "--use_wandb",
        "True",
    ]
    argv = ["hybrid", "ppo", "--use_wandb", key]
    hide_in_argv(argv)
    assert argv == ["hybrid", "ppo", "--use_wandb", REDACTED]


# ---- one real run ------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_one_run_per_folder_no_secret_written_damaged_shard_skipped_and_resume_without_repeats(
    tmp_path, capsys, caplog
):
    from hybrid_algos.train.deepspeed_ops import ensure_cpu_ops_built

    ensure_cpu_ops_built()
    secret = "hybrid-test-key-" + uuid.uuid4().hex
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "important.txt").write_text("keep")  # the user's own files in the run folder
    (run / "notes.txt").write_text("keep")
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "wandb.py").write_text(WANDB_STUB)
    logins = tmp_path / "logins.jsonl"
    tag = uuid.uuid4().hex
    # WANDB_MODE=offline: the command's check of the key with W&B's server (metrics.check_wandb) is not the subject
    env = {
        **os.environ,
        "HYBRID_TEST_TAG": tag,
        "PYTHONUNBUFFERED": "1",
        "WANDB_STUB_LOG": str(logins),
        "WANDB_MODE": "offline",
        "PYTHONPATH": os.pathsep.join([str(stub), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hybrid_cli",
            "grpo",
            "--max_steps",
            "1000000",
            "--save_steps",
            "3",
            "--save_path",
            str(run),
            "--use_wandb",
            secret,
            *SMALL,
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    ckpt = CheckpointManager(str(run / "checkpoints"))
    try:
        deadline = time.monotonic() + 400
        # two checkpoints and steps done after the newest: what a resume repeats
        while not (
            len(ckpt.complete_checkpoints()) >= 2
            and (run / "metrics.jsonl").exists()
            and len(_steps(run / "metrics.jsonl")) > ckpt.complete_checkpoints()[-1][1] + 1
        ):
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "no checkpoints in time"
            time.sleep(0.2)
        for extra in ([], ["--overwrite"], ["--resume"]):  # a second run into the live folder: refused at once
            assert main(["grpo", "--max_steps", "2", "--save_path", str(run), *extra, *SMALL]) == 2
            err = capsys.readouterr().err
            assert f"in use by another run: pid {proc.pid} on {socket.gethostname()}, started " in err, err
        assert proc.poll() is None and (run / "metrics.jsonl").exists()  # the live run went on untouched
        os.killpg(proc.pid, signal.SIGKILL)  # it dies holding the lock
        proc.wait(timeout=60)
    finally:
        _kill_tagged(tag)
    assert (run / LOCK).exists()
    assert json.loads(logins.read_text().splitlines()[0]) == {"login": secret}  # W&B got the key; nothing wrote it

    # the newest checkpoint's model shard is damaged: the resume names it and continues from the one before
    (_previous, previous_step), (newest, _) = ckpt.complete_checkpoints()[-2:]
    shard = os.path.join(newest, "actor", "state", "mp_rank_00_model_states.pt")
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) // 2)
        data = f.read(64)
        f.seek(os.path.getsize(shard) // 2)
        f.write(bytes(b ^ 0xFF for b in data))
    caplog.set_level("WARNING")
    assert main(["grpo", "--max_steps", str(previous_step + 2), "--save_path", str(run), "--resume", *SMALL]) == 0
    assert f"{shard} differs from what was saved" in caplog.text and "trying the previous one" in caplog.text
    steps = list(range(previous_step + 2))
    assert _steps(run / "metrics.jsonl") == steps  # no step twice
    assert _steps(run / "timeline.jsonl") == steps
    assert not (run / LOCK).exists()  # released at the end

    leaks = []
    for folder, _, files in os.walk(run):
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                if secret.encode() in f.read():
                    leaks.append(os.path.relpath(os.path.join(folder, name), run))
    assert not leaks, f"the key is written in {leaks}"
    metadata = json.loads((run / "wandb" / "run-stub" / "files" / "wandb-metadata.json").read_text())
    assert REDACTED in metadata["args"]

    refuse_or_clear(str(run), ckpt, overwrite=True, resuming=False)  # --overwrite: only what the runs wrote goes
    assert (run / "logs" / "important.txt").read_text() == "keep" and (run / "notes.txt").read_text() == "keep"
    assert not [n for n in os.listdir(run) if n in ("metrics.jsonl", "final", "timeline.jsonl", "wandb")]
    assert ckpt.complete_checkpoints() == []
