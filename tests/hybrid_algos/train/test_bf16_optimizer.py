"""--bf16_master_weights / --bf16_optimizer_states: the combinations DeepSpeed 0.19.8 would assert on are refused
before anything starts; the DeepSpeed config carries them; and on a real DeepSpeed engine (CPU, gloo) the master
weights and Adam's moments really are bf16, a step moves the weights, the trainer's sleep/wake round-trips, and the
bytes DeepSpeed allocates are the memory model's."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid_algos.train import GRPOConfig, PPOConfig
from hybrid_algos.train.deepspeed_setup import deepspeed_config
from hybrid_core.errors import ConfigError

WORKER = Path(__file__).with_name("bf16_optimizer_worker.py")


@pytest.mark.parametrize(
    "settings, field, says",
    [
        (dict(bf16_master_weights=True, bf16_optimizer_states=True), "bf16_master_weights", "--bf16"),
        (
            dict(bf16=True, zero_stage=0, bf16_master_weights=True, bf16_optimizer_states=True),
            "bf16_master_weights",
            "--zero_stage 1, 2 or 3",
        ),
        (dict(bf16=True, bf16_optimizer_states=True), "bf16_optimizer_states", "Add --bf16_master_weights"),
        (dict(bf16=True, bf16_master_weights=True), "bf16_master_weights", "--adam_offload"),
        (dict(bf16_optimizer_states=True), "bf16_optimizer_states", "--bf16"),
    ],
)
def test_combinations_deepspeed_would_assert_on_are_refused(settings, field, says) -> None:
    with pytest.raises(ConfigError) as err:
        GRPOConfig(**settings).validate()
    assert err.value.field == field and says in str(err.value)


@pytest.mark.parametrize(
    "settings",
    [
        dict(bf16=True, bf16_master_weights=True, bf16_optimizer_states=True),  # all on the GPU (FusedAdam)
        dict(bf16=True, bf16_master_weights=True, adam_offload=True),  # CPU Adam with fp32 moments
        dict(bf16=True, bf16_master_weights=True, bf16_optimizer_states=True, adam_offload=True),  # CPU Adam, bf16
        dict(bf16=True, zero_stage=3, bf16_master_weights=True, bf16_optimizer_states=True),
    ],
)
def test_the_combinations_deepspeed_runs_are_accepted(settings) -> None:
    GRPOConfig(**settings).validate()
    PPOConfig(**settings).validate()  # the critic gets the same optimizer


def test_deepspeed_config_carries_them_in_its_bf16_section() -> None:
    def bf16_section(**kw):
        return deepspeed_config(
            zero_stage=1,
            bf16=True,
            micro_batch=2,
            grad_accum=1,
            lr=1e-6,
            betas=(0.9, 0.95),
            weight_decay=0.0,
            max_norm=1.0,
            adam_offload=False,
            **kw,
        )["bf16"]

    # DeepSpeed's per-tensor overflow scan is always off: the workers' UpdateGuard checks each update instead
    off = {"enabled": True, "check_grad_overflow": False}
    assert bf16_section() == off  # otherwise the default config is unchanged
    assert bf16_section(bf16_master_weights=True, bf16_optimizer_states=True) == {
        **off,
        "bf16_master_weights_and_grads": True,
        "bf16_optimizer_states": True,
    }
    assert bf16_section(bf16_master_weights=True) == {**off, "bf16_master_weights_and_grads": True}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: stage, master, states, offload, cycle: every mode DeepSpeed runs with the options, on the GPU (FusedAdam, with the
#: sleep/wake twin) and under CPU Adam; then the default fp32 master weights, whose bytes the memory model also counts
CASES = [
    "1,1,1,0,1",
    "2,1,1,0,1",
    "3,1,1,0,1",
    "1,1,0,1,0",
    "2,1,0,1,0",
    "3,1,0,1,0",
    "1,1,1,1,0",
    "2,1,1,1,0",
    "3,1,1,1,0",
    "1,0,0,0,0",
    "1,0,0,1,0",
    "2,0,0,1,0",
    "3,0,0,1,0",
]


@pytest.fixture(scope="module")
def engines() -> dict[tuple, dict]:
    env = {
        **os.environ,
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "CUDA_VISIBLE_DEVICES": "",
    }
    env.pop("LOCAL_WORLD_SIZE", None)  # with it set, DeepSpeed's CPU path runs ~10x slower
    proc = subprocess.run([sys.executable, str(WORKER), *CASES], env=env, capture_output=True, text=True, timeout=600)
    results = [json.loads(line[len("RESULT ") :]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and len(results) == len(CASES), proc.stdout[-3000:] + proc.stderr[-3000:]
    return {tuple(r["case"]): r for r in results}


def _ok(r: dict) -> dict:
    assert "error" not in r, r
    assert r["moved"] > r["params"] // 2, r  # the updates changed most weights
    return r


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_on_the_gpu_master_weights_and_moments_are_bf16_and_six_bytes_per_parameter(engines, stage) -> None:
    r = _ok(engines[(stage, True, True, False)])
    assert r["optimizer"] == "FusedAdam" and r["master_dtypes"] == ["bfloat16"] and r["adam_dtypes"] == ["bfloat16"]
    # bf16 master copy (2) + m, v (2 + 2), as allocated -- the memory model's K = 6
    assert r["gpu_optimizer_bytes"] == pytest.approx(6 * r["params"], rel=1e-3)
    assert r["gpu_optimizer_predicted"] == pytest.approx(r["gpu_optimizer_bytes"], rel=1e-3)
    if stage == 3:
        assert r["master_aliases_params"] is False  # its own copy even in bf16: counted, not assumed shared
    # sleep/wake, then the optimizer alone moved away and back, between the updates: training bit-identical, and
    # the states come back in bf16
    assert r["cycled_losses"] == r["losses"] and r["cycled_same_params"]
    assert r["cycled_master_dtypes"] == ["bfloat16"] and r["cycled_adam_dtypes"] == ["bfloat16"]


def test_the_default_keeps_fp32_master_weights_and_moments(engines) -> None:
    r = _ok(engines[(1, False, False, False)])
    assert r["master_dtypes"] == ["float32"] and r["adam_dtypes"] == ["float32"]
    assert r["gpu_optimizer_bytes"] == pytest.approx(12 * r["params"], rel=1e-3) == r["gpu_optimizer_predicted"]


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize(
    "master, states, per_param",
    [
        (True, False, 14),  # bf16 master + its bf16 gradient, fp32 m and v, a bf16 partition
        (True, True, 10),  # bf16 moments too: DeepSpeed builds CPU Adam with fp32_optimizer_states off
        (False, False, 18),  # the default
    ],
)
def test_cpu_adam_host_bytes_are_what_deepspeed_allocates(engines, stage, master, states, per_param) -> None:
    r = _ok(engines[(stage, master, states, True)])
    assert r["optimizer"] == "DeepSpeedCPUAdam"
    assert r["master_dtypes"] == ["bfloat16" if master else "float32"] == r["master_grad_dtypes"]
    assert r["adam_dtypes"] == ["bfloat16" if states else "float32"]
    # the memory model's cpu_adam_bytes, byte for byte: per parameter, plus ZeRO-2's accumulation buffers with fp32
    # master weights (2 micro-batches per update here) and ZeRO-1/2's staging buffer of the largest parameter
    assert r["host_bytes"] == pytest.approx(r["host_predicted"], rel=1e-4)
    extra = 2 if (stage == 2 and not master) else 0
    staging = 2 * 512 * 64 if stage < 3 else 0
    assert r["host_bytes"] == pytest.approx((per_param + extra) * r["params"] + staging, rel=1e-3)
