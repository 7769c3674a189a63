"""The actor's per-step statistics stay on the device until the step's end (one host read per step, so no read
after a micro-batch's forward holds back the launch of its backward): the numbers must be exactly the ones read
eagerly, token-weighted over micro-batches, with a micro-batch without tokens leaving the extremes alone."""

from __future__ import annotations

import pytest
import torch

from hybrid_algos.mismatch import rollout_correction
from hybrid_algos.train.workers.policy import DeviceMeans, MismatchStats


def _batch(seed: int, rows: int, cols: int, empty: bool = False):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, cols, generator=g) * 3
    engine = old + torch.randn(rows, cols, generator=g) * 0.3
    mask = torch.zeros(rows, cols) if empty else (torch.rand(rows, cols, generator=g) > 0.3).float()
    return old, engine, mask


def test_mismatch_stats_are_the_token_weighted_stats_of_all_micro_batches():
    batches = [_batch(1, 3, 7), _batch(2, 5, 7), _batch(3, 2, 7, empty=True)]
    stats = MismatchStats()
    for old, engine, mask in batches:
        stats.add(rollout_correction(old, engine, mask, "tis").stats)
    got = stats.result("cpu")
    whole = rollout_correction(
        torch.cat([b[0] for b in batches]),
        torch.cat([b[1] for b in batches]),
        torch.cat([b[2] for b in batches]),
        "tis",
    ).stats
    for key in MismatchStats.MEANS:
        assert got[f"mismatch/{key}"] == pytest.approx(float(whole[key]), rel=1e-5, abs=1e-8), key  # float32 stats
    # the empty micro-batch's neutral 1.0 must not pass for a ratio of the others
    assert got["mismatch/ratio_min"] == pytest.approx(float(whole["ratio_min"]))
    assert got["mismatch/ratio_max"] == pytest.approx(float(whole["ratio_max"]))
    assert got["mismatch/ratio_min"] != 1.0 and got["mismatch/ratio_max"] != 1.0


def test_mismatch_stats_without_tokens_report_nothing():
    stats = MismatchStats()
    assert stats.result("cpu") == {}
    old, engine, mask = _batch(4, 2, 5, empty=True)
    stats.add(rollout_correction(old, engine, mask, "tis").stats)
    assert stats.result("cpu") == {}


def test_device_means_mix_tensors_and_numbers_and_read_them_once():
    means = DeviceMeans()
    means.add("loss", torch.tensor(1.0))
    means.add("loss", torch.tensor(3.0))
    means.add("count", 4)
    means.add("count", torch.tensor(2, dtype=torch.long))
    means.add("lr", 1e-6)
    assert means.result() == pytest.approx({"loss": 2.0, "count": 3.0, "lr": 1e-6})
    assert means.sums() == pytest.approx({"loss": 4.0, "count": 6.0, "lr": 1e-6})
    assert DeviceMeans().result() == {}


def test_device_means_keep_no_graph():
    w = torch.ones((), requires_grad=True)
    means = DeviceMeans()
    means.add("loss", w * 2)
    assert not means.values["loss"][0].requires_grad
