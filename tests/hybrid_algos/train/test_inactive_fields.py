"""No setting is accepted and then ignored (issue 34 section 2).

Every config field and CLI flag is either read by code whatever the other settings say (checked here with a grep of
the packages' source: a field nothing reads fails) or covered by a rule of the one declared table
(hybrid_algos.train.inactive), and every rule refuses a config where it applies -- or, for a flag OpenRLHF also
ignores there, notes it on an OpenRLHF command line. ``--partial_rollout`` keeps every engine setting on every backend
(it once replaced vLLM's and SGLang's with the adapters' defaults: memory fraction 0.5 whatever the flag said, prefix
caching on, no max_model_len, no enforce_eager, no dtype, TP 1). vLLM and SGLang cannot run on CPU: those tests check
the kwargs builder, which needs no engine.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from hybrid_algos.train import inactive
from hybrid_algos.train.config import CONFIGS, DEMO_SETTINGS, GRPOConfig, PPOConfig, RLConfig
from hybrid_algos.train.loop import TrainingSession
from hybrid_core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ROOT / "packages"
CONFIG_PY = PACKAGES / "hybrid-algos" / "src" / "hybrid_algos" / "train" / "config.py"
#: Files that name the settings without acting on them: the config itself, the CLI's flag tables and help texts.
NOT_READERS = {
    CONFIG_PY,
    *(
        PACKAGES / "hybrid-cli" / "src" / "hybrid_cli" / n
        for n in ("flags.py", "openrlhf.py", "openrlhf_flags.py", "config_file.py")
    ),
    PACKAGES / "hybrid-algos" / "src" / "hybrid_algos" / "train" / "inactive.py",
}


def all_fields() -> set[str]:
    return {f.name for cls in CONFIGS.values() for f in dataclasses.fields(cls)}


def _sources() -> str:
    return "\n".join(
        p.read_text(encoding="utf-8")
        for p in PACKAGES.rglob("*.py")
        if "/src/" in p.as_posix() and p not in NOT_READERS
    )


def _read_outside(name: str, text: str) -> bool:
    """``name`` is read as an attribute (``cfg.name``) or through getattr (``getattr(config, "name"``)."""
    return bool(re.search(rf"[\w)\]]\.{name}\b", text) or re.search(rf"getattr\(\w+, [\"']{name}[\"']", text))


def _read_through_config_methods(text: str) -> set[str]:
    """Fields read by RLConfig's methods and properties (not its validation) that code outside config.py calls, and
    fields its validation hands to another module's function (``prepare(self.plugins)`` imports the user's files)."""
    import builtins

    tree = ast.parse(CONFIG_PY.read_text(encoding="utf-8"))
    fields, out = all_fields(), set()
    local = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)} | set(dir(builtins)) | {"ConfigError"}
    for call in (
        n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id not in local
    ):
        out |= {
            a.attr
            for a in call.args
            if isinstance(a, ast.Attribute) and isinstance(a.value, ast.Name) and a.value.id == "self"
        }
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name.endswith("Config")):
        for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
            if fn.name == "validate" or fn.name.startswith("_") or not _read_outside(fn.name, text):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                    out.add(node.attr)
                elif isinstance(node, ast.Constant) and node.value in fields:  # getattr(self, name) over names
                    out.add(node.value)
    return out & fields


def _read_through_sections(text: str) -> set[str]:
    """Fields read as their section's setting (``sections.TABLE``: ``colocate_all_models`` is read as
    ``placement.colocate_all``, an attribute of the section the code takes)."""
    from hybrid_algos.train.sections import TABLE

    return {flat for flat, path in TABLE if _read_outside(path.partition(".")[2], text)}


def _read_by_recipes() -> set[str]:
    """Settings a built-in recipe's role names as its model folder (``RoleSpec.model``: data the loop reads with
    ``RoleSpec.model_folder``, e.g. the critic's ``critic_pretrain``)."""
    from hybrid_algos.train.recipe import RoleSpec
    from hybrid_algos.train.recipes import RECIPES

    names = {s for r in RECIPES.values() for role in r.roles if not callable(role.model) for s in role.model}
    assert "getattr(config, setting" in inspect.getsource(RoleSpec.model_folder)  # how the loop reads them
    return names


