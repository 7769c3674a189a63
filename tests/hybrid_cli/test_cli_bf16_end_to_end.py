"""`hybrid grpo --bf16 --bf16_master_weights --bf16_optimizer_states` end to end on CPU (its own local Ray, the demo
model, every role colocated on one fake GPU): it trains, and the actor's DeepSpeed checkpoint holds bf16 master weights
and bf16 Adam moments, and the run's plan notes the precision it gives up."""

import json

import pytest

from hybrid_cli.main import main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]


def test_grpo_trains_with_a_bf16_optimizer(tmp_path):
    import ray
    import torch
    from safetensors.torch import load_file

    from hybrid_algos.train.deepspeed_ops import ensure_cpu_ops_built

    ensure_cpu_ops_built()  # a fresh clone compiles DeepSpeed's CPU ops once: not this test's subject
    run = tmp_path / "run"
    assert (
        main(
            [
                "grpo",
                "--max_steps",
                "2",
                "--save_path",
                str(run),
                "--task_length",
                "1",
                "--rollout_batch_size",
                "4",
                "--n_samples_per_prompt",
                "4",
                "--train_batch_size",
                "16",
                "--micro_train_batch_size",
                "8",
                "--save_steps",
                "2",
                "--seed",
                "5",
                "--actor_learning_rate",
                "2e-3",
                "--bf16",
                "--zero_stage",
                "2",
                "--bf16_master_weights",
                "--bf16_optimizer_states",
            ]
        )
        == 0
    )
    assert not ray.is_initialized()

    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1] and any(m["advantage_std"] > 0 for m in metrics)
    # it trained: most weights of the final model differ from the initial one
    start, final = load_file(run / "tiny-model" / "model.safetensors"), load_file(run / "final" / "model.safetensors")
    changed = sum(int((start[k].to(torch.bfloat16).float() != final[k].float()).sum()) for k in start)
    assert changed > 0.5 * sum(t.numel() for t in start.values())

    # what DeepSpeed kept: bf16 master weights and bf16 m, v (its checkpoint of the actor's ZeRO optimizer)
    (states,) = (run / "checkpoints" / "step-00000002" / "actor" / "state").glob("*optim_states.pt")
    saved = torch.load(states, map_location="cpu", weights_only=False)
    zero = saved["optimizer_state_dict"]
    assert {t.dtype for t in zero["single_partition_of_fp32_groups"]} == {torch.bfloat16}
    moments = [
        v
        for s in zero["base_optimizer_state"]["state"].values()
        for k, v in s.items()
        if k in ("exp_avg", "exp_avg_sq")
    ]
    assert moments and {t.dtype for t in moments} == {torch.bfloat16}
    assert saved["ds_config"]["bf16"] == {
        "enabled": True,
        "check_grad_overflow": False,
        "bf16_master_weights_and_grads": True,
        "bf16_optimizer_states": True,
    }

    # and the run's plan says what bf16 master weights cost in precision
    notes = json.loads((run / "residency.json").read_text())["notes"]
    assert any(n.startswith("--bf16_master_weights: the optimizer updates the weights in bf16") for n in notes)
