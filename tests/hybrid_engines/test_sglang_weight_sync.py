"""The split (broadcast) and colocated (IPC) weight sync into the SGLang adapter, driven end to end on CPU.

Real parts: a local Ray cluster, the training loop's driver (``WeightSync``) choosing the path from a placement plan,
a trainer actor with a tiny transformers model sending through the engine's own transport (``SGLangTransport``, as
the loop asks ``SGLangEngine.weight_transport()``), the SGLang adapter in an engine actor, a gloo group built the way
SGLang builds it, and shared-memory buckets. Stand-in: ``sglang.Engine`` itself (SGLang cannot start on a CPU);
``sglang_standin.WireEngine`` receives by SGLang's written contract, with SGLang's own functions when it is
installed. The adapter runs once per SGLang calling protocol (0.5.23 sessions, 0.5.16 without).
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import ray
import sglang_standin
import torch
from transformers import LlamaConfig

from hybrid_core.placement import PlacementSpec
from hybrid_engines.ray_engines import EngineActor, EngineGroup
from hybrid_engines.weight_sync import SyncSettings, TrainerWeightSource, WeightSync, choose_sync
from timing_bounds import HANG_S

CONFIG = LlamaConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    torch_dtype="bfloat16",
)
TIMEOUT = 120.0


class TinyTrainer(TrainerWeightSource):
    """The trainer's rank 0: a tiny Llama in bfloat16 (odd-sized float32 norms and bf16 matrices interleave, so the
    SGLang bucket cut for alignment is exercised)."""

    def __init__(self, seed: int):
        from transformers import LlamaForCausalLM

        torch.manual_seed(seed)
        self.model = LlamaForCausalLM(CONFIG).to(torch.bfloat16)
        self.model.model.norm.weight.data = self.model.model.norm.weight.data.float()  # a float32 among bf16
        self.rank, self.device = 0, torch.device("cpu")

    def named_weights(self):
        for name, p in self.model.named_parameters():
            yield name, p.data

    def weight_metas(self):
        from hybrid_core.weight_sync import TensorMeta

        return [TensorMeta.of(n, p) for n, p in self.model.named_parameters()]

    def weights(self):
        return {n: p.data.clone() for n, p in self.model.named_parameters()}

    def perturb(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for p in self.model.parameters():
            p.data.add_(torch.randn(p.shape, generator=g).to(p.dtype))

    def where(self):
        return {"node_ip": "127.0.0.1"}

    @staticmethod
    def free_port(host: str = "127.0.0.1") -> int:
        import socket

        with socket.socket() as s:
            s.bind((host, 0))
            return s.getsockname()[1]


class StandInSGLangActor(EngineActor):
    """The engine actor with the real SGLang adapter over the stand-in ``sglang.Engine``."""

    def __init__(self, version: str):
        sglang_standin.install(version)
        from hybrid_engines.sglang_engine import SGLangEngine

        self.role, self.rank, self.backend = "rollout", 0, "sglang"
        self.engine = SGLangEngine("/nonexistent/model", deterministic=False)

    def received(self):
        return dict(self.engine.engine.weights), list(self.engine.engine.calls)


@pytest.fixture(scope="module")
def cluster():
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False)  # never a foreign cluster
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.cloudpickle.register_pickle_by_value(sglang_standin)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def trainer(cluster):
    return ray.remote(TinyTrainer).remote(seed=1)  # shared by the tests: its group is closed and made anew by each


def plan(colocated: bool):
    if colocated:
        return PlacementSpec.from_ranges({"actor": "0", "rollout": "0"}).plan()
    return PlacementSpec.from_ranges({"actor": "0", "rollout": "1"}).plan()


@pytest.mark.parametrize("version", ["0.5.23", "0.5.16"])
@pytest.mark.parametrize("colocated", [False, True], ids=["split-broadcast", "colocated-ipc"])
def test_sglang_engine_gets_the_trainers_weights_through_its_own_transport(trainer, colocated, version):
    layout = plan(colocated)
    mode = choose_sync(SyncSettings(group_backend="gloo"), "sglang", layout).mode
    assert mode == ("ipc" if colocated else "broadcast")
    engine = ray.remote(StandInSGLangActor).remote(version)
    engines = EngineGroup("rollout", "sglang", [engine], [1], TIMEOUT)
    sync = WeightSync(
        mode, SimpleNamespace(workers=[trainer]), engines, layout, bucket_bytes=4096, backend="gloo", timeout_s=TIMEOUT
    )
    try:
        sync.setup()
        for round_ in range(2):  # the second sync re-uses the group / buffers, with new weights
            stats = sync.sync(wake_engines=False)
            want = ray.get(trainer.weights.remote(), timeout=TIMEOUT)
            got, calls = ray.get(engine.received.remote(), timeout=TIMEOUT)
            assert set(got) == set(want)
            for name, tensor in want.items():
                assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
            assert stats.bytes == sum(t.numel() * t.element_size() for t in want.values())
            ray.get(trainer.perturb.remote(round_), timeout=TIMEOUT)
        loads = [c for c in calls if c in ("update_weights_from_distributed", "update_weights_from_tensor")]
        assert len(loads) > 4 and calls.count("flush_cache") >= 2  # several buckets per sync, one flush per sync
        assert calls[0] == ("init_weights_update_group" if not colocated else loads[0])
    finally:
        sync.close()
        engines.shutdown(timeout_s=30)


def test_the_trainers_side_of_sglangs_group_has_a_deadline():
    """No engine joins: the trainer's rank 0 gets RemoteTimeout naming the group, not a hang."""
    import time

    from hybrid_core.errors import RemoteTimeout
    from hybrid_engines.weight_sync.sglang import sglang_trainer_group

    start = time.monotonic()
    with pytest.raises(RemoteTimeout, match="SGLang weight-update group 'lonely'"):
        sglang_trainer_group("127.0.0.1", TinyTrainer.free_port(), 2, group_name="lonely", backend="gloo", timeout_s=2)
    assert time.monotonic() - start < HANG_S  # the 2 s deadline fired (above); this only catches a hang
