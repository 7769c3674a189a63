"""OpenRLHF's own launch scripts through ``hybrid ppo --dry-run``: every ``train_ppo_ray`` script of OpenRLHF 0.11.2's
``examples/scripts/`` (dotted flags) and seventeen of the flat-flag era (2024-2026), flags as written
(tests/hybrid_cli/data/openrlhf_scripts), models, data and outputs pointed at local stand-ins (conftest.py).

Each script is either accepted with the plan OpenRLHF would run (the GPU count its flags ask for), or refused naming
one of the flags listed for it below, each with the reason a user would agree with. A second test drops the refused
flags (and the ones another part of hybrid is adding, while their setting is missing) and checks that the rest of the
script is understood: it dry-runs with the same GPU count.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest
from openrlhf_scripts import SCRIPTS, read_args

from hybrid_algos.train.config import PPOConfig
from hybrid_cli import openrlhf_flags as orl
from hybrid_cli.dry_run import build_plan
from hybrid_cli.flags import field_specs
from hybrid_cli.main import load_config, main


@dataclass(frozen=True)
class Case:
    gpus: int  # what the script's flags ask for in OpenRLHF
    why_gpus: str
    refused: dict[str, str] = field(default_factory=dict)  # flag -> fragment of the error (the reason)
    pending: dict[str, str] = field(default_factory=dict)  # flag -> the setting another helper adds
    replace: dict[str, str] = field(default_factory=dict)  # for the second test: a refusal's suggested value
    add: tuple[str, ...] = ()  # for the second test: what replaces a refused flag ({reward_file}: a reward file)
    xfail_without_refused: str | None = None


_IS = "algo.advantage.is_correction_level"
CASES = {
    # ---- OpenRLHF 0.11.2 (dotted) ------------------------------------------------------------------------------
    "dotted/train_ppo_ray_slurm.args": Case(
        16, "actor 4 + engines 4 x TP 2 + critic 4; reference on the actor's, reward model on the critic's GPUs"
    ),
    "dotted/train_ppo_with_reward_fn.args": Case(
        8, "actor 2 (reference on them) + engines 2 x TP 2 + critic 2 (from the actor); the reward is a file"
    ),
    "dotted/train_ppo_ray_hybrid_engine.args": Case(
        8,
        "everything colocated on the actor's 8 GPUs, 4 engines x TP 2",
        pending={
            "train.dynamic_batch_enable": "use_dynamic_batch",
            "train.max_tokens_per_gpu": "use_dynamic_batch",
            _IS: "enable_vllm_is_correction",
        },
    ),
    "dotted/train_dapo_ray_hybrid_engine.args": Case(
        8,
        "everything colocated on the actor's 8 GPUs (no reward model: a reward file)",
        pending={"algo.dynamic_filtering_enable": "dynamic_filtering", _IS: "enable_vllm_is_correction"},
    ),
    "dotted/train_prorlv2_math_hybrid_engine.args": Case(
        8,
        "everything colocated on the actor's 8 GPUs, 8 engines",
        refused={"reward.stop_properly_penalty_coef": "rescaling the reward of completions cut"},
        pending={
            "algo.dynamic_filtering_enable": "dynamic_filtering",
            "train.dynamic_batch_enable": "use_dynamic_batch",
            "train.max_tokens_per_gpu": "use_dynamic_batch",
            _IS: "enable_vllm_is_correction",
        },
    ),
    "dotted/train_reinforce_baseline_hybrid_engine.args": Case(
        4,
        "actor 4, reference and 2 engines x TP 2 on the same GPUs",
        refused={"ds.ring_attn_size": "ring attention", "ds.ring_attn_head_stride": "ring attention"},
        pending={
            "algo.dynamic_filtering_enable": "dynamic_filtering",
            "train.dynamic_batch_enable": "use_dynamic_batch",
            "rollout.max_tokens_per_gpu": "use_dynamic_batch",
            "train.max_tokens_per_gpu": "use_dynamic_batch",
            _IS: "enable_vllm_is_correction",
        },
    ),
    "dotted/train_reinforce_baseline_ray_agent_async.args": Case(
        4,
        "actor 4, reference and 2 engines x TP 2 on the same GPUs",
        refused={"ds.ring_attn_size": "ring attention", "ds.ring_attn_head_stride": "ring attention"},
        pending={
            "algo.dynamic_filtering_enable": "dynamic_filtering",
            "train.dynamic_batch_enable": "use_dynamic_batch",
            "rollout.max_tokens_per_gpu": "use_dynamic_batch",
            "train.max_tokens_per_gpu": "use_dynamic_batch",
            _IS: "enable_vllm_is_correction",
        },
    ),
    "dotted/train_flash_reinforce_ray_agent_async.args": Case(
        8,
        "actor 1 + 7 engines (no reference at KL 0, no critic)",
        refused={
            "rollout.vllm_generate_batch_size": "over-sampling",
            "algo.advantage.estimator": "FlashREINFORCE",
            "algo.advantage.is_correction_gating": "trust region",
        },
        pending={
            _IS: "enable_vllm_is_correction",
            "algo.advantage.is_correction_threshold": "enable_vllm_is_correction",
        },
        replace={"algo.advantage.estimator": "reinforce"},
    ),
    "dotted/train_vlm_math_hybrid_engine.args": Case(
        4,
        "actor 4 with 4 engines on the same GPUs (KL 0: no reference)",
        refused={
            "actor.freeze_visual_encoder": "vision-language training",
            "ds.attn_implementation": "'eager' attention",
        },
        # --data.image_key / --data.max_images_per_prompt are settings now (train/images.py); the stand-in model
        # and prompts are text, so the plan is checked as a text run
        replace={"data.max_images_per_prompt": "0"},
    ),
    # ---- the flat-flag era (issue 24's seventeen) -----------------------------------------------------------------
    "flat/train_dapo_ray_hybrid_engine.args": Case(
        8,
        "everything colocated on the actor's 8 GPUs (a reward file, no reward model)",
        pending={"dynamic_filtering": "dynamic_filtering", "dynamic_filtering_reward_range": "dynamic_filtering"},
    ),
    "flat/train_grpo_llama_ray.args": Case(8, "actor 4 + engines 2 + reference 1 + reward model 1"),
    "flat/train_grpo_ray_hybrid_engine.args": Case(8, "everything colocated on the actor's 8 GPUs"),
    "flat/train_gspo_ray_hybrid_engine.args": Case(
        8,
        "everything colocated on the actor's 8 GPUs (KL 0: no reference)",
        pending={"policy_loss_type": "policy_loss_type"},
    ),
    "flat/train_ppo_llama3_ray_colocate.args": Case(
        8, "actor 2 (+ reference) + engines 2 x TP 2 + critic 2 (+ reward model); reference and reward sleep"
    ),
    "flat/train_ppo_llama_ray.args": Case(8, "actor 2 (+ reference) + engines 2 x TP 2 + critic 2 (+ reward model)"),
    "flat/train_ppo_llama_ray_34b.args": Case(
        8, "actor 4 (no engines: generation on the actor's GPUs) + critic 2 + reference 1 + reward model 1"
    ),
    "flat/train_ppo_llama_ray_70b.args": Case(32, "actor 8 + engines 4 x TP 2 + critic 8 + reference 4 + reward 4"),
    "flat/train_ppo_llama_ray_hybrid_engine.args": Case(8, "everything colocated on the actor's 8 GPUs"),
    "flat/train_ppo_llama_ray_hybrid_engine_dynamic_batch.args": Case(
        8,
        "everything colocated on the actor's 8 GPUs",
        pending={"use_dynamic_batch": "use_dynamic_batch", "train_max_tokens_per_gpu": "use_dynamic_batch"},
    ),
    "flat/train_ppo_llama_ray_remote_rm.args": Case(
        7,
        "actor 4 (no engines) + critic 2 + reference 1; the reward is an HTTP server, so no reward model",
        refused={"train_batch_size": "16 samples per step is not a multiple of train_batch_size = 128"},
        replace={"train_batch_size": "16"},
    ),
    "flat/train_ppo_llama_ray_ring.args": Case(
        8,
        "actor 2 (+ reference) + engines 2 x TP 2 + critic 2 (+ reward model)",
        refused={"ring_attn_size": "ring attention", "ring_head_stride": "ring attention"},
    ),
    "flat/train_ppo_llama_ray_tensor_parallelism.args": Case(
        8,
        "everything colocated on the actor's 8 GPUs",
        refused={"ds_tensor_parallel_size": "tensor parallelism of the trainers"},
    ),
    "flat/train_ppo_llama_ray_with_dynamic_sampling.args": Case(
        8,
        "actor 2 (+ reference) + engines 2 x TP 2 + critic 2 (+ reward model)",
        refused={
            "custom_experience_filter": "filtering experiences with your own Python",
            "store_extra_buffers": "keeping filtered samples",
        },
    ),
    "flat/train_reinforce_baseline_llama_ray_hybrid_engine.args": Case(
        8,
        "everything colocated on the actor's 8 GPUs",
        pending={"enable_vllm_is_correction": "enable_vllm_is_correction"},
    ),
    "flat/train_reinforce_llama_ray.args": Case(8, "actor 4 + engines 2 + reference 1 + reward model 1"),
    "flat/train_reinforce_llama_ray_hybrid_engine.args": Case(8, "everything colocated on the actor's 8 GPUs"),
}
STORED = sorted(
    os.path.relpath(os.path.join(d, f), SCRIPTS)
    for d, _, files in os.walk(SCRIPTS)
    for f in files
    if f.endswith(".args")
)
FIELDS = set(field_specs(PPOConfig))


def test_every_stored_script_has_a_case_and_the_issue_s_seventeen_are_there():
    assert sorted(CASES) == STORED
    assert len([n for n in STORED if n.startswith("flat/")]) == 17
    assert len([n for n in STORED if n.startswith("dotted/")]) == 9


def _blocking(case: Case) -> dict[str, str]:
    """Flags that stop the script today: refused ones, and pending ones whose setting does not exist yet."""
    missing = {flag: f"no {setting!r} setting" for flag, setting in case.pending.items() if setting not in FIELDS}
    return {**case.refused, **missing}


def _params(test: str):
    out = []
    for name, case in CASES.items():
        reason = case.xfail_without_refused if test == "without_refused" else None
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        out.append(pytest.param(name, id=name.replace(".args", ""), marks=marks))
    return out


def _dry_run(argv, capsys):
    status = main(["ppo", *argv, "--dry-run", "--gpu_memory_gb", "80"])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


@pytest.mark.parametrize("name", _params("as_written"))
def test_script_as_written_is_accepted_with_its_plan_or_refused_for_its_reason(name, script_argv, capsys):
    import ray

    case = CASES[name]
    status, out, err = _dry_run(script_argv(name), capsys)
    blocking = _blocking(case)
    if blocking:
        assert status == 2, out[-2000:]
        field_named = err.split("hybrid: error: ", 1)[1].split(":", 1)[0]
        assert field_named in blocking, err
        assert blocking[field_named] in err and "Fix:" in err, err
    else:
        assert status == 0, err
        assert f"ppo: {case.gpus} GPU(s)" in out, (case.why_gpus, out[:3000])
        assert "fits:" in out
    assert not ray.is_initialized()


@pytest.mark.parametrize("name", _params("without_refused"))
def test_script_without_its_refused_flags_runs_the_plan_openrlhf_would(name, script_argv, script_prompts, capsys):
    case = CASES[name]
    argv = _drop(script_argv(name), _blocking(case), case.replace)
    argv += [w.replace("{reward_file}", script_prompts["reward"]) for w in case.add]
    status, out, err = _dry_run(argv, capsys)
    assert status == 0, err
    assert f"ppo: {case.gpus} GPU(s)" in out, (case.why_gpus, out[:3000])
    config, _, _ = load_config("ppo", argv)
    assert build_plan(config).num_gpus == case.gpus


def _drop(argv, flags, replace):
    """``argv`` without ``flags`` (and their values), with ``replace``'s values."""
    out, i = [], 0
    while i < len(argv):
        word = argv[i]
        name = word[2:] if word.startswith("--") else None
        values = []
        i += 1
        while i < len(argv) and not argv[i].startswith("--"):
            values.append(argv[i])
            i += 1
        if name in replace:
            out += [word, replace[name]]
        elif name not in flags:
            out += [word, *values]
    return out


