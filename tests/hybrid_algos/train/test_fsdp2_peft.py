"""A PEFT-wrapped (LoRA) actor under the trainer backends, on 2 gloo ranks (fsdp2_peft_worker.py): it trains (the
loss falls, only the adapters change, the base weights stay bit-identical, the optimizer holds state for the
adapters only), sleeps and wakes bit-identically, scores log-probs through the actor's chunked pass, and exports
merged full weights under the base model's names -- W + scale * B @ A, loadable by a plain model and by
``from_pretrained`` -- under FSDP2 and under DeepSpeed ZeRO-3 alike."""

from __future__ import annotations

from pathlib import Path

import pytest
from fsdp2_launch import run_ranks

WORKER = Path(__file__).with_name("fsdp2_peft_worker.py")
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory) -> list[dict]:
    return run_ranks("fsdp2", 2, tmp_path_factory.mktemp("peft_fsdp2"), worker=WORKER, timeout_s=400)


@pytest.fixture(scope="module")
def deepspeed(tmp_path_factory) -> list[dict]:
    return run_ranks("deepspeed", 2, tmp_path_factory.mktemp("peft_ds"), worker=WORKER, timeout_s=400)


def test_only_the_adapters_train_under_fsdp2(fsdp2) -> None:
    for r in fsdp2:
        assert r["trainable"] and all(".lora_A." in n or ".lora_B." in n for n in r["trainable"])
        assert r["losses"][-1] < r["losses"][0] - 1e-2  # it learns
        assert r["changed"] == r["trainable"]  # every adapter moved (B from 0, then A), nothing else did
        assert r["frozen_identical"]
        assert r["optimizer_params"] == r["trainable"]  # no Adam state for the frozen base


def test_a_peft_role_sleeps_and_wakes_bit_identically(fsdp2) -> None:
    for r in fsdp2:
        assert r["asleep_forward_refused"]
        assert r["round_trip_identical"]
        assert r["loss_after_wake"] < r["losses"][-1]  # and trains on


def test_the_actors_chunked_log_probs_run_through_the_peft_model(fsdp2, deepspeed) -> None:
    for r in fsdp2 + deepspeed:
        assert r["logprob_gap"] < 1e-5


def test_the_export_is_the_merged_model_under_base_names(fsdp2) -> None:
    for r in fsdp2:
        assert r["export_names"] == r["plain_names"]  # what the engines and from_pretrained expect, in order
        assert not any("lora_" in n or "base_model" in n or "base_layer" in n for n in r["export_names"])
        assert r["meta_names"] == r["export_names"] and r["meta_shapes_match"]
        assert r["merge_gap"] < 1e-6  # W + (alpha / r) * B @ A, computed in the test from the full parameters
        assert r["unadapted_identical"]
        assert r["plain_vs_peft_logits"] < 1e-5  # a plain Llama with these weights computes what the PEFT one does
    assert fsdp2[0]["saved_vs_peft_logits"] == 0.0
    assert "model.safetensors" in fsdp2[0]["saved_files"]
    assert "adapter_config.json" not in fsdp2[0]["saved_files"]  # a full model, not PEFT's adapter-only save


def test_deepspeed_trains_and_exports_the_same_peft_model(fsdp2, deepspeed) -> None:
    for r, f in zip(deepspeed, fsdp2):
        assert r["losses"] == pytest.approx(f["losses"], abs=1e-5)  # ZeRO-3 trains what FSDP2 trains
        assert r["export_names"] == f["plain_names"] and r["meta_names"] == r["export_names"]
        assert r["meta_shapes_match"]
        assert r["plain_vs_peft_logits"] < 1e-5
    assert deepspeed[0]["saved_vs_peft_logits"] == 0.0


def test_the_base_with_adapters_off_is_the_untouched_model_the_reference_under_lora(fsdp2, deepspeed) -> None:
    for r in fsdp2 + deepspeed:
        assert r["base_gap"] < 1e-5  # what PolicyWorker.base_logprobs scores with: the reference, no second copy
        assert r["adapted_gap"] > 1e-4  # the trained adapters do move the policy away from it


def test_the_adapter_alone_is_gathered_full_under_pefts_saved_names(fsdp2, deepspeed) -> None:
    """What an adapter-only sync sends (peft_weights.adapter_weights): only the lora_A / lora_B tensors, gathered
    whole from FSDP2's shards and ZeRO-3's partitions, under PEFT's saved-adapter names; with the frozen base they
    are the merged export."""
    layers = {n.split(".")[2] for n in fsdp2[0]["plain_names"] if n.startswith("model.layers.")}
    want = sorted(
        f"base_model.model.model.layers.{i}.self_attn.{t}.lora_{ab}.weight"
        for i in layers
        for t in ("q_proj", "v_proj")
        for ab in "AB"
    )
    for r in fsdp2 + deepspeed:
        assert r["adapter_names"] == want
        assert r["adapter_metas_match"]  # the broadcast path's metas: names and full shapes, no gather
        assert r["adapter_merge_gap"] < 1e-5
