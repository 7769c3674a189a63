"""Engines as Ray actors on a placed plan: a real local Ray cluster with fake GPUs, two built-in engines sharing
their GPUs with an actor role, a real gloo weight-sync group with this test process as the trainer (rank 0)."""

from __future__ import annotations

import os
import socket

import pytest
import ray
import torch
from transformers import LlamaConfig

from hybrid_core.cluster import gpus_hidden_as_fakes
from hybrid_core.errors import ConfigError, RemoteTimeout, RoleFailure
from hybrid_core.placement import PlacementSpec, place
from hybrid_core.weight_sync import TensorMeta, WeightSender, create_sync_group
from hybrid_engines import SamplingParams
from hybrid_engines.hf_engine import HFEngine
from hybrid_engines.ray_engines import (
    cuda_visibility,
    engine_placement,
    engine_threads,
    launch_engines,
    local_device_index,
    split_prompts,
)

CONFIG = LlamaConfig(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.2,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
PROMPTS = [[5, 17, 3], [40, 2, 9, 11], [88], [5, 17, 3], [12, 30, 31, 4, 6], [7, 7], [60, 61, 62]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10)
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=10, n=2, seed=21)
TIMEOUT = 120.0


def ids(outputs):
    return [[o.token_ids for o in per_prompt] for per_prompt in outputs]


NODE_VIEW: dict[str, str | None] = {}  # the node's CUDA_VISIBLE_DEVICES when it started


@pytest.fixture(scope="module")
def cluster():
    with gpus_hidden_as_fakes(4):  # GPUs hidden for a CPU run: Ray refuses fakes otherwise
        ray.init(address="local", num_gpus=4, num_cpus=4, include_dashboard=False, log_to_driver=False)
        NODE_VIEW["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES")  # what the node's workers inherit
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def placed(cluster):
    spec = PlacementSpec.from_ranges({"actor": "0-1", "rollout": "0-1"})
    with place(spec.plan(), timeout_s=60) as p:
        yield p


@pytest.fixture(scope="module")
def engines(placed):
    # NOSET as users set it for DeepSpeed / CUDA IPC: Ray then leaves CUDA_VISIBLE_DEVICES alone
    group = launch_engines(
        placed,
        "rollout",
        backend="hf",
        engine_kwargs={"model": CONFIG, "seed": 0},
        timeout_s=TIMEOUT,
        env_vars={"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"},
    )
    yield group
    group.shutdown()


@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(1)
    return HFEngine(CONFIG, seed=0, device="cpu")  # the same seeded random weights as every engine


def test_each_engine_runs_on_the_gpu_its_plan_slot_names(engines, placed):
    assert engines.num_engines == 2 and engines.num_workers == 2 and engines.rank_offsets() == [1, 2]
    where = engines.call("where")
    for rank, info in enumerate(where):
        slot = placed.worker("rollout", rank)
        expected = [str(placed.device(g).gpu_id) for g in slot.gpus]
        assert info["gpu_ids"] == expected
        # under NOSET the built-in engine keeps the node-wide view (it picks cuda:<index of its GPU> itself)
        assert info["cuda_visible_devices"] == NODE_VIEW["CUDA_VISIBLE_DEVICES"]
    assert where[0]["gpu_ids"] != where[1]["gpu_ids"]


def test_generate_splits_and_gathers_in_prompt_order(engines, reference):
    assert split_prompts(PROMPTS, 2) == [[0, 1, 2, 3], [4, 5, 6]]  # the repeated prompt 0/3 stays on one engine
    for params in (GREEDY, SAMPLED):
        got = engines.generate(PROMPTS, params)
        assert [o[0].prompt_token_ids for o in got] == PROMPTS
        assert ids(got) == ids(reference.generate(PROMPTS, params))  # same samples as one engine doing it all
    assert ids(engines.generate(PROMPTS[:1], GREEDY)) == ids(reference.generate(PROMPTS[:1], GREEDY))


def test_sleep_and_wake_across_the_group(engines):
    before = ids(engines.generate(PROMPTS, SAMPLED))
    stats = engines.sleep(1)
    assert len(stats) == 2 and all(s.bytes > 0 for s in stats)
    with pytest.raises(RoleFailure, match=r"rollout engine \d: generate.*asleep"):
        engines.generate(PROMPTS, GREEDY)
    engines.wake_up(["weights"])
    engines.wake_up(["kv_cache"])
    assert ids(engines.generate(PROMPTS, SAMPLED)) == before


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_weight_update_from_the_trainer_reaches_every_engine(engines):
    new = HFEngine(CONFIG, seed=77, device="cpu")
    assert ids(engines.generate(PROMPTS, GREEDY)) != ids(new.generate(PROMPTS, GREEDY))
    port = free_port()
    joins = engines.init_weight_update_group("127.0.0.1", port, backend="gloo", timeout_s=60)
    trainer = create_sync_group("127.0.0.1", port, 0, 1 + engines.num_workers, backend="gloo", timeout_s=60)
    try:
        engines.wait(joins, "init_weight_update_group")
        named = list(new.model.named_parameters())
        engines.sleep(1)
        engines.wake_up(["weights"])  # a sync wakes only the weights, as the training loop does
        refs = engines.update_weights([TensorMeta.of(n, t) for n, t in named], bucket_bytes=8192)
        sent = WeightSender(trainer, 8192).send(named)
        received = engines.wait(refs, "update_weights")
        assert [r.bytes for r in received] == [sent.bytes] * 2
        engines.reset_prefix_cache()
        engines.wake_up(["kv_cache"])
        assert ids(engines.generate(PROMPTS, GREEDY)) == ids(new.generate(PROMPTS, GREEDY))
        assert ids(engines.generate(PROMPTS, SAMPLED)) == ids(new.generate(PROMPTS, SAMPLED))
    finally:
        trainer.close()


