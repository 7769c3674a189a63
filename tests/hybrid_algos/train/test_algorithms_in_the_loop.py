"""Issue 20's features in real (short) runs of the loop: real Ray with fake GPUs, DeepSpeed, the built-in engine.

GRPO with GSPO, DAPO's dynamic sampling, overlong penalty and truncation mask, packing, token-budget
micro-batches, the IcePop correction at temperature 0.7 over two epochs, and --save_hf_ckpt: every step reports what
it did, and the engine/trainer ratio is 1 -- the correction compares the engine's raw log-probs with the trainer's
temperature-1 ones (kept from the old-log-prob pass), not with its tempered ones. (The two-rank PPO run is in
test_ppo_two_ranks_token_budget.py: it needs a Ray with two fake GPUs.)
"""

from __future__ import annotations

import os

import pytest
from tiny_runs import TINY

from hybrid_algos.train import GRPOConfig, train
from hybrid_algos.train.workers.policy import HF_CHECKPOINT_DIR

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]


def test_grpo_with_gspo_dapo_packing_and_correction(tmp_path, one_gpu_ray):
    config = GRPOConfig(
        save_path=str(tmp_path),
        **{**TINY, "max_steps": 3, "temperature": 0.7, "max_epochs": 2},
        policy_loss_type="gspo",
        dynamic_filtering=True,
        overlong_buffer_len=1,
        overlong_penalty_factor=0.5,
        mask_truncated_completions=True,
        packing_samples=True,
        use_dynamic_batch=True,
        train_max_tokens_per_gpu=12,
        vllm_is_correction_type="icepop",
        save_hf_ckpt=True,
        save_steps=2,
    )
    history = train(config)["history"]
    assert len(history) == 3
    for m in history:
        assert m["mismatch/ratio_min"] == pytest.approx(1.0, abs=2e-3) and m["mismatch/ratio_max"] == pytest.approx(
            1.0, abs=2e-3
        )
        assert m["mismatch/masked_frac"] == 0.0 and abs(m["mismatch/kl"]) < 1e-3
        assert m["dynamic_sampling/generated_prompts"] >= TINY["rollout_batch_size"]
        assert (
            m["dynamic_sampling/generated_samples"]
            == TINY["n_samples_per_prompt"] * m["dynamic_sampling/generated_prompts"]
        )
        assert m["reward/overlong_penalty"] < 0 and 0 <= m["rollout/truncated_frac"] <= 1
        assert m["actor/micro_batches"] > 1  # 8 samples in micro-batches of <= 12 tokens
    ckpt = os.path.join(config.checkpoint_dir, "step-00000002", "actor", HF_CHECKPOINT_DIR)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(ckpt)
    AutoTokenizer.from_pretrained(ckpt)
