"""What the loop asks of its engines: each adapter's ``engine_kwargs(settings, plan)`` (the loop names no engine),
and SGLang runs its (slower) deterministic mode only when the loop seeds samples.

An SGLang engine in deterministic mode without per-sample seeds is where the n samples of a prompt came out equal on
the GPU (2026-11-24); the adapter now seeds those rows itself, and the loop no longer asks for that mode unless
``--seeded_sampling`` does.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hybrid_algos.train.config import GRPOConfig
from hybrid_algos.train.loop import TrainingSession
from hybrid_engines.adapter import EnginePlan
from hybrid_engines.registry import engine_spec


def session(**overrides):
    config = GRPOConfig(**overrides)
    plan = SimpleNamespace(shared_gpus=lambda role: [0])
    prep = SimpleNamespace(model_path="/models/m", max_model_len=256, plan=plan)
    stand_in = SimpleNamespace(settings=config.settings(), prep=prep)
    stand_in.seeded_sampling = lambda: TrainingSession.seeded_sampling(stand_in)
    return stand_in


@pytest.mark.parametrize("flag, deterministic", [(None, False), (True, True), (False, False)])
def test_sglang_is_deterministic_only_when_samples_are_seeded(flag, deterministic):
    s = session(backend="sglang", seeded_sampling=flag)
    kwargs = TrainingSession._engine_kwargs(s)
    assert kwargs["deterministic"] is deterministic
    assert (TrainingSession.sampling(_with_tokenizer(s), 3).seed is not None) is deterministic


@pytest.mark.parametrize("backend, seeded", [("hf", True), ("vllm", False)])
def test_other_engines_get_no_deterministic_flag(backend, seeded):
    s = session(backend=backend)
    assert "deterministic" not in TrainingSession._engine_kwargs(s)
    assert TrainingSession.seeded_sampling(s) is seeded


def _with_tokenizer(s):
    s.prep.tokenizer = SimpleNamespace(eos_token_id=2)
    s.prep.max_new_tokens = 8
    return s


POOLED = {
    "model": "/models/m",
    "seed": 7,
    "trust_remote_code": False,
    "tensor_parallel_size": 2,
    "gpu_memory_utilization": 0.3,
    "enforce_eager": True,
    "enable_prefix_caching": False,
    "dtype": "bfloat16",
    "max_model_len": 256,
    "enable_sleep_mode": True,
}


@pytest.mark.parametrize(
    "backend, expected",
    [
        ("hf", {"model": "/models/m", "seed": 7, "trust_remote_code": False, "dtype": "bfloat16"}),
        ("vllm", POOLED),
        ("sglang", {**POOLED, "deterministic": False}),
    ],
)
def test_each_adapter_builds_its_engines_kwargs(backend, expected):
    settings = (
        dict(
            vllm_gpu_memory_utilization=0.3,
            enforce_eager=True,
            enable_prefix_caching=False,
            vllm_tensor_parallel_size=2,
        )
        if backend != "hf"
        else {}
    )
    config = GRPOConfig(backend=backend, bf16=True, seed=7, **settings)
    plan = EnginePlan(
        model_path="/models/m",
        max_model_len=256,
        shares_gpus=True,
        seeded_sampling=backend == "hf",
        partial_rollout=False,
    )
    assert engine_spec(backend).engine_kwargs(config.engine_settings(), plan) == expected
    assert TrainingSession._engine_kwargs(session(backend=backend, bf16=True, seed=7, **settings)) == expected


def test_vllm_budgets_the_images_a_prompt_may_hold():
    settings = GRPOConfig(backend="vllm").settings().engine
    text = engine_spec("vllm").engine_kwargs(settings, EnginePlan(model_path="/m"))
    assert "limit_mm_per_prompt" not in text  # a text run leaves vLLM's default
    images = engine_spec("vllm").engine_kwargs(settings, EnginePlan(model_path="/m", max_images_per_prompt=3))
    assert images["limit_mm_per_prompt"] == {"image": 3}
    s = session(backend="vllm", max_images_per_prompt=2, pretrain="/models/m")
    assert TrainingSession._engine_kwargs(s)["limit_mm_per_prompt"] == {"image": 2}
