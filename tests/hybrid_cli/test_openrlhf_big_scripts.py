"""OpenRLHF's big-model launch scripts through ``hybrid ppo --dry-run`` with the real model shapes (issue 34):
config-only folders of Llama-3-70B and CodeLlama-34B (config.json and a tokenizer, no weights: sizing reads the config
only), the rest of each script pointed at local stand-ins as in test_openrlhf_scripts.py.

* 70B (train_ppo_llama_ray_70b.sh, ZeRO-3, reference and reward model on 4 GPUs each): was refused for "reference
  params 131.4 GiB" on one GPU. Under ZeRO-3 OpenRLHF shards them over their GPUs; so does hybrid now: a quarter each.
* 34B (train_ppo_llama_ray_34b.sh, no vLLM engines: the built-in engine on each actor GPU, ZeRO-2): the engine holds
  one copy of the weights beside the actor's, and only where it must: generating, and receiving the new weights in the
  sync (where the actor's copy is the source). Both copies at once are 2 x 62.9 GiB, more than an 80 GiB GPU holds:
  that refusal is real for an engine in its own process; on 141 GiB GPUs (H200) the script is accepted.
"""

from __future__ import annotations

import pytest
from openrlhf_scripts import openrlhf_script_argv

from hybrid_cli.main import load_config, main

#: The two models' shapes (their hub configs' sizes)
L70 = dict(
    vocab_size=128256,
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    max_position_embeddings=8192,
)
CODELLAMA_34B = dict(
    vocab_size=32000,
    hidden_size=8192,
    intermediate_size=22016,
    num_hidden_layers=48,
    num_attention_heads=64,
    num_key_value_heads=8,
    max_position_embeddings=16384,
)
GiB = 2**30
# tests/hybrid_cli/conftest.py's template, spelled here: `from conftest import` is ambiguous under pytest-xdist
# (tests/packaging has a conftest module too)
CHAT_TEMPLATE = (
    "{{ bos_token }} {% for m in messages %}{{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<sep>{% endif %}"
)


def _config_folder(path, shape):
    from transformers import AutoTokenizer

    from hybrid_algos.train.tiny import build_tiny_tokenizer, tiny_model_config

    tiny_model_config(**shape).save_pretrained(path)
    build_tiny_tokenizer().save_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = CHAT_TEMPLATE  # the 70B script has --apply_chat_template
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("big-configs")
    return {
        "70b": _config_folder(root / "llama-3-70b", L70),
        "34b": _config_folder(root / "codellama-34b", CODELLAMA_34B),
    }


def _argv(name, model, script_prompts, out_dir):
    return openrlhf_script_argv(name, policy=model, reward=model, prompts=script_prompts, out_dir=out_dir)


def _residency(argv, gpu_gib):
    from hybrid_algos.train.placement import build_plan, build_residency

    config, _, _ = load_config("ppo", argv)
    plan = build_plan(config)
    residency, run_config = build_residency(
        config,
        plan,
        config.pretrain,
        prompt_len=config.prompt_max_len,
        generate_len=config.generate_max_len,
        gpu_bytes=gpu_gib * GiB,
    )
    return config, plan, residency, run_config


def _params(folder, value_head=False):
    from transformers import AutoConfig

    from hybrid_core.residency.memory import count_params

    return count_params(AutoConfig.from_pretrained(folder), value_head=value_head)


def test_the_70b_script_shards_its_reference_and_reward_model_over_their_gpus(
    folders, script_prompts, tmp_path, capsys
):
    argv = _argv("flat/train_ppo_llama_ray_70b.args", folders["70b"], script_prompts, tmp_path)
    status = main(["ppo", *argv, "--dry-run", "--gpu_memory_gb", "80"])
    out, err = capsys.readouterr()
    assert status == 0, err[-3000:]
    assert "ppo: 32 GPU(s)" in out and "fits:" in out and "reference params" not in err

    _config, plan, residency, run_config = _residency(argv, 80)
    assert run_config.zero_stage == 3 and residency.fits()
    policy, reward = _params(folders["70b"]), _params(folders["70b"], value_head=True)
    for role, params in (("reference", policy), ("reward", reward)):
        gpus = plan.roles[role].gpus
        assert len(gpus) == 4
        for gpu in gpus:  # a quarter of the bf16 weights on each of its GPUs (131.4 GiB whole)
            assert residency.breakdown(gpu, role)[(role, "params")] == 2 * params / 4
            assert residency.peak(gpu, role) < 45 * GiB


def test_the_34b_script_without_engines_counts_the_built_in_engine_s_one_copy(
    folders, script_prompts, tmp_path, capsys
):
    argv = _argv("flat/train_ppo_llama_ray_34b.args", folders["34b"], script_prompts, tmp_path)
    status = main(["ppo", *argv, "--dry-run", "--gpu_memory_gb", "141"])  # an H200
    out, err = capsys.readouterr()
    assert status == 0, err[-3000:]
    assert "ppo: 8 GPU(s)" in out and "fits:" in out

    config, plan, residency, _ = _residency(argv, 141)
    assert config.vllm_num_engines == 0 and plan.roles["rollout"].gpus == plan.roles["actor"].gpus == (0, 1, 2, 3)
    weights = 2 * _params(folders["34b"])  # 62.9 GiB in bf16
    for gpu in plan.roles["actor"].gpus:
        sync = residency.breakdown(gpu, "sync")
        # the sync: the actor's copy (the source, ZeRO-2 keeps it whole) and the engine's, one each
        assert sync[("actor", "params")] == sync[("rollout", "weights")] == weights
        # generating: the engine's copy only (the actor's is in host memory); training: the actor's only
        generate, train = residency.breakdown(gpu, "generate"), residency.breakdown(gpu, "actor_train")
        assert generate[("rollout", "weights")] == weights and ("actor", "params") not in generate
        assert train[("actor", "params")] == weights and ("rollout", "weights") not in train
    assert residency.move("rollout", "weights") in ("offload", "discard")

    # On 80 GiB GPUs the sync alone needs both copies, 125.7 GiB: refused with those numbers, no copy counted twice
    _, _, small, _ = _residency(argv, 80)
    assert not small.fits()
    sync = small.breakdown(0, "sync")
    assert sync[("actor", "params")] == sync[("rollout", "weights")] == weights
    assert sum(v for (role, item), v in sync.items() if item in ("params", "weights")) == 2 * weights
