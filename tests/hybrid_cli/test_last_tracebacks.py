"""The last ways a command ended in a traceback (issue 35, item 8), each now one ``hybrid:`` line or a note:

* ``--dry-run`` on a prompts file that is not UTF-8 (the run refused it; the dry run raised UnicodeDecodeError);
* ``--use_wandb`` without a key, with a key W&B refuses, or without W&B's server -- found a minute in, after Ray
  started (UsageError, AuthenticationError, a 90 s wait): now checked before Ray, or logged offline with a note;
* ``--ray_temp_dir`` under a file (NotADirectoryError);
* Ctrl-C pressed again while an interrupted command ends (KeyboardInterrupt out of ``ray.shutdown`` at exit).

The W&B checks use the real wandb package (``pytest.importorskip``) against a local HTTP server standing in for
W&B's: no network, no key. They run in a subprocess, as wandb keeps its settings and login per process.
"""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from hybrid_cli.main import main
from hybrid_core.errors import ConfigError


@pytest.fixture(autouse=True)
def no_ray_after():
    yield
    import ray

    assert not ray.is_initialized()


# ---- a prompts file that is not UTF-8 --------------------------------------------------------------------------------
def test_dry_run_refuses_a_prompts_file_that_is_not_utf8_naming_line_and_byte(tmp_path, capsys):
    prompts = tmp_path / "latin1.jsonl"
    prompts.write_bytes(b'{"prompt": "s1 s2"}\n{"prompt": "caf\xe9"}\n')  # latin-1 e-acute: byte 16 of line 2
    argv = ["grpo", "--dry-run", "--prompt_data", str(prompts), "--input_key", "prompt"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "internal error" not in err
    assert (
        err.startswith(
            f"hybrid: error: prompt_data: {str(prompts)!r} is not UTF-8 text: line 2, byte 16 "
            "(b'\\xe9') cannot be decoded."
        )
        and "iconv" in err
    )


def test_a_json_file_that_is_not_utf8_is_a_config_error(tmp_path):
    from hybrid_algos.train.data import read_records

    path = tmp_path / "data.json"
    path.write_bytes(b'[{"prompt": "\xff"}]')
    with pytest.raises(ConfigError, match=r"is not UTF-8 text: byte 14 \(b'\\xff'\)") as e:
        read_records(str(path))
    assert e.value.field == "prompt_data"


# ---- --use_wandb, checked before Ray starts -----------------------------------------------------------------------
WANDB_CHECKS = textwrap.dedent("""
    import http.server, json, os, sys, threading

    class Refuses(http.server.BaseHTTPRequestHandler):  # W&B's server, refusing every key
        def _answer(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(401)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"errors": [{"message": "invalid api key"}]}')
        do_GET = do_POST = _answer
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refuses)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    os.environ["WANDB_BASE_URL"] = f"http://127.0.0.1:{server.server_port}"

    from hybrid_cli.metrics import MetricsLogger
    from hybrid_core.errors import ConfigError

    run, key, out = sys.argv[1], sys.argv[2], {}
    for name, given in (("no_key", "True"), ("bad_key", key)):
        try:
            MetricsLogger(run, tensorboard=False, wandb_key=given).check_wandb()
            out[name] = None
        except ConfigError as e:
            out[name] = [e.field, str(e)]
    server.shutdown()
    server.server_close()  # the server is gone: nothing answers at its address any more
    logger = MetricsLogger(run, tensorboard=False, wandb_key="True")
    logger.check_wandb()
    out["mode"], out["notes"] = logger.wandb_mode, logger.notes()
    logger.on_start({"run_dir": run})
    logger.on_step({"step": 0, "reward": 0.5})
    logger.on_end({})
    print("RESULT " + json.dumps(out))
""")


def test_wandb_without_a_key_or_with_a_refused_key_stops_before_ray_and_without_a_server_logs_offline(tmp_path):
    pytest.importorskip("wandb")
    home = tmp_path / "home"
    home.mkdir()
    run = tmp_path / "run"
    key = "hybrid-test-" + "0123456789abcdef" * 3  # 40+ characters: W&B's server is asked (and refuses it)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and "proxy" not in k.lower()}
    env.update(
        HOME=str(home),
        NETRC=str(home / ".netrc"),
        WANDB_CONFIG_DIR=str(home / "wandb"),
        WANDB_CACHE_DIR=str(home / "cache"),
        WANDB_SILENT="true",
        PYTHONUNBUFFERED="1",
    )
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", WANDB_CHECKS, str(run), key],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    field, text = out["no_key"]
    assert field == "use_wandb" and text.startswith("use_wandb: no W&B API key is configured here")
    assert "wandb login" in text
    field, text = out["bad_key"]
    assert field == "use_wandb" and "refused the API key" in text and "invalid api key" in text
    assert key not in text and key not in proc.stdout + proc.stderr  # the key is never printed
    assert out["mode"] == "offline"
    (note,) = out["notes"]
    assert note.startswith("W&B: nothing answers at http://127.0.0.1:") and "logs offline into" in note
    assert f"wandb sync {run}/wandb/offline-run-*" in note
    assert list((run / "wandb").glob("offline-run-*/run-*.wandb"))  # wandb really logged the step offline
    assert time.monotonic() - start < 200  # nothing waited out W&B's 90 s start-up timeout (a hang catcher)


def test_wandb_is_not_checked_without_use_wandb_or_in_its_own_offline_mode(monkeypatch):
    from hybrid_cli.metrics import MetricsLogger

    MetricsLogger("/tmp/x", tensorboard=False).check_wandb()  # no --use_wandb: wandb is not even imported
    monkeypatch.setitem(sys.modules, "wandb", object())  # would fail on any use
    monkeypatch.setenv("WANDB_MODE", "offline")
    MetricsLogger("/tmp/x", tensorboard=False, wandb_key="True").check_wandb()


# ---- --ray_temp_dir under a file -------------------------------------------------------------------------------------
def test_ray_temp_dir_under_a_file_names_the_flag_and_the_file(tmp_path):
    from hybrid_algos.train.sections import flag_words
    from hybrid_core.cluster import make_temp_dir

    (tmp_path / "notes.txt").write_text("a file")
    for path in (tmp_path / "notes.txt" / "ray", tmp_path / "notes.txt"):
        with pytest.raises(ConfigError) as e, flag_words():  # core names the setting, the run's boundary the flag
            make_temp_dir(str(path))
        assert e.value.field == "ray_temp_dir" and "leave --ray_temp_dir out" in str(e.value)
        assert f"cannot create the folder {str(path)!r}: {str(tmp_path / 'notes.txt')!r} is a file" in str(e.value)
    assert make_temp_dir(str(tmp_path / "ray" / "tmp")) == str(tmp_path / "ray" / "tmp")
    assert (tmp_path / "ray" / "tmp").is_dir()


# ---- Ctrl-C pressed again while the command ends ---------------------------------------------------------------------
INTERRUPTED = textwrap.dedent("""
    import sys, time
    import ray
    from hybrid_cli import main as cli

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)  # not one running beside

    def run_until_interrupted(argv):
        # the run, interrupted with Ray still up: where a second Ctrl-C cut its tear-down short
        print("running", flush=True)
        while True:
            time.sleep(0.05)

    cli._run = run_until_interrupted
    sys.argv = ["hybrid", "grpo"]
    sys.exit(cli.main())  # as the console script calls it
""")


def test_more_ctrl_cs_while_the_command_ends_exit_130_without_a_traceback(tmp_path):
    """A real local Ray and real SIGINTs; the training run is a stand-in (a loop until interrupted, Ray up), as the
    subject is what the command does once interrupted."""
    import signal

    proc = subprocess.Popen(
        [sys.executable, "-c", INTERRUPTED],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        cwd=tmp_path,
    )
    try:
        assert proc.stdout.readline().strip() == "running", proc.stderr.read()
        proc.send_signal(signal.SIGINT)  # the first Ctrl-C
        lines = []
        while not lines or not lines[-1].startswith("hybrid: interrupted"):
            line = proc.stderr.readline()
            assert line, "".join(lines)
            lines.append(line)
        for _ in range(2):  # the second and third, while Ray shuts down
            try:
                proc.send_signal(signal.SIGINT)
            except ProcessLookupError:
                break
            time.sleep(0.02)
        rc = proc.wait(timeout=120)
        err = "".join(lines) + proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