# ---- what the accepted plans look like ----------------------------------------------------------------------------
def test_colocated_script_puts_every_role_on_the_actor_s_gpus(script_argv):
    config, _, _notes = load_config("ppo", script_argv("flat/train_ppo_llama_ray_hybrid_engine.args"))
    plan = build_plan(config)
    assert set(plan.roles) == {"actor", "rollout", "critic", "reference", "reward"}
    assert all(role.gpus == tuple(range(8)) for role in plan.roles.values())
    assert plan.roles["rollout"].tp == 2 and plan.roles["rollout"].world_size == 4
    residency = _residency(config, plan)
    assert residency.sleeps("rollout") and residency.sleeps("actor")  # --vllm_enable_sleep --deepspeed_enable_sleep
    assert config.backend == "vllm" and config.bf16 and config.zero_stage == 3


def test_dotted_script_means_what_its_flags_say(script_argv):
    config, _, notes = load_config("ppo", script_argv("dotted/train_ppo_ray_slurm.args"))
    assert (config.actor_learning_rate, config.critic_learning_rate, config.init_kl_coef) == (5e-7, 9e-6, 0.01)
    assert config.colocate_actor_ref and config.colocate_critic_reward and not config.colocate_all_models
    assert config.micro_train_batch_size == 8 and config.rollout_batch_size == 1024 and config.max_samples == 100000
    assert config.bf16 and config.adam_offload and config.gradient_checkpointing and config.packing_samples
    assert config.input_key == "context_messages" and config.apply_chat_template and config.normalize_reward
    # --data.max_len 2048 split into hybrid's two limits, and said so
    assert (config.prompt_max_len, config.generate_max_len) == (1024, 1024)
    assert any("--data.max_len 2048" in n for n in notes)
    assert any("OpenRLHF's defaults" in n for n in notes)


