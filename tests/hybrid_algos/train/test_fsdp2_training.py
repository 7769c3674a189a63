"""The FSDP2 trainer backend's train step on 2 gloo ranks: the loss of a fixed batch falls, each update matches a
non-sharded single-process run of the same micro-batches, and the mixed-precision options really set the dtypes."""

from __future__ import annotations

import pytest
from fsdp2_launch import run_ranks


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> list[dict]:
    return run_ranks("train", 2, tmp_path_factory.mktemp("fsdp2_train"))


def test_the_loss_of_a_fixed_batch_falls_and_every_rank_agrees(trained) -> None:
    r0, r1 = trained
    assert r0["protocol"] is True  # FSDP2Engine satisfies the TrainingEngine surface the workers will drive
    assert r0["losses"] == r1["losses"] and r0["norms"] == r1["norms"]  # all-reduced: one run, not two
    assert r0["losses"][-1] < r0["losses"][0] - 0.5
    assert r0["updates"] == 4
    assert r0["lr"] == [pytest.approx(1e-2)]  # the warm-up schedule advanced once per update (3 of 3)


def test_each_update_matches_the_non_sharded_reference(trained) -> None:
    # the same AdamW, clipping and schedule over the same micro-batches in one process; the first loss is before
    # any update (the sharded forward), the later ones follow sharded gradients, norms and Adam steps. The
    # tolerance is fp32 summation order amplified by Adam (which normalises tiny gradient entries to steps of lr)
    losses, reference = trained[0]["losses"], trained[0]["reference"]
    assert losses[0] == pytest.approx(reference[0], rel=1e-6)
    assert losses == pytest.approx(reference, rel=1e-4)
    assert all(0 < n < 10 for n in trained[0]["norms"])


def test_bf16_master_keeps_shards_and_moments_in_bf16_and_bf16_compute_keeps_fp32_shards(tmp_path) -> None:
    for r in run_ranks("dtypes", 2, tmp_path):
        master, compute = r["bf16_master"], r["bf16_compute"]
        # master bf16: the sharded parameters (hence gradients) and Adam's moments are bf16, and so is the math
        assert master == dict(
            shard="torch.bfloat16", grad_free=True, moments=["torch.bfloat16"], logits="torch.bfloat16"
        )
        # fp32 master, bf16 compute: the shards and moments stay fp32 while the gathered weights compute in bf16
        assert compute == dict(
            shard="torch.float32", grad_free=True, moments=["torch.float32"], logits="torch.bfloat16"
        )
