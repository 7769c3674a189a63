"""Progress display, metrics writers, and how ``hybrid ppo`` wires them to the training loop."""

import importlib.machinery
import io
import json
import sys

import pytest
from rich.console import Console

from hybrid_cli.metrics import MetricsLogger
from hybrid_cli.progress import ProgressDisplay, step_line, summary_table
from hybrid_core.errors import ConfigError


def step_metrics(step, reward):
    return {
        "step": step,
        "reward": reward,
        "kl": 0.01 * step,
        "response_len": 3.0,
        "time/generate": 1.5,
        "time/infer": 0.25,
        "time/train": 2.0,
        "time/sync": 0.5,
        "time/sleep": 0.1,
        "time/wake": 0.2,
        "time/step": 4.6,
        "bytes/sync": 2e9,
        "actor/pg_loss": float("nan"),
    }


def rendered(renderable):
    console = Console(file=io.StringIO(), width=120)
    console.print(renderable)
    return console.file.getvalue()


def test_step_line_shows_reward_kl_and_phase_seconds():
    line = step_line(step_metrics(3, 0.5))
    assert "reward 0.500" in line and "kl 0.0300" in line
    assert "generate 1.50s" in line and "train 2.00s" in line and "sync 0.50s" in line and "step 4.60s" in line


def test_progress_lines_without_a_terminal_and_summary_table(tmp_path):
    console = Console(file=io.StringIO(), width=250)
    display = ProgressDisplay(console)
    assert not display.live  # not a terminal: one line per step
    display.on_start({"total_steps": 3, "run_dir": str(tmp_path)})
    for step, reward in ((0, 0.1), (1, 0.4), (2, 0.3)):  # the loop's 0-based step index; shown 1-based
        display.on_step(step_metrics(step, reward))
    (tmp_path / "final").mkdir()
    display.on_end({"final_model": str(tmp_path / "final"), "last_checkpoint": str(tmp_path / "no-such-checkpoint")})
    out = console.file.getvalue()
    assert "step 2/3" in out and "reward 0.400" in out
    assert "reward first / last / best" in out and "0.100 / 0.300 / 0.400" in out
    assert "generate s/step (mean)" in out and "sync GB/step (mean)" in out and str(tmp_path / "final") in out
    assert "no-such-checkpoint" not in out  # the summary never points at a folder that does not exist


def test_live_progress_bar_runs():
    console = Console(file=io.StringIO(), width=150, force_terminal=True)
    display = ProgressDisplay(console, live=True)
    display.on_start({"total_steps": 2})
    display.on_step(step_metrics(0, 0.2))  # the loop's 0-based step index
    display.on_step(step_metrics(1, 0.6))
    display.on_end({})
    assert "2/2" in console.file.getvalue() and "training summary" in console.file.getvalue()


def test_summary_of_no_steps():
    assert "steps" in rendered(summary_table([]))


def test_summary_shows_where_the_set_up_went():
    setup = {"placement group": 1.2, "role models loaded": 40.5, "engines started": 61.0, "weight sync ready": 3.3}
    out = rendered(summary_table([step_metrics(0, 0.1)], {"setup_seconds": setup}))
    assert "set-up s" in out and "106.0" in out  # the total
    assert out.index("engines started 61.0") < out.index("role models loaded 40.5")  # the slowest first
    assert "set-up s" not in rendered(summary_table([step_metrics(0, 0.1)], {}))


def test_metrics_jsonl_one_line_per_step_and_resume_continues_after_the_checkpoint(tmp_path):
    """Steps are the loop's 0-based index in the file; a resume from the checkpoint after 2 steps keeps steps 0-1
    and appends from step 2, and one after 1 step drops the step that is done again (no step twice)."""
    logger = MetricsLogger(str(tmp_path), tensorboard=False)
    logger.on_start({"run_dir": str(tmp_path)})
    logger.on_step(step_metrics(0, 0.1))
    logger.on_step(step_metrics(1, 0.2))
    logger.on_end({"steps": 2})
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1] and lines[1]["reward"] == 0.2
    assert lines[0]["actor/pg_loss"] is None and "wall_time" in lines[0]  # NaN -> null: strict JSON
    assert json.loads((tmp_path / "summary.json").read_text()) == {"steps": 2}
    resumed = MetricsLogger(str(tmp_path), tensorboard=False)
    resumed.on_start({"run_dir": str(tmp_path), "start_step": 2})
    resumed.on_step(step_metrics(2, 0.3))
    resumed.close()
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2]
    again = MetricsLogger(str(tmp_path), tensorboard=False)  # the checkpoint after step 1: steps 1 and 2 redone
    again.on_start({"run_dir": str(tmp_path), "start_step": 1})
    again.on_step(step_metrics(1, 0.25))
    again.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and rows[1]["reward"] == 0.25
    fresh = MetricsLogger(str(tmp_path), tensorboard=False)
    fresh.on_start({"run_dir": str(tmp_path)})
    fresh.close()
    assert (tmp_path / "metrics.jsonl").read_text() == ""  # a new run starts the file afresh