def test_no_engines_generates_on_the_actor_s_gpus_and_says_so(script_argv):
    config, _, notes = load_config("ppo", script_argv("flat/train_ppo_llama_ray_34b.args"))
    plan = build_plan(config)
    assert config.vllm_num_engines == 0 and config.backend == "hf"
    assert plan.roles["rollout"].gpus == plan.roles["actor"].gpus == (0, 1, 2, 3)
    assert plan.roles["critic"].gpus == (4, 5) and plan.roles["reference"].gpus == (6,)
    _residency(config, plan).check()  # the engine and the actor take turns on those GPUs as the planner decides
    assert any("--vllm_num_engines 0" in n and "built-in" in n for n in notes)
    # three datasets mixed 0.4/0.5/0.1, OpenRLHF's way
    assert config.prompt_data.count(",") == 2 and config.prompt_data_probs == "0.4,0.5,0.1"


def test_remote_reward_server_replaces_the_reward_model(script_argv):
    argv = _drop(script_argv("flat/train_ppo_llama_ray_remote_rm.args"), {}, {"train_batch_size": "16"})
    config, _, notes = load_config("ppo", argv)
    plan = build_plan(config)
    assert config.reward_fn == "http://127.0.0.1:5000/get_rm_score" and config.reward_pretrain is None
    assert "reward" not in plan.roles and plan.num_gpus == 7
    assert config.vllm_tensor_parallel_size == 1  # TP 2 without engines is unused, as in OpenRLHF
    assert any("no reward model runs" in n for n in notes)
    assert any("--vllm_tensor_parallel_size 2 is unused" in n for n in notes)


