"""Bad input never gets far: each of these command lines fails before Ray starts (and so before any GPU is taken),
with exit status 2 and one message naming the field and the fix.

The commands are full training commands, not --dry-run, so every check up to the cluster start is exercised:
flag parsing, the config file, validation, placement and what the run resolves before Ray (model, data, backend).
"""

import importlib.util
import json
import os
import shutil

import pytest

from hybrid_cli.main import main

#: (id, argv after the command, field named in the message); {data} / {dir} / {yaml} are filled in per test.
CASES = [
    ("unknown flag", ["--zzz_unknown", "1"], "zzz_unknown"),
    ("unsupported OpenRLHF flag", ["--load_in_4bit"], "load_in_4bit"),
    ("misspelt flag", ["--actor_learning_rte", "1e-6"], "actor_learning_rte"),
    ("single dash", ["-x"], "x"),
    ("value after a switch", ["--bf16", "true"], "arguments"),
    ("not a number", ["--zero_stage", "three"], "zero_stage"),
    ("zero stage out of range", ["--zero_stage", "5"], "zero_stage"),
    ("missing model folder", ["--pretrain", "/no/such/model"], "pretrain"),
    ("missing reward model", ["--reward_pretrain", "/no/such/rm"], "reward_pretrain"),
    ("missing data file", ["--prompt_data", "/no/such.jsonl", "--input_key", "prompt"], "prompt_data"),
    ("dataset without --input_key", ["--prompt_data", "{data}"], "input_key"),
    ("missing config file", ["--config", "/no/such.yaml"], "config"),
    ("unknown key in config file", ["--config", "{yaml}"], "actor_learnig_rate"),
    ("reward module missing", ["--reward_fn", "no_such_module_xyz:score"], "reward_fn"),
    ("reward_fn without function", ["--reward_fn", "just_a_module"], "reward_fn"),
    ("two rewards", ["--reward_pretrain", "{dir}", "--reward_fn", "json:loads"], "reward_fn"),
    ("train batch does not divide the samples", ["--train_batch_size", "5"], "train_batch_size"),
    ("micro batch does not divide the train batch", ["--micro_train_batch_size", "3"], "micro_train_batch_size"),
    (
        "group estimator with one sample",
        ["--n_samples_per_prompt", "1", "--train_batch_size", "16", "--micro_train_batch_size", "16"],
        "n_samples_per_prompt",
    ),
    ("fewer samples than a batch", ["--max_samples", "2"], "max_samples"),
    ("zero steps", ["--max_steps", "0"], "max_steps"),
    ("zero rollout batch", ["--rollout_batch_size", "0"], "rollout_batch_size"),
    ("unknown backend", ["--backend", "trt"], "backend"),
    (
        "TP with the built-in engine",
        ["--vllm_tensor_parallel_size", "2", "--backend", "hf"],
        "vllm_tensor_parallel_size",
    ),
    (
        "engine sleep without colocation",
        ["--no_colocate_all_models", "--vllm_enable_sleep", "--backend", "hf"],
        "vllm_enable_sleep",
    ),
    (
        "trainer sleep without colocation",
        ["--no_colocate_all_models", "--deepspeed_enable_sleep", "--backend", "hf"],
        "deepspeed_enable_sleep",
    ),
    (
        "engines do not fill the actor's GPUs",
        [
            "--colocate_all_models",
            "--actor_num_gpus_per_node",
            "2",
            "--vllm_num_engines",
            "3",
            "--ref_num_gpus_per_node",
            "2",
            "--backend",
            "hf",
        ],
        "vllm_num_engines",
    ),
    ("GPU range runs backwards", ["--placement", "actor=0-1", "rollout=3-2"], "placement.rollout"),
    ("placement word without GPUs", ["--placement", "actor"], "placement"),
    ("fewer declared GPUs than the plan", ["--num_gpus", "0"], "num_gpus"),
    ("GPUs declared for a running cluster", ["--address", "127.0.0.1:1", "--num_gpus", "1"], "num_gpus"),
    ("memory fraction above 1", ["--vllm_gpu_memory_utilization", "1.5"], "vllm_gpu_memory_utilization"),
    ("sleep level 3", ["--engine_sleep_level", "3"], "engine_sleep_level"),
    ("negative temperature", ["--temperature", "-1"], "temperature"),
    ("top_p zero", ["--top_p", "0"], "top_p"),
    ("clip above 1", ["--eps_clip", "1.5"], "eps_clip"),
    ("dual clip below 1", ["--dual_clip", "0.5"], "dual_clip"),
    ("reward clip backwards", ["--reward_clip_range", "5", "1"], "reward_clip_range"),
    ("save every 0 steps", ["--save_steps", "0"], "save_steps"),
    ("resume without checkpoints", ["--resume", "--ckpt_path", "/no/such/ckpt"], "resume"),
    ("unknown estimator", ["--advantage_estimator", "magic"], "advantage_estimator"),
    ("unknown KL estimator", ["--kl_estimator", "k9"], "kl_estimator"),
    ("unknown task", ["--task", "sing"], "task"),
    ("zero timeout", ["--call_timeout_s", "0"], "call_timeout_s"),
    ("endless step budget", ["--step_timeout_s", "inf"], "step_timeout_s"),
    ("unbounded logs", ["--ray_log_max_mb", "0"], "ray_log_max_mb"),
    ("unknown weight sync", ["--weight_sync", "pigeon"], "weight_sync"),
    # ---- the run folder and checkpoints (issue 23: no run silently destroyed, failures found at start) ----
    ("save_path is a file", ["--save_path", "{file}"], "save_path"),
    ("save_path under a file", ["--save_path", "{file}/run"], "save_path"),
    ("ckpt_path under a file", ["--ckpt_path", "{file}/ckpt"], "ckpt_path"),
    ("save_path not writable", ["--save_path", "{read_only}/run"], "save_path"),
    ("ckpt_path not writable", ["--ckpt_path", "{read_only}/ckpt"], "ckpt_path"),
    ("save_path holds an earlier run", ["--save_path", "{used_run}"], "save_path"),
    ("resume and overwrite together", ["--save_path", "{used_run}", "--resume", "--overwrite"], "overwrite"),
    ("resume a GRPO checkpoint as ppo", ["ppo", "--save_path", "{grpo_run}", "--resume"], "resume"),
    ("resume from damaged checkpoints only", ["--save_path", "{damaged_run}", "--resume"], "resume"),
    ("resume a checkpoint that would run code", ["--save_path", "{pickle_run}", "--resume"], "resume"),
    ("resume a folder without checkpoints", ["--save_path", "{used_run}", "--resume"], "resume"),
    # ---- model folders, data and reward files that cannot be read ----
    ("corrupted config.json", ["--pretrain", "{bad_config_model}"], "pretrain"),
    ("model folder without config.json", ["--pretrain", "{dir}"], "pretrain"),
    ("model folder without tokenizer files", ["--pretrain", "{no_tokenizer_model}"], "pretrain"),
    ("model type unknown to transformers", ["--pretrain", "{unknown_type_model}"], "pretrain"),
    ("model ships code, no --trust_remote_code", ["--pretrain", "{remote_code_model}"], "trust_remote_code"),
    (
        "corrupted reward model config.json",
        ["--reward_pretrain", "{bad_config_model}", "--prompt_data", "{data}", "--input_key", "prompt"],
        "reward_pretrain",
    ),
    (
        "prompt file that is not UTF-8",
        [
            "--pretrain",
            "{model}",
            "--prompt_data",
            "{latin1_data}",
            "--input_key",
            "prompt",
            "--reward_fn",
            "{good_reward}",
        ],
        "prompt_data",
    ),
    ("reward file with an ImportError", ["--reward_fn", "{import_error_reward}"], "reward_fn"),
    ("reward file with a SyntaxError", ["--reward_fn", "{syntax_error_reward}"], "reward_fn"),
    ("reward file raising at import", ["--reward_fn", "{raising_reward}"], "reward_fn"),
    ("reward file without the function", ["--reward_fn", "{good_reward_file}:nope"], "reward_fn"),
]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from hybrid_algos.train.tiny import save_tiny_model

    return save_tiny_model(str(tmp_path_factory.mktemp("model") / "tiny"))


