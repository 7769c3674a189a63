"""--dry-run with --backend sglang: the weight-sync path is SGLang's own (the engine's transport), and what the loop
cannot run with SGLang is refused before Ray, naming the flag."""

import pytest

from hybrid_cli.main import main

SPLIT_004 = [
    "004_comparison_01.args",
    "004_comparison_03.args",
    "004_comparison_05.args",
    "004_comparison_06.args",
    "004_comparison_09.args",
]


@pytest.fixture(autouse=True)
def no_ray_after():
    yield
    import ray

    assert not ray.is_initialized()


@pytest.mark.parametrize("name", SPLIT_004)
def test_split_sglang_reference_commands_sync_in_sglangs_format(name, reference_argv, capsys):
    assert main(["ppo", *reference_argv(name), "--dry-run", "--gpu_memory_gb", "80"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("weight sync:"))
    assert line.startswith("weight sync: broadcast (SGLang's weight-update group, flattened buckets")


def test_colocated_sglang_demo_syncs_by_ipc_into_update_weights_from_tensor(capsys):
    assert main(["grpo", "--backend", "sglang", "--dry-run", "--gpu_memory_gb", "80"]) == 0
    out = capsys.readouterr().out
    assert "weight sync: ipc (CUDA-IPC flattened buckets in SGLang's serialized form" in out


def test_sglang_tensor_parallel_engines_are_refused(capsys):
    assert (
        main(
            [
                "grpo",
                "--backend",
                "sglang",
                "--dry-run",
                "--colocate_all_models",
                "--vllm_enable_sleep",
                "--deepspeed_enable_sleep",
                "--actor_num_gpus_per_node",
                "2",
                "--ref_num_gpus_per_node",
                "2",
                "--vllm_num_engines",
                "1",
                "--vllm_tensor_parallel_size",
                "2",
                "--gpu_memory_gb",
                "80",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "backend" in err and "RayEngine" in err