def test_every_field_is_read_by_code_or_covered_by_a_rule():
    fields = all_fields()
    covered = inactive.covered_fields()
    assert covered <= fields, f"rules for fields that do not exist: {sorted(covered - fields)}"
    text = _sources()
    read = {n for n in fields if _read_outside(n, text)} | _read_through_config_methods(text)
    read |= _read_by_recipes() | _read_through_sections(text)
    unread = sorted(fields - read)
    assert not unread, f"config fields no code reads (implement them, or refuse them in inactive.py): {unread}"
    # the table's own parts: a reason and a fix for every rule, and "openrlhf" only on a flag OpenRLHF has
    from hybrid_cli import openrlhf_flags as orl

    openrlhf_fields = {getattr(orl.rule_for(n), "field", None) for n in orl.openrlhf_flags()}
    for rule in inactive.RULES:
        assert rule.reason and rule.fix, rule.field
        assert not rule.openrlhf or rule.field in openrlhf_fields, f"{rule.field}: OpenRLHF has no such flag"


def test_every_cli_flag_is_a_classified_field_or_an_openrlhf_rule():
    from hybrid_cli import openrlhf_flags as orl
    from hybrid_cli.flags import CLI_ONLY, OPENRLHF_DEST
    from hybrid_cli.main import _subparser, build_parser

    parser, fields = build_parser(), all_fields()
    for command in CONFIGS:
        for action in _subparser(parser, command)._actions:
            dest = action.dest
            if dest in fields or dest in CLI_ONLY or dest == "help":
                continue  # a field: classified by the test above
            assert dest.startswith(OPENRLHF_DEST), (command, action.option_strings)
            rule = orl.rule_for(dest[len(OPENRLHF_DEST) :])  # translated to fields, or refused / noted by the table
            assert rule.kind in ("same", "convert", "pending", "only", "note", "refuse"), (command, dest)
            if rule.kind in ("same", "pending") and rule.field in fields:
                assert rule.field in fields


HERE = os.path.dirname(os.path.abspath(__file__))  # any existing folder stands in for a model folder


def _cases(data: str) -> list[tuple[type, dict]]:
    """One config per rule, in the table's order: the field set to a valid non-default value where it does nothing."""
    P, G = PPOConfig, GRPOConfig
    place = {"placement": {"actor": "0", "rollout": "0"}}
    no_kl = {"init_kl_coef": 0.0}
    prompts = {"prompt_data": data, "input_key": "prompt"}
    off = {"enable_vllm_is_correction": False}
    return [
        (P, {"vllm_gpu_memory_utilization": 0.3}),
        (P, {"enforce_eager": True}),
        (P, {"enable_prefix_caching": True}),
        (P, {"weight_sync": "ipc", "vllm_sync_backend": "gloo"}),
        (P, {**place, "colocate_all_models": False}),
        (P, {"colocate_actor_ref": True}),
        (P, {**place, "colocate_actor_ref": True}),
        (P, {**no_kl, "colocate_all_models": False, "colocate_actor_ref": True}),
        (P, {"colocate_critic_reward": True}),
        (P, {**place, "colocate_critic_reward": True}),
        (G, {"critic_pretrain": HERE}),
        (G, {"critic_learning_rate": 1e-5}),
        (G, {"lambd": 0.9}),
        (G, {"value_clip": 0.3}),
        (G, {"critic_num_nodes": 2}),
        (G, {"critic_num_gpus_per_node": 2}),
        (G, {"colocate_all_models": False, "colocate_critic_reward": True}),
        (P, {**no_kl, "kl_target": 0.1}),
        (P, {**no_kl, "kl_horizon": 5000}),
        (P, {**no_kl, "kl_estimator": "k2"}),
        (G, {**no_kl, "use_kl_loss": False}),
        (P, {**no_kl, "ref_num_nodes": 2}),
        (P, {**no_kl, "ref_num_gpus_per_node": 2}),
        (P, {"kl_horizon": 5000}),
        (P, {"reward_num_nodes": 2}),
        (P, {"reward_num_gpus_per_node": 2}),
        (G, {"lora_alpha": 32}),
        (G, {"lora_dropout": 0.1}),
        (G, {"lora_target_modules": "q_proj"}),
        (G, {"lora_sync": "merged"}),
        (G, {"lora_rank": 4, "ref_num_nodes": 2}),  # under LoRA the reference is the actor's base
        (G, {"lora_rank": 4, "ref_num_gpus_per_node": 2}),
        (G, {"lora_rank": 4, "colocate_all_models": False, "colocate_actor_ref": True}),
        (G, {"distill_coef": 0.5}),
        (G, {"distill_task_coef": 0.0}),
        (P, {"eps_clip": 0.3, "eps_clip_low_high": (0.2, 0.28)}),
        (G, {"policy_loss_type": "gspo", "dual_clip": 3.0}),
        (P, {"min_lr_ratio": 0.2}),
        (P, {**off, "vllm_is_truncated_threshold": (0.5, 5.0)}),
        (P, {**off, "use_icepop": True}),
        (P, {**off, "vllm_is_correction_type": "icepop"}),
        (P, {"async_max_staleness": 2}),
        (P, {"partial_rollout": True}),
        (P, {"mps_engine_share": 60}),
        (P, {"train_max_tokens_per_gpu": 4096}),
        (P, {"rollout_max_tokens_per_gpu": 4096}),
        (P, {"overlong_penalty_factor": 0.5}),
        (G, {"dynamic_filtering_reward_range": (0.0, 1.0)}),
        (G, {"dynamic_filtering_max_rounds": 4}),
        (P, {"max_turns": 3}),
        (P, {"max_new_tokens_per_turn": 4}),
        (P, {"agent_timeout_s": 30.0}),
        (P, {"agent_on_error": "end_sample"}),
        (P, {**prompts, "task": "add"}),
        (P, {**prompts, "task_length": 3}),
        (P, {"prompt_split": "test"}),
        (P, {"prompt_data_probs": "1"}),
        (P, {"input_key": "question"}),
        (P, {"label_key": "answer"}),
        (P, {"input_template": "Q: {}"}),
        (P, {"eval_steps": 5}),
        (P, {"eval_split": "test"}),
        (P, {"eval_temperature": 1.0}),
        (P, {"eval_n_samples_per_prompt": 2}),
        (P, {"eval_pass_threshold": 0.5}),
        (P, {**prompts, "apply_chat_template": True, "input_template": "Q: {}"}),
        (P, {"wandb_project": "p"}),
        (P, {"wandb_run_name": "r"}),
    ]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    path.write_text('{"prompt": "hi"}\n')
    return str(path)