def test_ref_reward_offload_lets_the_frozen_models_sleep(script_argv):
    config, _, _ = load_config("ppo", script_argv("flat/train_ppo_llama3_ray_colocate.args"))
    plan = build_plan(config)
    assert config.ref_reward_offload
    residency = _residency(config, plan)
    assert residency.sleeps("reference") and residency.sleeps("reward")
    assert plan.roles["reference"].gpus == plan.roles["actor"].gpus
    assert plan.roles["reward"].gpus == plan.roles["critic"].gpus


def _residency(config, plan):
    from hybrid_algos.train.placement import build_residency

    residency, _ = build_residency(config, plan, config.pretrain, prompt_len=64, generate_len=64, gpu_bytes=80 * 2**30)
    return residency


def test_every_flag_of_every_script_is_known_to_the_table():
    flags = orl.openrlhf_flags()
    for name in STORED:
        for word in read_args(os.path.join(SCRIPTS, name)):
            if word.startswith("--"):
                assert word[2:] in flags or word[2:] in FIELDS, (name, word)


def test_the_slurm_script_s_two_nodes(script_argv, capsys):
    """OpenRLHF's slurm script runs on 2 nodes of 8 GPUs (#SBATCH -N 2): with the node size the plan lays the 16
    GPUs out on the two nodes, each TP-2 engine inside one."""
    argv = [*script_argv("dotted/train_ppo_ray_slurm.args"), "--gpus_per_node", "8"]
    status, out, err = _dry_run(argv, capsys)
    assert status == 0, err
    assert "placement: 16 GPUs on 2 nodes (8 GPUs per node)" in out and "node 1 (GPUs 8-15)" in out
    config, _, _ = load_config("ppo", argv)
    plan = build_plan(config)
    for worker in plan.roles["rollout"].workers:
        assert len({plan.node_of(g) for g in worker.gpus}) == 1
    assert {plan.node_of(g) for g in plan.roles["rollout"].gpus} == {0, 1}  # the engines span both nodes