def test_tensorboard_when_installed(tmp_path):
    pytest.importorskip("tensorboard")
    logger = MetricsLogger(str(tmp_path), tensorboard=True)
    logger.on_start({"run_dir": str(tmp_path)})
    logger.on_step(step_metrics(1, 0.1))
    logger.close()
    assert any((tmp_path / "tensorboard").iterdir())


def test_tensorboard_missing_is_not_an_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    logger = MetricsLogger(str(tmp_path), tensorboard=True)
    logger.on_start({"run_dir": str(tmp_path)})
    logger.on_step(step_metrics(1, 0.1))
    logger.close()
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1


def test_wandb_missing_names_pip_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError, match="pip install wandb") as e:
        MetricsLogger("/tmp/x", wandb_key="KEY")
    assert e.value.field == "use_wandb"


def test_wandb_receives_metrics_and_a_redacted_config(tmp_path, monkeypatch):
    """A recording stand-in for the wandb module (no network here), checking what hybrid sends it."""
    calls = []

    class Run:
        def log(self, data, step):
            calls.append(("log", data, step))

        def finish(self):
            calls.append(("finish",))

    class FakeWandb:
        @staticmethod
        def login(key, relogin):
            calls.append(("login", key))

        @staticmethod
        def init(**kwargs):
            calls.append(("init", kwargs))
            return Run()

    # a module spec: libraries imported later in this process (accelerate, through transformers) probe
    # importlib.util.find_spec("wandb"), which raises for a module without one
    FakeWandb.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    monkeypatch.setitem(sys.modules, "wandb", FakeWandb)
    from hybrid_cli.main import load_config

    config = load_config(
        "ppo",
        ["--use_wandb", "SECRET", "--wandb_project", "proj", "--wandb_run_name", "r1", "--save_path", str(tmp_path)],
    )[0]
    logger = MetricsLogger.for_config(config)
    logger.on_start({"run_dir": str(tmp_path)})
    logger.on_step(step_metrics(1, 0.5))
    logger.on_end({})
    assert calls[0] == ("login", "SECRET")
    init = calls[1][1]
    assert init["project"] == "proj" and init["name"] == "r1" and init["config"]["use_wandb"] == "<redacted>"
    assert calls[2][0] == "log" and calls[2][1]["reward"] == 0.5 and calls[2][2] == 1
    assert "actor/pg_loss" not in calls[2][1]  # non-finite values are not sent
    assert calls[-1] == ("finish",)


def test_hybrid_ppo_passes_the_config_and_callbacks_to_train(tmp_path, monkeypatch, capsys):
    """A stand-in for the training loop (the real one is exercised by the slow demo test): it checks what
    ``hybrid ppo`` hands over and drives the callbacks as the loop does."""
    import hybrid_algos.train as train_pkg

    seen = {}

    def fake_train(config, *, callbacks=()):
        seen["config"] = config
        for cb in callbacks:
            cb.on_start({"total_steps": 2, "run_dir": config.save_path, "config": config})
        for step in (1, 2):
            for cb in callbacks:
                cb.on_step(step_metrics(step, 0.1 * step))
        for cb in callbacks:
            cb.on_end({"steps": 2})
        return {"steps": 2}

    monkeypatch.setattr(train_pkg, "train", fake_train)
    from hybrid_cli.main import main

    assert main(["grpo", "--max_steps", "2", "--save_path", str(tmp_path), "--no_use_tensorboard"]) == 0
    assert seen["config"].algorithm == "grpo" and seen["config"].max_steps == 2
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
    assert "training summary" in capsys.readouterr().out


def test_missing_tensorboard_is_said_before_the_run(tmp_path, monkeypatch, capsys):
    """--use_tensorboard is on by default; without the package the run says so instead of writing nothing silently."""
    import hybrid_algos.train as train_pkg

    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    monkeypatch.setattr(train_pkg, "train", lambda config, callbacks=(): {"steps": 0})
    from hybrid_cli.main import main

    assert main(["grpo", "--max_steps", "1", "--save_path", str(tmp_path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "tensorboard is not installed" in out and "metrics.jsonl only" in out and "pip install tensorboard" in out
    assert main(["grpo", "--max_steps", "1", "--save_path", str(tmp_path / "b"), "--no_use_tensorboard"]) == 0
    assert "tensorboard" not in capsys.readouterr().out
