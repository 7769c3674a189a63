"""Weight export from FSDP2 shards (trainer_backends/fsdp2_weights.py) on 2 gloo ranks: every parameter comes out
full, under its Hugging Face name and equal to the full state dict, while the gathered bytes alive at any gather
stay under one bucket plus the largest tensor (never the whole model)."""

from __future__ import annotations

from fsdp2_launch import run_ranks


def test_bucketed_export_equals_the_full_state_dict_with_bounded_peak(tmp_path) -> None:
    for r in run_ranks("export", 2, tmp_path):
        assert r["names"] == r["full_names"] and "lm_head.weight" in r["names"]
        assert r["same"]
        assert r["gathers"] == len(r["names"])  # each sharded parameter gathered once
        assert r["bound"] < r["total"]  # the bound is below the model's size, so it means something
        assert 0 < r["peak"] <= r["bound"]
