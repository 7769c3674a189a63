"""--dry-run with --bf16_master_weights --bf16_optimizer_states: a ~7B model with a reference and vLLM on one 80 GiB
GPU, whose fp32-master optimizer (12 bytes per parameter) goes to host memory, keeps its 6-byte bf16 optimizer on the
GPU; the plan says so, with the precision note, and bad combinations stop with the flag named."""

import pytest

from hybrid_cli.main import main

# The demo model (its tiny vocabulary) with a 7B body: ~6.5B parameters, sized on the meta device (nothing allocated).
SEVEN_B = [
    "--tiny_model",
    "hidden_size=4096",
    "intermediate_size=11008",
    "num_hidden_layers=32",
    "num_attention_heads=32",
    "num_key_value_heads=32",
    "--bf16",
    "--gpu_memory_gb",
    "80",
    "--host_memory_gb",
    "124",
    "--zero_stage",
    "3",
    "--init_kl_coef",
    "0.01",
    "--backend",
    "vllm",
    "--vllm_gpu_memory_utilization",
    "0.2",
    "--gradient_checkpointing",
    "--colocate_all_models",
    "--actor_learning_rate",
    "1e-6",
]
BF16 = ["--bf16_master_weights", "--bf16_optimizer_states"]


@pytest.fixture(autouse=True)
def no_ray_after():
    yield
    import ray

    assert not ray.is_initialized()


def test_a_7b_bf16_optimizer_stays_on_the_gpu(capsys, tmp_path):
    run = tmp_path / "run"
    assert main(["grpo", "--dry-run", *SEVEN_B, *BF16, "--save_path", str(run)]) == 0
    lines = capsys.readouterr().out
    out = " ".join(lines.split())  # the console wraps long notes
    assert "optimizer (CPU Adam) 0.0" in out and "as if --adam_offload" not in out and "fits:" in out
    # ZeRO-1's step would flatten all 13 GB of gradients at once, which leaves no room: ZeRO-3 is kept on one rank
    assert "--zero_stage 3 with one rank per trainer: kept" in out and "running ZeRO-1" not in out
    assert "--bf16_master_weights: the optimizer updates the weights in bf16" in out
    assert "learning rate (1e-06)" in out
    # the optimizer is resident in training, at 6 bytes per parameter
    train = next(line for line in lines.splitlines() if line.strip().startswith("actor_train"))
    assert "optimizer" in train.split("resident:")[1].split("rollout")[0]


def test_without_the_options_the_same_run_keeps_cpu_adam(capsys):
    assert main(["grpo", "--dry-run", *SEVEN_B, "--host_memory_gb", "200"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "as if --adam_offload" in out and "running ZeRO-1" in out and "--bf16_master_weights:" not in out


def test_a_small_model_still_runs_zero_1_on_one_rank(capsys):
    assert main(["grpo", "--dry-run", "--bf16", "--zero_stage", "3", *BF16, "--gpu_memory_gb", "80"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "running ZeRO-1" in out and "kept, although" not in out


@pytest.mark.parametrize(
    "flags, field",
    [
        (BF16, "bf16_master_weights"),  # no --bf16
        (["--bf16", "--bf16_master_weights"], "bf16_master_weights"),  # fp32 moments outside CPU Adam
        (["--bf16", "--bf16_optimizer_states"], "bf16_optimizer_states"),
        (["--bf16", "--zero_stage", "0", *BF16], "bf16_master_weights"),
    ],
)
def test_bad_combinations_stop_before_anything_starts(capsys, flags, field):
    assert main(["grpo", "--dry-run", *flags]) == 2
    assert f"{field}: " in capsys.readouterr().err
