"""Bad input never gets far: each of these command lines fails before Ray starts (and so before any GPU is taken),
with exit status 2 and one message naming the field and the fix.

The commands are full training commands, not --dry-run, so every check up to the cluster start is exercised:
flag parsing, the config file, validation, placement and what the run resolves before Ray (model, data, backend).
"""

import importlib.util
import json

import pytest

from hybrid_cli.main import main

#: (id, argv after the command, field named in the message); {data} / {dir} / {yaml} are filled in per test.
CASES = [
    ("unknown flag", ["--zzz_unknown", "1"], "zzz_unknown"),
    ("unsupported OpenRLHF flag", ["--lora_rank", "8"], "lora_rank"),
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
    ("group estimator with one sample", ["--n_samples_per_prompt", "1", "--train_batch_size", "16",
                                         "--micro_train_batch_size", "16"], "n_samples_per_prompt"),
    ("fewer samples than a batch", ["--max_samples", "2"], "max_samples"),
    ("zero steps", ["--max_steps", "0"], "max_steps"),
    ("zero rollout batch", ["--rollout_batch_size", "0"], "rollout_batch_size"),
    ("unknown backend", ["--backend", "trt"], "backend"),
    ("TP with the built-in engine", ["--vllm_tensor_parallel_size", "2", "--backend", "hf"], "vllm_tensor_parallel_size"),
    ("engine sleep without colocation", ["--no_colocate_all_models", "--vllm_enable_sleep", "--backend", "hf"],
     "vllm_enable_sleep"),
    ("trainer sleep without colocation", ["--no_colocate_all_models", "--deepspeed_enable_sleep", "--backend", "hf"],
     "deepspeed_enable_sleep"),
    ("engines do not fill the actor's GPUs", ["--colocate_all_models", "--actor_num_gpus_per_node", "2",
                                              "--vllm_num_engines", "3", "--ref_num_gpus_per_node", "2",
                                              "--backend", "hf"], "vllm_num_engines"),
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
]


@pytest.fixture
def fill(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "s1 s2"}) + "\n")
    yaml = tmp_path / "run.yaml"
    yaml.write_text("actor_learnig_rate: 1e-6\n")
    values = {"{data}": str(data), "{dir}": str(tmp_path), "{yaml}": str(yaml)}
    return lambda argv: [values.get(word, word) for word in argv]


def test_the_corpus_is_large_and_names_distinct_fields():
    assert len(CASES) >= 30
    assert len({field for _, _, field in CASES}) >= 30


@pytest.mark.parametrize("argv, field", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_fails_before_ray_naming_field_and_fix(argv, field, fill, tmp_path, capsys):
    import ray

    run_dir = tmp_path / "run"
    status = main(["grpo", *fill(argv), "--save_path", str(run_dir)])
    err = capsys.readouterr().err
    assert status == 2, err
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
