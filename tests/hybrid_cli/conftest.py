"""Shared local stand-ins for the models and data the reference command lines name: a tiny policy (with a chat
template), a tiny reward model (LlamaForSequenceClassification, num_labels=1, same tokenizer) and a JSONL prompt
file with OpenRLHF's ``context_messages`` field. Built once per test session."""

import json
import os
import shlex

import pytest

CHAT_TEMPLATE = (
    "{{ bos_token }} {% for m in messages %}{{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<sep>{% endif %}"
)
DATA = os.path.join(os.path.dirname(__file__), "data")
COMMANDS = os.path.join(DATA, "openrlhf_commands")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from transformers import AutoTokenizer

    from hybrid_algos.train.tiny import save_tiny_model

    path = save_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny-policy"))
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_reward_dir(tmp_path_factory, tiny_model_dir):
    import torch
    from transformers import AutoTokenizer, LlamaForSequenceClassification

    from hybrid_algos.train.tiny import tiny_model_config

    path = str(tmp_path_factory.mktemp("models") / "tiny-reward")
    torch.manual_seed(1)
    LlamaForSequenceClassification(tiny_model_config(num_labels=1)).save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def prompts_jsonl(tmp_path_factory):
    """1024 prompts (the largest rollout_batch_size of the reference commands), chat messages and plain text."""
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    with open(path, "w") as f:
        for i in range(1024):
            text = f"s{i % 8} s{(i // 8) % 8}"
            f.write(json.dumps({"context_messages": [{"role": "user", "content": text}], "prompt": text}) + "\n")
    return str(path)


@pytest.fixture
def reference_argv(tiny_model_dir, tiny_reward_dir, prompts_jsonl, tmp_path):
    """``reference_argv(name)``: a stored reference command line, model/data/output paths pointed at local stand-ins."""
    return lambda name: _reference_argv(
        name, policy=tiny_model_dir, reward=tiny_reward_dir, prompts=prompts_jsonl, out_dir=tmp_path
    )


def _reference_argv(name, *, policy, reward, prompts, out_dir):
    with open(os.path.join(COMMANDS, name)) as f:
        text = " ".join(line.strip() for line in f if line.strip() and not line.startswith("#"))
    for var, value in (
        ("${RLHF_CKPT_DIR}", str(out_dir)),
        ("$(now)", "t0"),
        ("$TIME", "t0"),
        ("$WANDB_API_KEY", "not-a-real-key"),
    ):
        text = text.replace(var, value)
    argv = shlex.split(text)
    local = {
        "--pretrain": policy,
        "--reward_pretrain": reward,
        "--prompt_data": prompts,
        "--save_path": str(out_dir / "final"),
        "--ckpt_path": str(out_dir / "ckpt"),
    }
    return [local.get(argv[i - 1], word) if i else word for i, word in enumerate(argv)]


# ---- OpenRLHF's launch scripts (tests/hybrid_cli/data/openrlhf_scripts) ----------------------------------------------
@pytest.fixture(scope="session")
def script_prompts(tmp_path_factory):
    """Prompt records carrying every field the scripts name (OpenRLHF's default input key 'input' too), three files
    for the scripts that mix datasets, and OpenRLHF-shaped reward and agent files."""
    from openrlhf_scripts import OPENRLHF_AGENT_FILE, OPENRLHF_REWARD_FILE

    folder = tmp_path_factory.mktemp("script-data")
    paths = []
    for n in range(3):
        path = folder / f"prompts{n}.jsonl"
        with open(path, "w") as f:
            for i in range(1024):
                text = f"s{i % 8} s{(i // 8 + n) % 8}"
                f.write(
                    json.dumps(
                        {
                            "context_messages": [{"role": "user", "content": text}],
                            "prompt": text,
                            "input": text,
                            "label": text.split()[0],
                        }
                    )
                    + "\n"
                )
        paths.append(str(path))
    reward = folder / "reward_func.py"
    reward.write_text(OPENRLHF_REWARD_FILE)
    agent = folder / "agent_func.py"
    agent.write_text(OPENRLHF_AGENT_FILE)
    return {"data": paths, "reward": str(reward), "agent": str(agent)}


@pytest.fixture
def script_argv(tiny_model_dir, tiny_reward_dir, script_prompts, tmp_path):
    """``script_argv("flat/train_ppo_llama_ray.args")``: an OpenRLHF script's flags with local stand-ins."""
    from openrlhf_scripts import openrlhf_script_argv

    return lambda name: openrlhf_script_argv(
        name, policy=tiny_model_dir, reward=tiny_reward_dir, prompts=script_prompts, out_dir=tmp_path
    )