@pytest.fixture
def fill(tmp_path, tiny_model):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "s1 s2"}) + "\n")
    yaml = tmp_path / "run.yaml"
    yaml.write_text("actor_learnig_rate: 1e-6\n")
    values = {"{data}": str(data), "{dir}": str(tmp_path), "{yaml}": str(yaml), "{model}": tiny_model}
    values.update(_bad_folders(tmp_path, tiny_model))

    def fill_in(argv):
        out = []
        for word in argv:
            for key, value in values.items():
                word = word.replace(key, value)
            out.append(word)
        return out

    return fill_in


def _bad_folders(tmp_path, tiny_model):
    """Model folders, data, reward files and run folders that are wrong in one way each."""
    from hybrid_algos.train.checkpoint import CheckpointManager

    made = {}

    def model_copy(name, change):
        path = tmp_path / name
        shutil.copytree(tiny_model, path)
        change(path)
        made["{" + name + "}"] = str(path)

    model_copy("bad_config_model", lambda p: (p / "config.json").write_text('{"model_type": "llama", "hidden_'))
    model_copy("no_tokenizer_model", lambda p: [(p / f).unlink() for f in os.listdir(p) if "token" in f])

    def set_config(p, **changes):
        config = json.loads((p / "config.json").read_text())
        (p / "config.json").write_text(json.dumps({**config, **changes}))

    model_copy("unknown_type_model", lambda p: set_config(p, model_type="hybrid-no-such-arch"))
    model_copy(
        "remote_code_model", lambda p: set_config(p, auto_map={"AutoModelForCausalLM": "modeling_x.XForCausalLM"})
    )

    file = tmp_path / "a-file"
    file.write_text("not a folder")
    made["{file}"] = str(file)
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    read_only.chmod(0o555)
    made["{read_only}"] = str(read_only) if os.geteuid() != 0 else "/proc/self/hybrid-read-only"  # root writes anyway

    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(
        json.dumps({"prompt": "s1 s2 caf\u00e9"}).encode("utf-8").replace(b"\\u00e9", "\u00e9".encode("latin-1"))
        + b"\n"
    )
    made["{latin1_data}"] = str(latin1)
    rewards = {
        "import_error_reward": "import no_such_package_hybrid_xyz\n",
        "syntax_error_reward": "def score(prompts, completions, **kw)\n    return [0.0]\n",
        "raising_reward": "raise RuntimeError('configure me first')\n",
        "good_reward": "def score(prompts, completions, **kw):\n    return [0.0] * len(completions)\n",
    }
    for name, text in rewards.items():
        path = tmp_path / f"{name}.py"
        path.write_text(text)
        made["{" + name + "}"] = f"{path}:score"
        made["{" + name + "_file}"] = str(path)

    used = tmp_path / "used-run"  # an earlier run: metrics, no checkpoint
    used.mkdir()
    (used / "metrics.jsonl").write_text('{"step": 0, "reward": 0.1}\n')
    made["{used_run}"] = str(used)

    def run_with_checkpoint(name, state, damage=None):
        run = tmp_path / name
        path = CheckpointManager(str(run / "checkpoints")).save(2, lambda folder: None, state)
        if damage:
            damage(path)
        made["{" + name + "}"] = str(run)

    grpo = {
        "algorithm": "grpo",
        "advantage_estimator": "group_norm",
        "uses_critic": False,
        "actor_world_size": 1,
        "critic_world_size": 0,
        "zero_stage": 2,
        "tiny_model": {},
    }
    run_with_checkpoint("grpo_run", {"next_step": 2, "essentials": grpo})
    run_with_checkpoint(
        "damaged_run", {"next_step": 2}, lambda p: open(os.path.join(p, "driver_state.json"), "w").close()
    )
    run_with_checkpoint("pickle_run", {"next_step": 2, "essentials": grpo}, _crafted_role_file)
    return made


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def _crafted_role_file(path):
    import torch

    os.makedirs(os.path.join(path, "actor", "state"))
    torch.save({"module": {}, "x": _RunsCode()}, os.path.join(path, "actor", "state", "mp_rank_00_model_states.pt"))


def test_the_corpus_is_large_and_names_distinct_fields():
    assert len(CASES) >= 65
    assert len({field for _, _, field in CASES}) >= 30


@pytest.mark.parametrize("argv, field", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_fails_before_ray_naming_field_and_fix(argv, field, fill, tmp_path, capsys):
    import ray

    run_dir = tmp_path / "run"
    command = argv[0] if argv[0] in ("ppo", "grpo", "reinforce") else "grpo"
    argv = fill(argv[1:] if command == argv[0] else argv)
    if "--save_path" not in argv:
        argv += ["--save_path", str(run_dir)]
    status = main([command, *argv])
    err = capsys.readouterr().err
    assert status == 2, err
    assert "pwned" not in capsys.readouterr().out
    assert err.startswith(f"hybrid: error: {field}:"), err
    assert " Fix: " in err and len(err.split(" Fix: ")[1].strip()) > 5, err
    assert not ray.is_initialized()
    assert not (run_dir / "logs").exists()  # no worker ever started


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_backend_that_is_not_installed(tmp_path, capsys):
    import ray

    assert main(["grpo", "--backend", "vllm", "--save_path", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybrid: error: backend:") and "pip install" in err and "--backend hf" in err
    assert not ray.is_initialized()