def test_every_rule_refuses_a_config_where_it_applies_and_notes_it_on_an_openrlhf_line(data):
    cases = _cases(data)
    assert len(cases) == len(inactive.RULES), "one case per rule, in the table's order"
    for rule, (cls, settings) in zip(inactive.RULES, cases):
        config = cls(**settings)
        found = [r for r, _ in inactive.findings(config)]
        assert rule.field in settings and rule in found, (rule.field, settings)
        with pytest.raises(ConfigError) as e:  # the Python API: refused
            config.validate()
        assert e.value.field == rule.field and rule.text(rule.reason, config) in e.value.problem, (settings, e.value)
        assert e.value.fix == rule.text(rule.fix, config)
        given = cls(**settings).record_given(settings)  # the CLI's record: the same when the user gave the flags
        with pytest.raises(ConfigError):
            given.validate()
        openrlhf = cls(**settings).record_given(settings, openrlhf_line=True)
        if rule.openrlhf:  # OpenRLHF ignores it too: the pasted script runs, with a note naming the flag
            notes = openrlhf.validate().inactive_notes()
            assert any(n.startswith(f"--{rule.field} has no effect here") for n in notes), notes
        else:
            with pytest.raises(ConfigError):
                openrlhf.validate()


@pytest.mark.parametrize(
    "cls, settings",
    [
        (
            PPOConfig,
            {
                "backend": "vllm",
                "vllm_gpu_memory_utilization": 0.3,
                "enforce_eager": True,
                "enable_prefix_caching": True,
                "vllm_sync_backend": "gloo",
            },
        ),
        (PPOConfig, {"critic_learning_rate": 1e-5, "lambd": 0.9, "value_clip": 0.3, "critic_pretrain": HERE}),
        (PPOConfig, {"kl_target": 0.1, "kl_horizon": 5000}),
        (PPOConfig, {"async_train": True, "async_max_staleness": 2, "partial_rollout": True}),
        (PPOConfig, {"overlong_buffer_len": 256, "overlong_penalty_factor": 0.5}),
        (GRPOConfig, {"dynamic_filtering": True, "dynamic_filtering_max_rounds": 4}),
        (PPOConfig, {"use_wandb": "True", "wandb_project": "p", "wandb_run_name": "r"}),
        (PPOConfig, {"colocate_all_models": False, "colocate_actor_ref": True}),
        (PPOConfig, {"lr_scheduler": "cosine_with_min_lr", "min_lr_ratio": 0.2}),
    ],
)
def test_the_same_settings_pass_where_they_act(cls, settings):
    config = cls(**settings)
    assert config.validate() is config and inactive.findings(config) == []


