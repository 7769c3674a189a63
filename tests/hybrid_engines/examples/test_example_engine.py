"""Adding an engine is one file plus one registry line: fp32_engine.py, registered here with ``register_engine``, is
a ``--backend`` choice that the config validates with the adapter's own checks and the training loop builds from
the adapter's ``engine_kwargs`` (a real config, a real placement plan, the loop's own construction function, and a
real engine built from its answer; no Ray needed for the construction path)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from hybrid_algos.train.config import GRPOConfig
from hybrid_algos.train.loop import TrainingSession
from hybrid_algos.train.placement import build_plan
from hybrid_core import runtime_env
from hybrid_core.errors import ConfigError
from hybrid_engines import registry
from hybrid_engines.protocol import SamplingParams


@pytest.fixture
def registered(monkeypatch):
    """The registry and the workers' environment as they were, after the test."""
    monkeypatch.setattr(registry, "BACKENDS", dict(registry.BACKENDS))
    monkeypatch.setattr(runtime_env, "_extra", dict(runtime_env._extra))
    registry.register_engine("hf-fp32", "fp32_engine:Fp32HFEngine")  # the one registry line
    return "hf-fp32"


def session(config, model_path):
    """What TrainingSession._engine_kwargs reads of a started session: the settings and the prepared run."""
    prep = SimpleNamespace(model_path=model_path, max_model_len=64, plan=build_plan(config))
    stand_in = SimpleNamespace(settings=config.settings(), prep=prep)
    stand_in.seeded_sampling = lambda: TrainingSession.seeded_sampling(stand_in)
    return stand_in


def test_the_loop_builds_the_registered_engine_from_its_adapter(registered, tmp_path):
    from fp32_engine import Fp32HFEngine

    from hybrid_algos.train.tiny import save_tiny_model

    config = GRPOConfig(backend=registered, bf16=True, seed=3).validate()  # a --backend choice now
    folder = save_tiny_model(str(tmp_path / "tiny"))
    kwargs = TrainingSession._engine_kwargs(session(config, folder))
    # the adapter's answer, not the built-in engine's (which would say bfloat16 and no batch bound)
    assert kwargs == {"model": folder, "seed": 3, "trust_remote_code": False, "dtype": "float32", "max_batch_size": 8}
    assert TrainingSession.seeded_sampling(session(config, folder)) is True  # inherited CHEAP_SEEDED_SAMPLING
    engine = registry.make_engine(registered, device="cpu", **kwargs)  # what each engine actor does with them
    try:
        assert type(engine) is Fp32HFEngine and engine.max_batch_size == 8
        assert next(engine.model.parameters()).dtype == torch.float32
        out = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3, seed=0, n=2))
        assert len(out[0]) == 2 and all(1 <= len(o.token_ids) <= 3 for o in out[0])
    finally:
        engine.shutdown()


def test_the_config_checks_a_registered_engine_with_its_adapter(registered):
    # the built-in engine's refusal, inherited by the adapter, reached through the registry (no name in config.py)
    with pytest.raises(ConfigError, match="vllm_tensor_parallel_size"):
        GRPOConfig(backend=registered, vllm_tensor_parallel_size=2).validate()
    with pytest.raises(ConfigError, match="backend"):
        GRPOConfig(backend="hf-fp64").validate()  # not registered: still an unknown backend


def test_engine_actors_see_the_driver_registration(registered, monkeypatch):
    # an engine actor is a process of its own: it finds the backend in the environment the driver gives workers
    env = runtime_env.worker_env_vars({})
    assert json.loads(env[registry.ENV]) == {registered: ["fp32_engine", "Fp32HFEngine", None, None]}
    monkeypatch.setattr(registry, "BACKENDS", {k: v for k, v in registry.BACKENDS.items() if k != registered})
    monkeypatch.setenv(registry.ENV, env[registry.ENV])
    assert registry.engine_spec(registered).__name__ == "Fp32HFEngine"


def test_registration_refuses_what_it_cannot_build(registered):
    registry.register_engine(registered, "fp32_engine:Fp32HFEngine")  # the same line again: nothing changes
    with pytest.raises(ConfigError, match="already"):
        registry.register_engine(registered, "fp32_engine:Other")
    with pytest.raises(ConfigError, match="module:Class"):
        registry.register_engine("x", "fp32_engine")
    registry.register_engine("not-an-adapter", "json:JSONDecoder")
    with pytest.raises(ConfigError, match="EngineAdapter"):
        registry.engine_spec("not-an-adapter")
