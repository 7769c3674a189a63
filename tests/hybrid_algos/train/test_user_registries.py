"""``--plugins``: a loss, an advantage estimator and an environment of the user's own reach the processes that use them.

The registries live per process and the policy loss is looked up inside the actor's Ray worker, so the user's files
are imported on the driver at config time (a bad file or name is a ConfigError before Ray starts) and again in every
role worker; a loss registered in the driver's own process (a user's script) reaches the workers too. The unit tests
check the loader's refusals; one short real run (`hybrid grpo`, local Ray, the tiny model on CPU) checks where each
part ran and that the user's loss is the one that made the update.
"""

import importlib.util
import json
import os
import pickle
import sys

import pytest
import torch

import hybrid_algos.advantages as adv_module
import hybrid_algos.policy_loss as loss_module
import hybrid_core.runtime_env as runtime_env
from hybrid_algos.errors import AlgoInputError
from hybrid_algos.train import GRPOConfig, plugins
from hybrid_core.errors import ConfigError

# The user's file: a loss that moves nothing, an estimator giving every response token advantage 1 (so PPO's own
# loss would move the weights), and an environment. Each leaves a marker with the pid of the process it ran in.
USER_FILE = '''
import os

from hybrid_algos import register_advantage_estimator, register_policy_loss

HERE = os.path.dirname(os.path.abspath(__file__))


def mark(what):
    open(os.path.join(HERE, "%s-%d" % (what, os.getpid())), "w").close()


@register_policy_loss("user_zero", uses=())
def user_zero(inputs):
    """Zero per-token loss: the update moves nothing."""
    mark("loss")
    return inputs.logprobs * 0.0, {}


@register_advantage_estimator("user_ones", requires=("scores",))
def user_ones(inputs):
    mark("estimator")
    ones = inputs.response_mask.float()
    return ones, ones


class Echo:
    def reset(self, prompt, label):
        return None

    def step(self, action):
        mark("env")
        return "", 1.0, True
'''

# A module of the user's driver script (imported there, not named by --plugins) registering a loss of its own.
DRIVER_FILE = '''
import os

from hybrid_algos import register_policy_loss

open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "driver-import-%d" % os.getpid()), "w").close()


@register_policy_loss("driver_side_loss", uses=())
def driver_side_loss(inputs):
    """Registered in the driver's process only."""
    return -inputs.advantages * inputs.ratio(), {}
'''


@pytest.fixture
def isolated(monkeypatch):
    """The registries, the workers' environment and sys.modules as they were before the test."""
    for module in (loss_module, adv_module):
        monkeypatch.setattr(module, "_REGISTRY", dict(module._REGISTRY))
        monkeypatch.setattr(module, "_ALIASES", dict(module._ALIASES))
    monkeypatch.setattr(runtime_env, "_extra", dict(runtime_env._extra))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.startswith((plugins._FILE_PREFIX, "hybrid_agent_", "user_driver_")):
            del sys.modules[name]


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _worker_list():
    raw = runtime_env.worker_env_vars().get(plugins.ENV)
    return json.loads(raw) if raw else []


# ---- the loader -----------------------------------------------------------------------------------------------------
def test_bad_plugins_are_config_errors_naming_the_fix(tmp_path, isolated):
    with pytest.raises(ConfigError) as e:
        GRPOConfig(plugins=str(tmp_path / "missing.py")).validate()
    assert e.value.field == "plugins" and "missing.py" in e.value.problem and "--plugins my_losses.py" in e.value.fix
    with pytest.raises(ConfigError) as e:
        GRPOConfig(plugins="no_such_package.losses").validate()
    assert e.value.field == "plugins" and "cannot find module 'no_such_package.losses'" in e.value.problem
    broken = _write(tmp_path, "broken.py", "import os\n\nraise RuntimeError('half-written')\n")
    with pytest.raises(ConfigError) as e:
        GRPOConfig(plugins=broken).validate()
    assert "RuntimeError: half-written" in e.value.problem and "broken.py:3" in e.value.problem

    user = _write(tmp_path, "user.py", USER_FILE)
    with pytest.raises(ConfigError) as e:  # a typo of the user's own loss: the known names include it
        GRPOConfig(plugins=user, policy_loss_type="user_zro").validate()
    assert e.value.field == "policy_loss_type" and "user_zero" in e.value.problem and "--plugins" in e.value.fix
    with pytest.raises(ConfigError) as e:
        GRPOConfig(plugins=user, advantage_estimator="user_one").validate()
    assert e.value.field == "advantage_estimator" and "user_ones" in e.value.fix
    # Both found, and named in the list the workers import; validating again imports nothing twice.
    GRPOConfig(plugins=user, policy_loss_type="user_zero", advantage_estimator="user_ones").validate()
    GRPOConfig(plugins=user, policy_loss_type="user_zero", advantage_estimator="user_ones").validate()
    assert _worker_list() == [[plugins.module_name(user), user, False]]
    # What this process has registered is what the workers get: a later run here without --plugins too.
    GRPOConfig().validate()
    assert _worker_list() == [[plugins.module_name(user), user, False]]