def test_only_what_the_user_set_counts():
    # The demo preset gives every algorithm the critic's rate: not a GRPO user's choice, in Python or on the CLI.
    assert GRPOConfig(**DEMO_SETTINGS).validate()
    from hybrid_cli.main import load_config

    assert load_config("grpo", [])[0].critic_learning_rate == DEMO_SETTINGS["critic_learning_rate"]
    with pytest.raises(ConfigError) as e:  # given on hybrid's own command line: refused, naming flag and fix
        load_config("grpo", ["--critic_learning_rate", "1e-5"])
    assert e.value.field == "critic_learning_rate" and "trains no critic" in e.value.problem
    with pytest.raises(ConfigError) as e:
        load_config("ppo", ["--enforce_eager"])
    assert e.value.field == "enforce_eager" and "--backend vllm" in e.value.fix
    # set to the default: changes nothing, refuses nothing
    assert load_config("ppo", ["--no_enforce_eager", "--vllm_gpu_memory_utilization", "0.5"])[0]
    # what the CLI recorded survives the program's own changes (placement demotions, dry-run budgets)
    config = PPOConfig(kl_horizon=5000).record_given(["kl_horizon"], openrlhf_line=True)
    assert config.replace(zero_stage=1).given_fields == {"kl_horizon"} and config.replace(zero_stage=1).openrlhf_line


def test_an_openrlhf_command_line_runs_with_notes_for_what_openrlhf_ignores_too():
    from hybrid_cli.main import load_config

    config, _, notes = load_config(
        "ppo",
        [  # dotted flags: an OpenRLHF >= 0.10.2 command line
            "--actor.num_gpus_per_node",
            "1",
            "--vllm.num_engines",
            "0",
            "--algo.advantage.estimator",
            "group_norm",
            "--rollout.n_samples_per_prompt",
            "2",
            "--rollout.batch_size",
            "8",
            "--train.batch_size",
            "16",
            "--train.micro_batch_size",
            "8",
            "--critic.adam.lr",
            "1e-5",
            "--vllm.enforce_eager",
        ],
    )
    assert config.backend == "hf" and config.enforce_eager and config.critic_learning_rate == 1e-5
    assert any(n.startswith("--critic_learning_rate has no effect here") for n in notes), notes
    assert any(n.startswith("--enforce_eager has no effect here") for n in notes), notes


# ---- --partial_rollout keeps every engine setting ------------------------------------------------------------------
def _session(config: RLConfig):
    plan = SimpleNamespace(shared_gpus=lambda role: [0])
    prep = SimpleNamespace(model_path="/models/m", max_model_len=256, plan=plan)
    stand_in = SimpleNamespace(settings=config.settings(), prep=prep)
    stand_in.seeded_sampling = lambda: TrainingSession.seeded_sampling(stand_in)
    return stand_in


ENGINE_SETTINGS = dict(
    vllm_gpu_memory_utilization=0.3,
    enforce_eager=True,
    enable_prefix_caching=True,
    bf16=True,
    vllm_tensor_parallel_size=2,
    seed=7,
)


@pytest.mark.parametrize("backend", ["vllm", "sglang", "hf"])
def test_partial_rollout_keeps_every_engine_setting(backend):
    from hybrid_algos.train.placement import workload

    settings = ENGINE_SETTINGS if backend != "hf" else {"bf16": True, "seed": 7}
    plain = GRPOConfig(backend=backend, **settings)
    partial = GRPOConfig(backend=backend, async_train=True, partial_rollout=True, **settings)
    without = TrainingSession._engine_kwargs(_session(plain))
    with_partial = TrainingSession._engine_kwargs(_session(partial))
    if backend == "hf":  # the built-in engine pauses whatever it was built with: nothing to add
        assert (
            with_partial
            == without
            == {"model": "/models/m", "seed": 7, "trust_remote_code": False, "dtype": "bfloat16"}
        )
        return
    assert with_partial == {**without, "pausable": True}
    assert (
        without["gpu_memory_utilization"] == 0.3 == workload(partial.settings(), 16, 16).engine_memory_fraction
    )  # as planned
    assert (
        without["enforce_eager"],
        without["enable_prefix_caching"],
        without["dtype"],
        without["max_model_len"],
        without["tensor_parallel_size"],
        without["enable_sleep_mode"],
    ) == (True, True, "bfloat16", 256, 2, True)
