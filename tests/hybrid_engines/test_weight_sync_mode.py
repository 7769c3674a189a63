"""Which weight-sync path a placement gets, and whose wire format: CUDA IPC whenever the engines sit on the trainer's
GPUs (any TP size the engine's transport serves), broadcast for engines on GPUs of their own; the sender is always
the engine's own transport; never an NCCL group with two ranks on one GPU; whatever the loop cannot run is refused
before Ray starts."""

from types import SimpleNamespace

import pytest

from hybrid_core.errors import ConfigError
from hybrid_core.placement import PlacementSpec
from hybrid_engines import registry
from hybrid_engines.weight_sync import SyncSettings, WeightSync, choose_sync, describe_sync
from hybrid_engines.weight_sync.sglang import SGLangTransport
from hybrid_engines.weight_sync.transport import WeightTransport


def asked(transport="auto", group_backend="nccl"):
    return SyncSettings(transport=transport, group_backend=group_backend)


def colocated(gpus="0-1", tp=1):
    return PlacementSpec.from_ranges({"actor": gpus, "reference": gpus, "rollout": gpus}, tp={"rollout": tp}).plan()


def split(tp=1):
    rollout = "1" if tp == 1 else "1-2"
    return PlacementSpec.from_ranges({"actor": "0", "rollout": rollout}, tp={"rollout": tp}).plan()


def test_colocated_tp2_engine_goes_by_ipc_with_both_actor_ranks_together():
    plan = colocated(tp=2)
    assert choose_sync(asked(), "vllm", plan).mode == "ipc"
    sync = WeightSync("ipc", actor=None, engines=None, plan=plan, bucket_bytes=1 << 20, backend="nccl", timeout_s=5)
    assert sync.engine_for_rank == [0, 0] and sync.peers == [[0, 1], [0, 1]]


def test_colocated_tp1_engines_go_by_ipc_one_rank_each():
    plan = colocated()
    sync = WeightSync(
        choose_sync(asked(), "hf", plan).mode, None, None, plan, bucket_bytes=1 << 20, backend="gloo", timeout_s=5
    )
    assert sync.mode == "ipc" and sync.engine_for_rank == [0, 1] and sync.peers == [[0], [1]]


@pytest.mark.parametrize("backend", ["hf", "vllm", "sglang"])
def test_engines_on_their_own_gpus_go_by_broadcast_in_their_engines_format(backend):
    assert choose_sync(asked(), backend, split()).mode == "broadcast"
    line = describe_sync(asked(), backend, split())
    assert line.startswith("broadcast") and ("SGLang's weight-update group" in line) == (backend == "sglang")


def test_each_engine_class_names_its_own_transport():
    assert type(registry.engine_spec("sglang").weight_transport()) is SGLangTransport
    for backend in ("hf", "vllm"):
        assert type(registry.engine_spec(backend).weight_transport()) is WeightTransport
    assert "update_weights_from_tensor" in describe_sync(asked(), "sglang", colocated())


def test_one_choice_gives_the_path_the_engines_transport_and_the_group_backend():
    import torch

    choice = choose_sync(asked(group_backend="gloo"), "sglang", split())
    assert (choice.mode, type(choice.transport), choice.group_backend) == ("broadcast", SGLangTransport, "gloo")
    choice = choose_sync(asked(group_backend=None), "hf", colocated())
    assert choice.mode == "ipc" and type(choice.transport) is WeightTransport
    assert choice.group_backend == ("nccl" if torch.cuda.is_available() else "gloo")  # unset: nccl, gloo without CUDA


def test_the_driver_takes_the_engines_transport_unless_given_one():
    plan = split()
    engines = SimpleNamespace(backend="sglang")
    assert isinstance(
        WeightSync("broadcast", None, engines, plan, bucket_bytes=1 << 20, backend="gloo", timeout_s=5).transport,
        SGLangTransport,
    )
    mine = WeightTransport()
    assert (
        WeightSync(
            "broadcast", None, engines, plan, bucket_bytes=1 << 20, backend="gloo", timeout_s=5, transport=mine
        ).transport
        is mine
    )


def test_broadcast_forced_onto_colocated_engines_over_nccl_is_refused():
    for backend in ("vllm", "sglang"):
        with pytest.raises(ConfigError) as e:
            choose_sync(asked("broadcast"), backend, colocated())
        assert e.value.field == "sync.transport" and "two ranks on one GPU" in str(e.value)
        assert "sync.transport auto" in e.value.fix  # the section's words: the config says them as its flags
    assert choose_sync(asked("broadcast", "gloo"), "vllm", colocated()).mode == "broadcast"


def test_ipc_forced_onto_split_engines_is_refused():
    with pytest.raises(ConfigError, match="one actor rank and one engine worker on each"):
        choose_sync(asked("ipc"), "vllm", split())


def test_what_sglang_cannot_run_is_refused_before_ray():
    # SGLang's TP > 1 engines are its RayEngine: a whole GPU per scheduler, which hybrid's engine actor shares.
    for plan in (colocated(tp=2), split(tp=2)):
        with pytest.raises(ConfigError) as e:
            choose_sync(asked(), "sglang", plan)
        assert e.value.field == "engine.backend" and "RayEngine" in str(e.value)
    # its IPC path takes one payload per TP rank: nothing to refuse at TP 1
    assert choose_sync(asked(), "sglang", colocated()).mode == "ipc"
    assert SGLangTransport().refusal("ipc", tp=2) and SGLangTransport().refusal("broadcast", tp=2) is None
    with pytest.raises(ConfigError, match="one GPU"):
        choose_sync(asked(), "hf", colocated(tp=2))


def test_unknown_backend_and_mode_are_named():
    with pytest.raises(ConfigError) as e:
        choose_sync(asked(), "pigeon", split())
    assert e.value.field == "backend" and "sglang" in e.value.fix
    with pytest.raises(ConfigError) as e:
        choose_sync(asked("carrier"), "vllm", split())
    assert e.value.field == "sync.transport"


def test_one_registry_line_adds_a_backend_everywhere(monkeypatch):
    """An engine added to the registry is a --backend choice and gets its own transport's sync path."""
    from hybrid_algos.train.config import GRPOConfig

    monkeypatch.setitem(registry.BACKENDS, "hf2", registry.Backend("hybrid_engines.hf_engine", "HFEngine"))
    assert "hf2" in registry.backend_names()
    cfg = GRPOConfig(backend="hf2").validate()
    assert choose_sync(cfg.sync_settings(), cfg.backend, colocated("0")).mode == "ipc"
    with pytest.raises(ConfigError):
        GRPOConfig(backend="hf3").validate()
    monkeypatch.delitem(registry.BACKENDS, "hf2")
    with pytest.raises(ConfigError):
        GRPOConfig(backend="hf2").validate()
