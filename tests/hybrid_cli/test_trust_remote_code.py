"""Models that ship their own code load only with ``--trust_remote_code``, and then everywhere a run loads them.

The model: the tiny demo Llama re-labelled as an architecture transformers does not know (``hybrid_tiny_remote``),
with its configuration and model classes in Python files inside the folder (``auto_map``), as hub models that ship
code are. Without the flag the run is refused before Ray; with it, a real GRPO run loads it in the actor, the
reference, the built-in engine and the tokenizers (each would raise otherwise). The critic and the reward model take
the flag the same way (``hybrid_algos.train.models``); a remote-code value model needs its own token-classification
class, which this stand-in does not ship.
"""

import json
import os
import shutil
import textwrap

import pytest

from hybrid_cli.main import main

CONFIGURATION = textwrap.dedent("""
    from transformers import LlamaConfig

    class HybridTinyRemoteConfig(LlamaConfig):
        model_type = "hybrid_tiny_remote"
""")
MODELING = textwrap.dedent("""
    from transformers import LlamaForCausalLM
    from .configuration_hybrid_tiny import HybridTinyRemoteConfig

    class HybridTinyRemoteForCausalLM(LlamaForCausalLM):
        config_class = HybridTinyRemoteConfig
""")


@pytest.fixture(scope="module")
def remote_code_model(tmp_path_factory):
    from hybrid_algos.train.tiny import save_tiny_model

    path = tmp_path_factory.mktemp("remote") / "model"
    shutil.copytree(save_tiny_model(str(tmp_path_factory.mktemp("tiny") / "tiny")), path)
    (path / "configuration_hybrid_tiny.py").write_text(CONFIGURATION)
    (path / "modeling_hybrid_tiny.py").write_text(MODELING)
    config = json.loads((path / "config.json").read_text())
    config.update(
        model_type="hybrid_tiny_remote",
        architectures=["HybridTinyRemoteForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_hybrid_tiny.HybridTinyRemoteConfig",
            "AutoModelForCausalLM": "modeling_hybrid_tiny.HybridTinyRemoteForCausalLM",
        },
    )
    (path / "config.json").write_text(json.dumps(config))
    os.remove(path / "hybrid_tiny.json")
    return str(path)


@pytest.fixture
def data_and_reward(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"s{i % 8} s{(i + 3) % 8}"}) + "\n" for i in range(16)))
    reward = tmp_path / "reward.py"
    reward.write_text("def score(prompts, completions, **kw):\n    return [float('s1' in c) for c in completions]\n")
    return ["--prompt_data", str(data), "--input_key", "prompt", "--reward_fn", f"{reward}:score"]


def test_the_built_in_engine_takes_the_flag(remote_code_model):
    from hybrid_engines import HFEngine

    with pytest.raises(ValueError, match="trust_remote_code"):
        HFEngine(remote_code_model, device="cpu")
    engine = HFEngine(remote_code_model, device="cpu", trust_remote_code=True)
    assert type(engine.model).__name__ == "HybridTinyRemoteForCausalLM"


def test_without_the_flag_the_run_is_refused_before_ray(remote_code_model, data_and_reward, tmp_path, capsys):
    import ray

    assert main(["grpo", "--pretrain", remote_code_model, *data_and_reward, "--save_path", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybrid: error: trust_remote_code:") and "auto_map" in err and "--trust_remote_code" in err
    assert not ray.is_initialized()


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_with_the_flag_every_role_loads_it(remote_code_model, data_and_reward, tmp_path):
    from hybrid_algos.train.deepspeed_ops import ensure_cpu_ops_built

    ensure_cpu_ops_built()
    run = tmp_path / "run"
    argv = [
        "grpo",
        "--pretrain",
        remote_code_model,
        *data_and_reward,
        "--trust_remote_code",
        "--save_path",
        str(run),
        "--max_steps",
        "1",
        "--rollout_batch_size",
        "4",
        "--n_samples_per_prompt",
        "2",
        "--train_batch_size",
        "8",
        "--micro_train_batch_size",
        "8",
        "--generate_max_len",
        "4",
        "--actor_learning_rate",
        "1e-3",
    ]
    assert main(argv) == 0  # actor, reference, engine and tokenizers each loaded the shipped code
    final = json.loads((run / "final" / "config.json").read_text())
    assert final["model_type"] == "hybrid_tiny_remote"
    # the saved model carries the code it needs, so it loads (with the flag) without the original folder
    from transformers import AutoModelForCausalLM

    shutil.rmtree(remote_code_model + "-moved", ignore_errors=True)
    os.rename(remote_code_model, remote_code_model + "-moved")
    try:
        model = AutoModelForCausalLM.from_pretrained(str(run / "final"), trust_remote_code=True)
    finally:
        os.rename(remote_code_model + "-moved", remote_code_model)
    assert type(model).__name__ == "HybridTinyRemoteForCausalLM"