def test_scripts_run_openrlhf_s_algorithm_where_they_leave_it_to_its_defaults(script_argv):
    """What a script leaves out is OpenRLHF's default of its release, not the subcommand's (issue 34): TIS with
    OpenRLHF's bounds for token + clip, GAE's lambda 1, the value clip 0.5, KL k1 in the reward, a 3 % warm-up."""
    config, _, notes = load_config("ppo", script_argv("dotted/train_ppo_ray_hybrid_engine.args"))
    assert config.enable_vllm_is_correction and config.correction_type == "tis"
    assert config.correction_bounds == (0.5, 5.0)  # 0.11.2's default threshold, not hybrid's TIS bound (None, 2.0)
    assert "OpenRLHF 0.11.2" in notes[0]
    config, _, notes = load_config("ppo", script_argv("flat/train_ppo_llama_ray.args"))
    assert (config.lambd, config.value_clip, config.kl_estimator, config.use_kl_loss) == (1.0, 0.5, "k1", False)
    assert (config.lr_scheduler, config.lr_warmup_ratio) == ("cosine_with_min_lr", 0.03)
    assert not config.enable_vllm_is_correction  # 0.10.1: no correction unless --enable_vllm_is_correction
    assert "OpenRLHF 0.10.1" in notes[0]
    assert any(n.startswith("differs from OpenRLHF 0.10.1: --vllm_enable_sleep not given") for n in notes)
    # the GRPO script under `hybrid grpo` keeps its own KL settings and gets 0.10.1's for the rest
    config, _, _ = load_config("grpo", script_argv("flat/train_grpo_ray_hybrid_engine.args"))
    assert (config.kl_estimator, config.use_kl_loss, config.init_kl_coef) == ("k3", True, 1e-3)
    assert config.advantage_estimator == "group_norm" and config.lr_warmup_ratio == 0.03
