"""Checkpoints of the FSDP2 backend through torch.distributed.checkpoint: saved sharded (one file per gloo rank) and
loaded onto another rank count (2 -> 1, 2 -> 4, 1 -> 2) by a differently initialised engine, the next updates'
losses are the saving run's (1e-6), with the learning-rate schedule resumed; an incomplete or missing checkpoint is
refused."""

from __future__ import annotations

import pytest
from fsdp2_launch import run_ranks


@pytest.fixture(scope="module")
def saved_on_two(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fsdp2_ckpt2")
    return folder, run_ranks("save", 2, folder)


def test_each_rank_writes_its_own_shards(saved_on_two) -> None:
    folder, _ = saved_on_two
    files = sorted(p.name for p in (folder / "step2").iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"]


def _resumes_identically(saved: list[dict], resumed: list[dict]) -> None:
    for r in resumed:
        assert r["updates"] == 2
        assert r["lr_after_load"] == pytest.approx(saved[0]["lr_at_save"])  # the schedule's position came back too
        # the first loss is at the loaded weights, the second after an update from the loaded Adam moments
        assert r["losses"] == pytest.approx(saved[0]["losses"][2:], abs=1e-6)
        assert r["missing_refused"]


def test_two_rank_checkpoint_resumes_on_one_rank_with_identical_losses(saved_on_two) -> None:
    folder, two = saved_on_two
    one = run_ranks("resume", 1, folder)
    assert [r["world"] for r in one] == [1]
    _resumes_identically(two, one)


def test_two_rank_checkpoint_resumes_on_four_ranks_with_identical_losses(saved_on_two) -> None:
    folder, two = saved_on_two
    four = run_ranks("resume", 4, folder, timeout_s=300)  # 4 processes on 2 shared cores: slower to start
    assert [r["world"] for r in four] == [4, 4, 4, 4]
    _resumes_identically(two, four)


def test_one_rank_checkpoint_resumes_on_two_ranks_with_identical_losses(tmp_path) -> None:
    one = run_ranks("save", 1, tmp_path)
    two = run_ranks("resume", 2, tmp_path)
    assert [r["world"] for r in two] == [2, 2]
    _resumes_identically(one, two)


def test_a_folder_without_dcp_metadata_is_refused(tmp_path) -> None:
    from hybrid_algos.train.trainer_backends.fsdp2_checkpoint import load_sharded

    (tmp_path / "__0_0.distcp").write_bytes(b"partial")  # a save that died before its coordinator finished
    with pytest.raises(FileNotFoundError, match="no complete DCP checkpoint"):
        load_sharded(str(tmp_path), None, None)  # type: ignore[arg-type]
