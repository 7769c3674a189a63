"""Every weight sync is verified, end to end: the training loop's driver (``WeightSync``) sends a trainer actor's
weights to the built-in engine in its own engine actor, over a gloo group (split placement) and over shared-memory
IPC buckets (colocated), on a local Ray. A bucket corrupted in flight at the engine (``HYBRID_FAULT=
receiver:bucket:corrupt:N`` in the engine actor only) ends the sync with ``WeightSyncMismatch`` naming the engine
and the parameter; a clean sync passes and the engine then holds the trainer's weights exactly. No stand-ins."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import ray
import torch
from transformers import LlamaConfig

from hybrid_core.errors import WeightSyncMismatch
from hybrid_core.placement import PlacementSpec
from hybrid_core.weight_sync import TensorMeta, plan_buckets
from hybrid_engines.ray_engines import EngineActor, EngineGroup
from hybrid_engines.weight_sync import SyncSettings, TrainerWeightSource, WeightSync, choose_sync, verify_note

CONFIG = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
BUCKET = 4096
TIMEOUT = 120.0


class TinyTrainer(TrainerWeightSource):
    """The trainer's rank 0: a tiny Llama (other weights than the engine's until synced)."""

    def __init__(self, seed: int):
        from transformers import LlamaForCausalLM

        torch.manual_seed(seed)
        self.model = LlamaForCausalLM(LlamaConfig(**CONFIG))
        self.rank, self.device = 0, torch.device("cpu")

    def named_weights(self):
        for name, p in self.model.named_parameters():
            yield name, p.data

    def weight_metas(self):
        return [TensorMeta.of(n, p) for n, p in self.model.named_parameters()]

    def weights(self):
        return {n: p.data.clone() for n, p in self.model.named_parameters()}

    def where(self):
        return {"node_ip": "127.0.0.1"}

    @staticmethod
    def free_port(host: str = "127.0.0.1") -> int:
        import socket

        with socket.socket() as s:
            s.bind((host, 0))
            return s.getsockname()[1]


class InspectableEngine(EngineActor):
    def held(self):
        return {n: p.detach().clone() for n, p in self.engine.model.named_parameters()}


@pytest.fixture(scope="module")
def cluster():
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False)  # never a foreign cluster
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def trainer(cluster):
    return ray.remote(TinyTrainer).remote(seed=1)


def layout(colocated: bool):
    return PlacementSpec.from_ranges({"actor": "0", "rollout": "0" if colocated else "1"}).plan()


def test_a_corrupted_bucket_ends_the_sync_naming_the_engine_and_parameter(trainer):
    """Both paths into one engine actor (its start-up is the slow part): split placement (broadcast), then
    colocated (IPC). The fault counts the buckets the engine's process receives, so each path's corrupted bucket
    is numbered from the buckets before it."""
    metas = ray.get(trainer.weight_metas.remote(), timeout=TIMEOUT)
    plans = {colocated: plan_buckets(metas, BUCKET, split_large=not colocated) for colocated in (False, True)}
    nth = {False: 3, True: 2 * len(plans[False]) + 2}  # 2 broadcast syncs, then the 2nd bucket of an IPC sync
    faults = ",".join(f"receiver:bucket:corrupt:{n}" for n in nth.values())
    engine = (
        ray.remote(InspectableEngine)
        .options(runtime_env={"env_vars": {"HYBRID_FAULT": faults}})
        .remote("hf", {"model": LlamaConfig(**CONFIG), "device": "cpu", "seed": 5})
    )
    engines = EngineGroup("rollout", "hf", [engine], [1], TIMEOUT)
    try:
        for colocated in (False, True):
            plan = layout(colocated)
            settings = SyncSettings(group_backend="gloo")
            mode = choose_sync(settings, "hf", plan).mode
            assert mode == ("ipc" if colocated else "broadcast")
            assert verify_note(settings, "hf") is None  # the built-in engine's syncs are all checked
            first = plans[colocated][(3 if not colocated else 2) - 1].pieces[0].meta.name
            sync = WeightSync(
                mode,
                SimpleNamespace(workers=[trainer]),
                engines,
                plan,
                bucket_bytes=BUCKET,
                backend="gloo",
                timeout_s=TIMEOUT,
            )
            try:
                sync.setup()
                with pytest.raises(WeightSyncMismatch) as caught:
                    sync.sync(wake_engines=False)
                text = str(caught.value)
                assert "rollout engine 0" in text and f"{first} " in text, text
                assert "checked in the engine's parameter" in text, text
                # the fault fired once: the next sync is clean, verified, and leaves the trainer's weights there
                sync.sync(wake_engines=False)
                want = ray.get(trainer.weights.remote(), timeout=TIMEOUT)
                got = ray.get(engine.held.remote(), timeout=TIMEOUT)
                assert all(torch.equal(got[n], t) for n, t in want.items())
            finally:
                sync.close()
    finally:
        engines.shutdown(timeout_s=30)


def test_verify_notes_say_what_is_not_checked():
    assert "not checked" in verify_note(SyncSettings(verify="off"), "hf")
    sampled = SyncSettings()
    assert "not verified" in verify_note(sampled, "sglang") and "sglang" in verify_note(sampled, "sglang")
