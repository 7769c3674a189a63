"""Errors raised while a run goes (in a worker, after the config was checked) name settings the way core does,
``section.name``; the ``hybrid:`` line the user reads names the flag instead."""

from __future__ import annotations

from hybrid_cli import main as cli
from hybrid_core.errors import GpuMemoryError, WeightSyncMismatch
from hybrid_core.weight_sync.verify import FIX


def test_a_runtime_error_names_flags_not_section_paths(monkeypatch, capsys):
    assert "sync.verify" in FIX  # core's own words (it names no CLI flag)

    def fail(argv):
        raise WeightSyncMismatch(f"weight sync verify: rollout engine 0: 1 of 3 pieces differ. Fix: {FIX}")

    monkeypatch.setattr(cli, "_run", fail)
    assert cli.main(["grpo"]) == cli.EXIT_FAILED
    err = capsys.readouterr().err
    assert err.startswith("hybrid: WeightSyncMismatch:") and "--verify_weight_sync off" in err
    assert "sync.verify" not in err


def test_an_unknown_path_is_left_alone(monkeypatch, capsys):
    def fail(argv):
        raise GpuMemoryError("engine.no_such_setting holds 3 GiB; residency.gpu_memory_gb is 80")

    monkeypatch.setattr(cli, "_run", fail)
    cli.main(["grpo"])
    err = capsys.readouterr().err
    assert "engine.no_such_setting" in err and "--gpu_memory_gb" in err
