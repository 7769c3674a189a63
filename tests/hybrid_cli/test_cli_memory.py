"""The GPU-memory budget against hand-computed numbers, and --dry-run on plans that do not fit."""

import os
import re
import shutil
from types import SimpleNamespace

import pytest

from hybrid_cli.main import main
from hybrid_cli.memory import GiB, RolePlacement, estimate, model_shape
from hybrid_core.errors import PlacementError

# A small Llama whose parameters are easy to count by hand:
#   embeddings 1000 x 64 = 64000; per layer q 64x64 + k 64x32 + v 64x32 + o 64x64 + gate/up/down 3 x 64x128
#   + 2 norms x 64 = 36992; 2 layers = 73984; final norm 64; LM head 64000  ->  202048.
P = 202048
P_VALUE = 64000 + 73984 + 64 + 65  # base model + a 64 -> 1 value head with bias
CTX = 0.5 * GiB


def small_config(**overrides):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, **overrides)


def settings(**overrides):
    values = dict(bf16=True, zero_stage=3, adam_offload=False, gradient_checkpointing=False,
                  micro_train_batch_size=2, micro_rollout_batch_size=4, prompt_max_len=16, generate_max_len=16,
                  vllm_gpu_memory_utilization=0.5, backend="vllm", weight_sync_bucket_mb=1, rollout_batch_size=8,
                  n_samples_per_prompt=1)
    values.update(overrides)
    return SimpleNamespace(**values)


def colocated_roles():
    """GPUs 0-3: actor (4 ranks, sleeps), 2 engines of TP 2 (sleep), reference (4 ranks, resident)."""
    return [RolePlacement("actor", 4, 1, True, (0, 1, 2, 3)), RolePlacement("rollout", 2, 2, True, (0, 1, 2, 3)),
            RolePlacement("reference", 4, 1, False, (0, 1, 2, 3))]


def phase(budget, name, gpu=0):
    return next(p for p in budget.phases if p.gpu == gpu and p.phase == name)


def test_model_shape_counts_parameters_exactly():
    shape = model_shape(small_config())
    assert shape.num_params == P and shape.kv_dim == 32 and shape.layer_params == (P - 2 * 64000) // 2
    assert model_shape(small_config(), value_head=True).num_params == P_VALUE


def test_budget_matches_hand_computed_values():
    shape = model_shape(small_config())
    budget = estimate(settings(), colocated_roles(), {"actor": shape, "rollout": shape, "reference": shape}, 4 * GiB)
    assert [p.phase for p in budget.phases if p.gpu == 0] == ["generate", "reference", "actor_train", "sync"]
    T, A = 2 * 32, 5 * 64 + 2 * 32 + 4 * 128  # tokens of a training micro batch; saved values per token per layer
    gather = 2 * 2 * (P - 2 * 64000) // 2  # ZeRO-3: two layers' bf16 weights
    train = phase(budget, "actor_train").items
    assert train[("actor", "weights")] == 2 * P / 4  # bf16, ZeRO-3 over 4 ranks
    assert train[("actor", "gradients")] == 2 * P / 4
    assert train[("actor", "optimizer")] == 12 * P / 4  # fp32 master + Adam m, v
    assert train[("actor", "activations")] == T * 2 * A * 2  # no checkpointing: every layer, bf16
    assert train[("actor", "logits")] == T * 1000 * (2 + 8)
    assert train[("actor", "zero3_gather")] == gather
    assert train[("rollout", "context")] == CTX and ("rollout", "weights") not in train  # asleep: context only
    assert train[("reference", "weights")] == 2 * P / 4  # resident, not working
    assert phase(budget, "actor_train").total == (3 * 2 * P / 4 + 12 * P / 4 + T * 2 * A * 2 + T * 1000 * 10 + gather
                                                  + 3 * CTX)
    gen = phase(budget, "generate").items
    assert gen[("rollout", "weights")] == 2 * P / 2  # TP 2
    assert gen[("rollout", "kv_cache")] == 0.5 * 4 * GiB - 2 * P / 2  # utilization x GPU - weights
    assert ("actor", "weights") not in gen and gen[("reference", "weights")] == 2 * P / 4
    sync = phase(budget, "sync").items
    assert sync[("rollout", "weights")] == P and ("rollout", "kv_cache") not in sync
    assert sync[("actor", "sync_bucket")] == sync[("rollout", "sync_bucket")] == min(2**20, 2 * P)
    ref = phase(budget, "reference").items
    assert ref[("reference", "activations")] == 4 * 32 * A * 2 and ref[("reference", "logits")] == 4 * 32 * 1000 * 10


def test_checkpointing_offload_and_zero_stage_change_what_they_should():
    shape = model_shape(small_config())
    models = {"actor": shape, "rollout": shape, "reference": shape}
    T, A = 2 * 32, 5 * 64 + 2 * 32 + 4 * 128
    ckpt = phase(estimate(settings(gradient_checkpointing=True), colocated_roles(), models, 4 * GiB), "actor_train")
    assert ckpt.items[("actor", "activations")] == T * (2 * 64 + A) * 2  # layer inputs + one layer recomputed
    off = phase(estimate(settings(adam_offload=True), colocated_roles(), models, 4 * GiB), "actor_train")
    assert off.items[("actor", "optimizer")] == 0
    z1 = phase(estimate(settings(zero_stage=1), colocated_roles(), models, 4 * GiB), "actor_train").items
    assert z1[("actor", "weights")] == 2 * P and z1[("actor", "gradients")] == 2 * P
    assert z1[("actor", "optimizer")] == 12 * P / 4 and ("actor", "zero3_gather") not in z1
    fp32 = phase(estimate(settings(bf16=False, zero_stage=2), colocated_roles(), models, 4 * GiB), "actor_train").items
    assert fp32[("actor", "weights")] == 4 * P and fp32[("actor", "gradients")] == 4 * P / 4
    assert fp32[("actor", "optimizer")] == 8 * P / 4