def test_a_late_engine_call_raises_a_timeout_naming_the_engine(engines):
    long = SamplingParams(temperature=1.0, max_new_tokens=100, n=4, seed=1)  # ~0.5 s of work per engine
    with pytest.raises(RemoteTimeout, match=r"rollout engine [01]: generate"):
        engines.generate(PROMPTS * 2, long, timeout_s=0.05)


def test_tensor_parallel_engines_get_their_bundles_and_split_the_fraction(cluster):
    spec = PlacementSpec.from_ranges({"actor": "0-1", "rollout": "0-1"}, tp={"rollout": 2})
    with place(spec.plan(), timeout_s=60) as tp_placed:
        options, extra = engine_placement(tp_placed, "rollout", 0, accepts={"model", "gpus_per_worker"})
        slot = tp_placed.worker("rollout", 0)
        assert extra["bundle_indices"] == tp_placed.bundle_indices("rollout", 0) and len(extra["bundle_indices"]) == 2
        assert extra["placement_group"] is tp_placed.placement_group
        assert options["num_gpus"] == extra["gpus_per_worker"] == slot.num_gpus / 2
        assert options["scheduling_strategy"].placement_group_capture_child_tasks
        assert "gpus_per_worker" not in engine_placement(tp_placed, "rollout", 0, accepts={"model"})[1]

        # Ray accepts the actor on the first bundle, beside the actor role's worker on the same GPU
        def gpu_ids():  # defined here so Ray ships it by value (workers cannot import test modules)
            return [str(g) for g in ray.get_gpu_ids()]

        probe = ray.remote(gpu_ids).options(**{**options, "num_cpus": 0}).remote()
        assert ray.get(probe, timeout=60) == [str(tp_placed.device(slot.gpus[0]).gpu_id)]
        with pytest.raises(ConfigError, match="built-in engine runs on one GPU"):
            launch_engines(tp_placed, "rollout", backend="hf", engine_kwargs={"model": CONFIG})
    with pytest.raises(ConfigError) as e:
        launch_engines(tp_placed, "critic", backend="hf")
    assert e.value.field == "role"


def test_cuda_visibility_rule():
    assert cuda_visibility("hf", 1, False, ["3"]) == ("keep", None)
    assert cuda_visibility("hf", 1, True, ["3"]) == ("keep", None)  # the engine picks cuda:<index of GPU 3>
    assert cuda_visibility("vllm", 1, False, ["3"]) == ("keep", None)  # Ray already narrowed it to GPU 3
    assert cuda_visibility("vllm", 1, True, ["3"]) == ("set", "3")
    assert cuda_visibility("sglang", 1, True, ["3"]) == ("set", "3")
    assert cuda_visibility("vllm", 2, True, ["3"]) == ("unset", None)
    assert cuda_visibility("vllm", 4, False, ["3"]) == ("unset", None)
    assert local_device_index("3", None) == 3
    assert local_device_index("3", "2,3") == 1
    assert local_device_index(5, "") == 5


def test_engine_threads_rule():
    # a GPU engine takes its GPU's share of the node's cores (the roles on it take turns), at most 8
    assert engine_threads("vllm", 16, 1) == 8 and engine_threads("sglang", 16, 8) == 2
    assert engine_threads("vllm", 2, 4) == 1 and engine_threads("vllm", 6, 0) == 6
    assert engine_threads("hf", 16, 1) is None  # the built-in engine keeps Ray's count (CPU numerics)
    assert engine_threads("hf", 16, 1, "3") == 3 and engine_threads("vllm", 16, 1, "12") == 12
    for bad in ("0", "two", "-1"):
        with pytest.raises(ConfigError, match="HYBRID_ENGINE_THREADS"):
            engine_threads("vllm", 16, 1, bad)


def test_engine_actors_run_with_the_threads_asked_for(placed):
    group = launch_engines(
        placed,
        "rollout",
        backend="hf",
        engine_kwargs={"model": CONFIG, "seed": 0},
        timeout_s=TIMEOUT,
        env_vars={"HYBRID_ENGINE_THREADS": "3"},
    )
    try:
        assert [w["torch_threads"] for w in group.call("where")] == [3, 3]
    finally:
        group.shutdown()


def test_generate_runs_with_the_garbage_collector_paused_and_restores_it():
    import gc
    import threading

    from hybrid_engines.ray_engines import EngineActor, GcPause

    seen = []

    class Recorder:  # what the engine sees of the collector during the actor's generate
        def generate(self, prompts, params):
            seen.append(gc.isenabled())
            return [[None]]

    actor = object.__new__(EngineActor)  # the actor's own wrapper, without starting an engine
    actor.role, actor.rank, actor.engine, actor._gc_pause = "rollout", 0, Recorder(), GcPause()
    assert gc.isenabled()
    actor.generate([[1]], SamplingParams())
    assert seen == [False] and gc.isenabled()

    pause, inside, release = GcPause(), threading.Event(), threading.Event()

    def long_call():
        with pause:
            inside.set()
            release.wait(5)

    t = threading.Thread(target=long_call)
    t.start()
    inside.wait(5)
    with pause:  # a second, shorter call (partial rollouts): the first keeps the collector off after it returns
        pass
    assert not gc.isenabled()
    release.set()
    t.join(5)
    assert gc.isenabled()
    gc.disable()  # a process that had it off keeps it off
    try:
        with pause:
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
