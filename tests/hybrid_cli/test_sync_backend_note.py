"""An explicit --vllm_sync_backend on a run whose engines share the actor's GPUs: the weights go by CUDA IPC (no
collective group; NCCL could not hold actor rank 0 and the engine on its GPU in one group), as OpenRLHF does with
--colocate_all_models, and the run says so at the start and in --dry-run, with what to pass to broadcast anyway.
Unset (the default), nothing is said; engines on GPUs of their own broadcast over the backend asked for."""

import pytest

from hybrid_cli.main import main
from hybrid_core.placement import PlacementSpec
from hybrid_engines.weight_sync import SyncSettings, choose_sync, describe_sync, sync_backend, sync_backend_note


def _settings(vllm_sync_backend, weight_sync="auto"):
    return SyncSettings(transport=weight_sync, group_backend=vllm_sync_backend)


COLOCATED = PlacementSpec.from_ranges({"actor": "0-1", "rollout": "0-1"}).plan()
SPLIT = PlacementSpec.from_ranges({"actor": "0", "rollout": "1"}).plan()


@pytest.mark.parametrize("asked", [None, "nccl", "gloo"])
def test_the_note_says_when_an_explicit_backend_is_not_used(asked):
    mode = choose_sync(_settings(asked), "vllm", COLOCATED).mode
    assert mode == "ipc"  # colocated engines: CUDA IPC whatever the flag (OpenRLHF's choice for nccl too)
    note = sync_backend_note(_settings(asked), mode)
    if asked is None:
        assert note is None
    else:
        assert note.startswith(f"--vllm_sync_backend {asked}: not used: ") and "CUDA IPC" in note
        assert "--weight_sync broadcast" in note  # how to broadcast anyway
    assert "two ranks on one GPU" in (sync_backend_note(_settings("nccl"), mode) or "")


def test_split_engines_broadcast_over_the_backend_asked_for_and_say_nothing():
    for asked, group in ((None, "nccl"), ("nccl", "nccl"), ("gloo", "gloo")):
        mode = choose_sync(_settings(asked), "vllm", SPLIT).mode
        assert mode == "broadcast" and sync_backend_note(_settings(asked), mode) is None
        assert f"over {group}" in describe_sync(_settings(asked), "vllm", SPLIT)
    assert sync_backend(_settings("nccl")) in ("nccl", "gloo")  # gloo only on a machine without CUDA


def test_dry_run_prints_the_note_for_the_explicit_flag_only(capsys):
    assert main(["ppo", "--dry-run", "--vllm_sync_backend", "nccl", "--max_steps", "1"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "weight sync: ipc" in out
    assert (
        "note: --vllm_sync_backend nccl: not used: the engines share the actor's GPUs, so the weights go to "
        "them by CUDA IPC"
    ) in out and "--weight_sync broadcast --vllm_sync_backend gloo" in out
    assert main(["ppo", "--dry-run", "--max_steps", "1"]) == 0
    assert "--vllm_sync_backend" not in capsys.readouterr().out