def test_roles_that_do_not_sleep_keep_their_memory_in_every_phase():
    shape = model_shape(small_config())
    roles = [RolePlacement("actor", 1, 1, False, (0,)), RolePlacement("rollout", 1, 1, False, (1,))]
    budget = estimate(settings(), roles, {"actor": shape, "rollout": shape}, 4 * GiB)
    # a vLLM engine that does not sleep holds its whole pre-allocated fraction, also during the weight sync
    assert phase(budget, "actor_train", gpu=1).total == 0.5 * 4 * GiB + CTX
    assert phase(budget, "sync", gpu=1).items[("rollout", "kv_cache")] == 0.5 * 4 * GiB - 2 * P
    hf = estimate(settings(backend="hf"), roles, {"actor": shape, "rollout": shape}, 4 * GiB)
    kv = 8 * 32 * (2 * 2 * 32 * 2)  # 8 sequences x 32 tokens x K and V of 2 layers x kv_dim, bf16
    assert phase(hf, "generate", gpu=1).items[("rollout", "kv_cache")] == kv
    assert phase(hf, "actor_train", gpu=1).items[("rollout", "weights")] == 2 * P


def test_too_big_names_gpu_phase_and_numbers():
    shape = model_shape(small_config())
    budget = estimate(settings(), colocated_roles(), {"actor": shape, "rollout": shape, "reference": shape}, 1 * GiB)
    with pytest.raises(PlacementError) as e:
        budget.check()
    worst = budget.worst()
    assert re.search(rf"GPU 0, phase {worst.phase}: {worst.total / GiB:.1f} GiB needed > 1.0 GiB", str(e.value))
    with pytest.raises(PlacementError, match="vllm_gpu_memory_utilization"):  # weights do not fit the engine's share
        estimate(settings(vllm_gpu_memory_utilization=0.0001), colocated_roles(),
                 {"actor": shape, "rollout": shape, "reference": shape}, 1 * GiB)


# ---- the 70B example of reference 000 with the real Llama-2-70B shape ----------------------------------------------
@pytest.fixture(scope="module")
def llama70b_dirs(tmp_path_factory, tiny_model_dir):
    """config.json of Llama-2-70B (no weights) + the tiny tokenizer (the dry run reads only the config's sizes)."""
    from transformers import LlamaConfig

    dirs = {}
    for name, extra in (("policy", {}), ("reward", {"num_labels": 1, "architectures": ["LlamaForSequenceClassification"]})):
        path = tmp_path_factory.mktemp("llama70b") / name
        LlamaConfig(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                    num_attention_heads=64, num_key_value_heads=8, **extra).save_pretrained(path)
        for f in os.listdir(tiny_model_dir):
            if f.startswith(("tokenizer", "special_tokens")):
                shutil.copy(os.path.join(tiny_model_dir, f), path)
        dirs[name] = str(path)
    return dirs


def test_70b_hybrid_command_on_80gb_gpus(llama70b_dirs, reference_argv, capsys):
    argv = reference_argv("000_70b_hybrid_48gpu.args")
    argv[argv.index("--pretrain") + 1] = llama70b_dirs["policy"]
    argv[argv.index("--reward_pretrain") + 1] = llama70b_dirs["reward"]
    run = ["ppo", *argv, "--dry-run", "--gpu_memory_gb", "80"]

    # As written (no checkpointing, Adam on the GPU, OpenRLHF 0.11.2's default micro batch of 1 x 2048 tokens): the
    # actor's optimizer state and training activations are far beyond 80 GB.
    assert main(run) == 2
    captured = capsys.readouterr()
    match = re.search(r"GPU (\d+), phase actor_train: ([\d.]+) GiB needed > 80.0 GiB", captured.err)
    assert match, captured.err
    assert float(match.group(2)) > 120 and "--adam_offload" in captured.err
    assert "OVER" in captured.out  # the budget table is printed before the error

    # With the two flags 004's author needed on 80 GB H100s, training fits -- but the weight sync does not: the
    # engines' weights (70B / TP 4 = 32 GiB per GPU) wake beside the resident reference and reward shards.
    assert main([*run, "--adam_offload", "--gradient_checkpointing"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"phase sync: [\d.]+ GiB needed > 80.0 GiB \(rollout weights 32.1", err), err
    assert "--vllm_tensor_parallel_size" in err

    # Engines of TP 8 halve that, and the plan fits.
    assert main([*run, "--adam_offload", "--gradient_checkpointing", "--vllm_num_engines", "2",
                 "--vllm_tensor_parallel_size", "8"]) == 0
    assert "fits: the fullest GPU" in capsys.readouterr().out
