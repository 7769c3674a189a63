"""The dedicated sync group: real gloo groups (two ranks on threads of this process). Nothing waits forever: a
missing partner is a RemoteTimeout naming what was waited for; mismatched settings are ConfigErrors naming the
field; the default torch.distributed group is never created."""

import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist

from hybrid_core.errors import ConfigError, RemoteTimeout, RoleFailure
from hybrid_core.weight_sync import TensorMeta, WeightReceiver, WeightSender, create_sync_group
from timing_bounds import HANG_S

TIMEOUT_S = 2.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pair(timeout_s: float = TIMEOUT_S):
    """Rank 0 (sender) and rank 1 (receiver) of a fresh 2-rank gloo group."""
    port, out = _free_port(), {}
    t = threading.Thread(target=lambda: out.update(g0=create_sync_group("127.0.0.1", port, 0, 2, timeout_s=timeout_s)))
    t.start()
    g1 = create_sync_group("127.0.0.1", port, 1, 2, timeout_s=timeout_s)
    t.join()
    return out["g0"], g1


def _in_thread(fn):
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def test_receiver_whose_sender_never_comes_gets_a_named_timeout_then_a_broken_group():
    g0, g1 = _pair()
    assert not dist.is_initialized()  # the default group is left alone
    start = time.monotonic()
    with pytest.raises(RemoteTimeout, match="weight sync handshake"):
        WeightReceiver(g1, 4096).receive([TensorMeta("w", "float32", (4,))], lambda pairs: None)
    assert time.monotonic() - start < TIMEOUT_S + HANG_S  # the deadline fired (above); this only catches a hang
    with pytest.raises(RoleFailure, match="create a new one"):
        WeightReceiver(g1, 4096).receive([TensorMeta("w", "float32", (4,))], lambda pairs: None)
    g0.close(), g1.close()


def test_joining_a_group_nobody_else_joins_times_out():
    start = time.monotonic()
    with pytest.raises(RemoteTimeout, match="did not join"):
        create_sync_group("127.0.0.1", _free_port(), 0, 2, timeout_s=TIMEOUT_S)
    assert time.monotonic() - start < TIMEOUT_S + HANG_S  # the deadline fired (above); this only catches a hang


def test_bucket_size_mismatch_is_caught_at_the_handshake():
    g0, g1 = _pair()
    t, _box = _in_thread(lambda: WeightSender(g0, 8192).send([("w", torch.ones(4))]))
    with pytest.raises(ConfigError) as e:
        WeightReceiver(g1, 4096).receive([TensorMeta("w", "float32", (4,))], lambda pairs: None)
    assert e.value.field == "bucket_bytes"
    t.join(timeout=TIMEOUT_S + 10)
    assert not t.is_alive()  # the sender gave up within its deadline too
    g0.close(), g1.close()


def test_metadata_that_differs_from_the_stream_is_refused_before_loading():
    g0, g1 = _pair()
    t, _ = _in_thread(lambda: WeightSender(g0, 4096).send([("w", torch.ones(4)), ("v", torch.ones(3))]))
    loaded = []
    with pytest.raises(ConfigError) as e:
        WeightReceiver(g1, 4096).receive(
            [TensorMeta("w", "float32", (4,)), TensorMeta("v", "float32", (2,))], loaded.append
        )
    assert e.value.field == "metas" and loaded == []
    t.join(timeout=TIMEOUT_S + 10)
    g0.close(), g1.close()


@pytest.mark.parametrize("sent, planned, message", [(3, 2, "streams more tensors"), (2, 3, "ended after 2 buckets")])
def test_a_stream_longer_or_shorter_than_the_plan_is_an_error_not_a_hang(sent, planned, message):
    g0, g1 = _pair()
    full = [(f"w{i}", torch.full((256,), float(i))) for i in range(max(sent, planned))]  # one 1 KiB bucket each
    t, _ = _in_thread(lambda: WeightSender(g0, 1024).send(full[:sent]))
    loaded = []
    with pytest.raises(ConfigError, match=message) as e:
        WeightReceiver(g1, 1024).receive(
            [TensorMeta.of(n, w) for n, w in full[:planned]], lambda pairs: loaded.extend(n for n, _ in pairs)
        )
    assert e.value.field == "metas" and loaded == ["w0"]  # seen one bucket ahead (its header comes first)
    t.join(timeout=TIMEOUT_S + 10)
    g0.close(), g1.close()


def test_a_pair_syncs_repeatedly_in_one_group():
    g0, g1 = _pair(timeout_s=30)
    for seed in range(3):
        weights = [
            ("a", torch.randn(300, generator=torch.Generator().manual_seed(seed))),
            ("b", torch.arange(10, dtype=torch.int32) * seed),
        ]
        t, box = _in_thread(lambda weights=weights: WeightSender(g0, 1024).send(iter(weights)))
        got = {}
        WeightReceiver(g1, 1024).receive(
            [TensorMeta.of(n, w) for n, w in weights],
            lambda pairs, got=got: got.update({n: w.clone() for n, w in pairs}),
        )
        t.join(timeout=30)
        assert "error" not in box and box["value"].bytes == 300 * 4 + 10 * 4
        assert all(torch.equal(got[n], w) for n, w in weights)
    g0.close(), g1.close()


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"backend": "mpi"}, "backend"),
        ({"rank": 2}, "rank"),
        ({"world_size": 0}, "world_size"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"master_port": 0}, "master_port"),
    ],
)
def test_bad_group_arguments_name_the_field(kwargs, field):
    args = {"master_address": "127.0.0.1", "master_port": 29555, "rank": 0, "world_size": 2, **kwargs}
    with pytest.raises(ConfigError) as e:
        create_sync_group(**args)
    assert e.value.field == field


def test_sender_and_receiver_roles_are_checked():
    g0, g1 = _pair()
    with pytest.raises(ConfigError) as e:
        WeightSender(g1)
    assert e.value.field == "rank"
    with pytest.raises(ConfigError) as e:
        WeightReceiver(g0)
    assert e.value.field == "rank"
    g0.close(), g1.close()