def test_the_same_file_as_plugin_and_environment_registers_once(tmp_path, isolated):
    from hybrid_algos.train.agents import load_agent

    user = _write(tmp_path, "user.py", USER_FILE)
    GRPOConfig(plugins=user, policy_loss_type="user_zero").validate()
    spec = load_agent(f"{user}:Echo")  # runs the file again, under another module name: no "already registered"
    assert spec.kind == "environment" and spec.factory.__name__ == "Echo"
    from hybrid_algos import register_policy_loss

    with pytest.raises(AlgoInputError, match="already registered"):  # another function under a taken name still clashes
        register_policy_loss("user_zero")(lambda inputs: (inputs.logprobs, {}))


def test_a_loss_registered_without_a_file_is_refused(isolated):
    import types

    from hybrid_algos import register_policy_loss

    def typed_in(inputs):
        return inputs.logprobs * 0.0, {}

    typed_in.__module__ = "__console__"  # as in an interactive session: no file a worker could import
    sys.modules["__console__"] = types.ModuleType("__console__")
    try:
        register_policy_loss("typed_in", uses=())(typed_in)
        with pytest.raises(ConfigError) as e:
            GRPOConfig(policy_loss_type="typed_in").validate()
    finally:
        del sys.modules["__console__"]
    assert e.value.field == "plugins" and "'typed_in'" in e.value.problem and "--plugins FILE.py" in e.value.fix


def test_a_worker_without_the_file_says_where_and_what_to_do(tmp_path):
    gone = str(tmp_path / "gone.py")
    environ = {plugins.ENV: json.dumps([[plugins.module_name(gone), gone, False]])}
    with pytest.raises(ConfigError) as e:
        plugins.import_in_worker("actor rank 0", environ)
    assert "actor rank 0" in e.value.problem and "gone.py" in e.value.problem and "every node" in e.value.fix
    back = pickle.loads(pickle.dumps(e.value))  # as Ray carries it from the worker to the driver: whole
    assert isinstance(back, ConfigError) and str(back) == str(e.value)
    assert plugins.import_in_worker("actor rank 0", {}) == []


# ---- one real run ---------------------------------------------------------------------------------------------------
SMALL = [
    "--task_length",
    "1",
    "--rollout_batch_size",
    "4",
    "--n_samples_per_prompt",
    "2",
    "--train_batch_size",
    "8",
    "--micro_train_batch_size",
    "8",
    "--seed",
    "7",
    "--max_steps",
    "2",
    "--init_kl_coef",
    "0",
    "--generate_max_len",
    "4",
    "--no_use_tensorboard",
    "--no_final_checkpoint",
]


def _tensors(folder):
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, name)))
    return out


def _pids(tmp_path, what):
    return {int(p.name.rsplit("-", 1)[1]) for p in tmp_path.glob(f"{what}-*")}


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_user_loss_estimator_and_environment_run_where_they_belong(tmp_path, isolated):
    from hybrid_algos.train.deepspeed_ops import ensure_cpu_ops_built
    from hybrid_cli.main import main

    ensure_cpu_ops_built()  # a fresh clone compiles DeepSpeed's CPU ops once: not this test's subject
    user = _write(tmp_path, "user.py", USER_FILE)
    driver = _write(tmp_path, "driver_side.py", DRIVER_FILE)
    spec = importlib.util.spec_from_file_location("user_driver_side", driver)  # the user's script imports it
    sys.modules["user_driver_side"] = module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    run = tmp_path / "run"
    assert (
        main(
            [
                "grpo",
                "--save_path",
                str(run),
                "--plugins",
                user,
                "--policy_loss_type",
                "user_zero",
                "--advantage_estimator",
                "user_ones",
                "--agent_func_path",
                f"{user}:Echo",
                *SMALL,
            ]
        )
        == 0
    )

    here = os.getpid()
    workers = _pids(tmp_path, "loss")
    assert workers and here not in workers  # the loss ran in the actor's Ray worker, found there by name
    assert _pids(tmp_path, "estimator") == {here} and _pids(tmp_path, "env") == {here}  # both run on the driver
    assert workers <= _pids(tmp_path, "driver-import")  # the driver's own registration was imported there too
    with open(run / "metrics.jsonl") as f:
        history = [json.loads(line) for line in f]
    assert len(history) == 2
    for m in history:
        assert m["actor/pg_loss"] == 0.0 and m["reward"] == 1.0  # the user's loss; the environment's reward
        assert m["advantage_mean"] == 1.0 and m["advantage_std"] == 0.0  # the user's estimator
    # Advantage 1 on every token would move the weights under PPO's loss; under the user's zero loss nothing moved.
    start, end = _tensors(run / "tiny-model"), _tensors(run / "final")
    assert start.keys() == end.keys() and start
    assert all(torch.equal(start[k], end[k].to(start[k].dtype)) for k in start)
