"""--dry-run of the demo and of placement variants: plan printed, budget printed, exit status, no Ray."""

import pytest

from hybrid_algos.train.config import DEMO_SETTINGS
from hybrid_algos.train.placement import DEFAULT_GPU_GIB, gpu_memory
from hybrid_cli.main import main


@pytest.fixture(autouse=True)
def no_ray_after():
    yield
    import ray

    assert not ray.is_initialized()


def test_demo_dry_run(tmp_path, capsys):
    assert main(["ppo", "--dry-run", "--save_path", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "ppo: 1 GPU(s), backend hf" in out and "actor" in out and "rollout" in out
    demo = DEMO_SETTINGS["rollout_batch_size"] * DEMO_SETTINGS["max_steps"]  # one prompt per rollout slot
    assert f"prompts: {demo} prompts from built-in task 'copy'" in out
    assert "residency (auto): actor: everything resident" in out and "actor_train" in out and "fits:" in out
    assert not (tmp_path / "run").exists()  # a dry run writes nothing


def test_grpo_dry_run_with_rlinf_ranges(capsys):
    assert (
        main(
            [
                "grpo",
                "--dry-run",
                "--placement",
                "actor=0-1",
                "rollout=0-1",
                "reference=0-1",
                "--rollout_batch_size",
                "8",
                "--train_batch_size",
                "16",
                "--micro_train_batch_size",
                "4",
                "--actor_num_gpus_per_node",
                "2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    plan = out.split("placement:", 1)[1].split("prompts:")[0]
    assert "grpo: 2 GPU(s)" in out and "reference" in plan and "critic" not in plan  # GRPO has no critic role


def test_placement_error_exits_2_naming_the_flag(capsys):
    # colocated engines must fill the actor's GPUs exactly (actor 2 GPUs, engines 3 x 1)
    assert (
        main(
            [
                "ppo",
                "--dry-run",
                "--colocate_all_models",
                "--actor_num_gpus_per_node",
                "2",
                "--vllm_num_engines",
                "3",
                "--ref_num_gpus_per_node",
                "2",
                "--critic_num_gpus_per_node",
                "2",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "vllm_num_engines" in err and "Fix:" in err


def test_too_few_prompts_for_one_rollout_batch(prompts_jsonl, capsys, tiny_model_dir, tiny_reward_dir):
    assert (
        main(
            [
                "ppo",
                "--dry-run",
                "--pretrain",
                tiny_model_dir,
                "--prompt_data",
                prompts_jsonl,
                "--input_key",
                "prompt",
                "--reward_pretrain",
                tiny_reward_dir,
                "--max_samples",
                "20",
                "--rollout_batch_size",
                "32",
                "--train_batch_size",
                "32",
            ]
        )
        == 2
    )
    assert "rollout_batch_size" in capsys.readouterr().err


def test_own_prompts_need_a_reward(prompts_jsonl, capsys, tiny_model_dir, tmp_path, monkeypatch):
    base = ["ppo", "--dry-run", "--pretrain", tiny_model_dir, "--prompt_data", prompts_jsonl, "--input_key", "prompt"]
    assert main(base) == 2
    assert "reward_pretrain: no reward" in capsys.readouterr().err
    (tmp_path / "my_reward.py").write_text("def score(prompts, completions, **kw):\n    return [0.0] * len(prompts)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main([*base, "--reward_fn", "my_reward:score"]) == 0
    assert "reward: function" in capsys.readouterr().out
    assert main([*base, "--reward_fn", "my_reward:nope"]) == 2
    assert "has no function 'nope'" in capsys.readouterr().err


def test_missing_input_key_fails_before_anything_starts(prompts_jsonl, capsys, tiny_model_dir):
    assert (
        main(
            [
                "ppo",
                "--dry-run",
                "--pretrain",
                tiny_model_dir,
                "--prompt_data",
                prompts_jsonl,
                "--input_key",
                "question",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "input_key" in err and "context_messages, prompt" in err


def test_gpu_memory_default_without_a_gpu():
    import torch

    from hybrid_algos.train.config import PPOConfig

    given, source = gpu_memory(PPOConfig(gpu_memory_gb=24))
    assert given == 24 * 2**30 and source == "--gpu_memory_gb"
    found, source = gpu_memory(PPOConfig())
    if not torch.cuda.is_available():
        assert found == DEFAULT_GPU_GIB * 2**30 and "set --gpu_memory_gb" in source
    else:
        assert found > 2**30


def test_dry_run_shows_what_moves_when_the_gpu_is_small(capsys):
    """The demo on a pretend 2 GiB GPU with 0.5 GiB contexts: the plan moves what it must and prints each phase."""
    assert main(["grpo", "--dry-run", "--gpu_memory_gb", "1.8"]) == 0
    out = capsys.readouterr().out
    assert "GPU memory: 1.8 GiB per GPU (--gpu_memory_gb)" in out
    assert "residency (auto):" in out and "generate" in out and "peak" in out and "fits:" in out
    assert main(["grpo", "--dry-run", "--gpu_memory_gb", "0.5"]) == 2  # three 0.5 GiB contexts cannot fit
    err = capsys.readouterr().err
    assert "residency: GPU 0, phase" in err and "usable of 0.5 GiB" in err and "Fix:" in err


def test_dry_run_of_a_model_folder_without_a_tokenizer_names_the_folder(
    prompts_jsonl, capsys, tiny_model_dir, tmp_path
):
    import shutil

    bare = tmp_path / "weights-only"
    shutil.copytree(tiny_model_dir, bare)
    for name in bare.iterdir():
        if name.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            name.unlink()
    (tmp_path / "reward.py").write_text("def score(prompts, completions, **kw):\n    return [0.0] * len(prompts)\n")
    assert (
        main(
            [
                "grpo",
                "--dry-run",
                "--pretrain",
                str(bare),
                "--prompt_data",
                prompts_jsonl,
                "--input_key",
                "prompt",
                "--reward_fn",
                f"{tmp_path / 'reward.py'}:score",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert f"{bare} has no tokenizer files" in err and "Traceback" not in err
