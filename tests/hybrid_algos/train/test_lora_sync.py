"""Adapter-only weight sync under LoRA (hybrid_engines.weight_sync.adapter): the trainer's PEFT model sends its
adapter's lora_A / lora_B tensors alone (trainer_backends/peft_weights.py's ``adapter_weights``) and the built-in
engine, which wrapped its own copy of the base with the same LoraConfig, loads them in place.

Real parts only: tiny Llamas built from configs, PEFT, hybrid-core's CPU shared-memory IPC buckets and a gloo
weight-sync group (this test's thread as the trainer), and for the driver's path a local Ray with the trainer and the
engine in actors of their own, the corruption fault (``HYBRID_FAULT=receiver:bucket:corrupt:N``) in the engine's.
"""

from __future__ import annotations

import socket
import sys
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hybrid_algos.train.trainer_backends.peft_weights import adapter_metas, adapter_names, adapter_weights, peft_export
from hybrid_core.errors import ConfigError, WeightSyncMismatch
from hybrid_core.weight_sync import IpcBucketSender, TensorMeta, WeightSender, create_sync_group
from hybrid_engines import SamplingParams
from hybrid_engines.hf_engine import EngineStateError, HFEngine
from hybrid_engines.weight_sync import SyncSettings
from hybrid_engines.weight_sync.adapter import AdapterSpec, choose_adapter_sync, wire_name

pytest.importorskip("peft")

CONFIG = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.2,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
SPEC = AdapterSpec(rank=4, alpha=8, target_modules="all-linear")
BUCKET = 4096  # smaller than the adapter: several buckets per sync
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10)
PROMPTS = [[5, 17, 3], [40, 2, 9, 11, 63], [88], [12, 30, 31, 4]]
TIMEOUT = 120.0


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def base_model() -> LlamaForCausalLM:
    """The base both sides load (the engine from the same config and seed: HFEngine(config, seed=0))."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG)).eval()


def peft_trainer(seed: int) -> torch.nn.Module:
    """The trainer's PEFT model over the base, its adapters moved off PEFT's start (B = 0) as training would."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(base_model(), LoraConfig(r=SPEC.rank, lora_alpha=SPEC.alpha, target_modules="all-linear"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def merged_engine(trainer: torch.nn.Module) -> HFEngine:
    """The trainer's merged model (what the merged-weights fallback sends) in a plain engine."""
    merged = base_model()
    weights = dict(peft_export(trainer).merged(iter((n, p.detach()) for n, p in trainer.named_parameters())))
    merged.load_state_dict(weights)
    return HFEngine(merged, device="cpu")


def greedy(engine: HFEngine) -> list:
    return [[o.token_ids for o in per] for per in engine.generate(PROMPTS, GREEDY)]


def adapter_bytes(trainer: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for n, p in trainer.named_parameters() if "lora_" in n)


def send_ipc(trainer, engine: HFEngine, names=None) -> int:
    names = adapter_names(trainer) if names is None else names
    sender = IpcBucketSender(bucket_bytes=BUCKET, device="cpu")
    try:
        stats = sender.send(
            adapter_weights(trainer, names), deliver=engine.update_weights_from_ipc, wait=lambda done: None
        )
    finally:
        sender.close()
    return stats.bytes


def send_broadcast(trainer, engine: HFEngine) -> tuple[int, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    names = adapter_names(trainer)
    metas = [TensorMeta(n, str(d).removeprefix("torch."), sh) for n, d, sh in adapter_metas(trainer, names)]
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(engine.init_weight_update_group, "127.0.0.1", port, 1, 2, backend="gloo", timeout_s=30)
        group = create_sync_group("127.0.0.1", port, 0, 2, backend="gloo", timeout_s=30)
        joined.result(timeout=60)
        got = pool.submit(engine.update_weights, metas, bucket_bytes=BUCKET)
        sent = WeightSender(group, BUCKET).send(adapter_weights(trainer, names))
        received = got.result(timeout=60)
    group.close()
    return sent.bytes, received.bytes


def test_the_wire_names_are_pefts_saved_adapter_names():
    assert wire_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight") == (
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    )
    assert wire_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") is None
    assert wire_name("x.lora_B.other.weight") is None  # another adapter's
    trainer = peft_trainer(1)
    names = adapter_names(trainer)
    assert len(names) == 2 * 7 * CONFIG["num_hidden_layers"]  # A and B of every projection of both layers
    from peft import get_peft_model_state_dict

    assert set(names.values()) == set(get_peft_model_state_dict(trainer))  # what PEFT itself saves
    assert SPEC.peft_config()["r"] == 4 and SPEC.peft_config()["lora_dropout"] == 0.0


def test_an_adapter_only_sync_makes_the_engine_generate_as_the_merged_model():
    """IPC buckets, then a broadcast, then a second adapter: each time only the adapter's bytes travel, the engine's
    LoRA layers hold the trainer's tensors exactly, and its greedy generations are the merged model's."""
    engine = HFEngine(LlamaConfig(**CONFIG), device="cpu", seed=0, lora=SPEC)
    base = greedy(engine)  # B starts at zero: the engine is the base until the first sync
    assert base == greedy(HFEngine(base_model(), device="cpu"))
    trainer = peft_trainer(1)
    full = sum(p.numel() * p.element_size() for p in base_model().parameters())
    assert send_ipc(trainer, engine) == adapter_bytes(trainer) < full / 4  # the adapter's bytes, not the model's
    held = dict(engine.model.named_parameters())
    for name, p in trainer.named_parameters():
        if "lora_" in name:
            assert torch.equal(held[name.removeprefix("base_model.model.")], p)
    want = greedy(merged_engine(trainer))
    assert greedy(engine) == want != base
    other = peft_trainer(2)  # the next update: loaded in place over the last adapter, by broadcast this time
    sent, received = send_broadcast(other, engine)
    assert sent == received == adapter_bytes(other)
    assert greedy(engine) == greedy(merged_engine(other)) != want


def test_a_sync_that_leaves_an_adapter_tensor_out_is_refused_naming_it():
    engine = HFEngine(LlamaConfig(**CONFIG), device="cpu", seed=0, lora=SPEC)
    trainer = peft_trainer(1)
    names = adapter_names(trainer)
    dropped = next(n for n in names if n.endswith("v_proj.lora_B.default.weight"))
    partial = {k: v for k, v in names.items() if k != dropped}
    with pytest.raises(EngineStateError, match="stale adapter") as e:
        send_ipc(trainer, engine, partial)
    assert names[dropped] in str(e.value)
    with pytest.raises(ConfigError, match="unknown weight names"):  # full weights cannot land in an adapter engine
        sender = IpcBucketSender(bucket_bytes=BUCKET, device="cpu")
        sender.send(base_model().named_parameters(), deliver=engine.update_weights_from_ipc, wait=lambda d: None)


def test_which_sync_a_lora_run_uses_and_why():
    auto = SyncSettings()
    assert choose_adapter_sync(auto, "hf", None) is None  # no LoRA: nothing to choose
    for backend in ("hf", "vllm"):
        choice = choose_adapter_sync(auto, backend, SPEC)
        assert choice.adapter_only and choice.spec == SPEC and "adapter only" in choice.line
    sglang = choose_adapter_sync(auto, "sglang", SPEC)
    assert not sglang.adapter_only and "merged" in sglang.line and "SGLang" in sglang.line
    level2 = choose_adapter_sync(auto, "vllm", SPEC, engine_sleep_level=2)
    assert not level2.adapter_only and "sleep_level 2" in level2.line
    asked = choose_adapter_sync(SyncSettings(lora="merged"), "hf", SPEC)
    assert not asked.adapter_only and "sync.lora merged" in asked.line
    assert not choose_adapter_sync(auto, "vllm", AdapterSpec(1024, 16, "all-linear")).adapter_only  # vLLM's max 512
    with pytest.raises(ConfigError, match="adapter-only sync is not possible") as e:
        choose_adapter_sync(SyncSettings(lora="adapter"), "sglang", SPEC)
    assert e.value.field == "sync.lora"
    with pytest.raises(ConfigError) as e:
        SyncSettings(lora="adapters").validate()
    assert e.value.field == "sync.lora"


def test_the_flag_is_refused_without_lora_and_the_dry_run_says_which_sync(tmp_path, capsys):
    from hybrid_algos.train.config import GRPOConfig
    from hybrid_cli.main import main

    with pytest.raises(ConfigError, match="lora_rank is 0") as e:
        GRPOConfig(lora_sync="merged").record_given({"lora_sync"}).validate()
    assert e.value.field == "lora_sync"
    from hybrid_algos.train.lora import sync_choice
    from hybrid_algos.train.sections import flag_words

    forced = GRPOConfig(lora_rank=4, lora_sync="adapter", backend="sglang", vllm_num_engines=1)
    with pytest.raises(ConfigError, match="not possible") as e, flag_words():  # in the flags' words, before Ray
        sync_choice(forced.settings())
    assert e.value.field == "lora_sync"
    argv = ["grpo", "--dry-run", "--lora_rank", "4", "--save_path", str(tmp_path)]
    assert main(argv) == 0
    assert "LoRA weight sync: adapter only" in capsys.readouterr().out
    assert main([*argv, "--lora_sync", "merged"]) == 0
    out = capsys.readouterr().out
    assert "LoRA weight sync: merged full weights" in out and "--lora_sync merged asks for it" in out


# ---- the driver's path: WeightSync between a trainer actor and an engine actor, on a local Ray ----------------------
class PeftTrainerActor:
    """The trainer's rank 0 under LoRA: what PolicyWorker gives WeightSync (adapter_weights / adapter_metas)."""

    def __init__(self, seed: int):
        self.model, self.rank, self.device = peft_trainer(seed), 0, torch.device("cpu")
        self.names = adapter_names(self.model)

    def adapter_weights(self):
        return adapter_weights(self.model, self.names)

    def adapter_metas(self):
        return [TensorMeta(n, str(d).removeprefix("torch."), s) for n, d, s in adapter_metas(self.model, self.names)]

    def named_weights(self):
        raise AssertionError("an adapter-only sync asked for the full weights")

    def where(self):
        return {"node_ip": "127.0.0.1"}

    @staticmethod
    def free_port(host: str = "127.0.0.1") -> int:
        with socket.socket() as s:
            s.bind((host, 0))
            return s.getsockname()[1]

    def merged_greedy(self):
        return greedy(merged_engine(self.model))

    def adapter_bytes(self) -> int:
        return adapter_bytes(self.model)


def _trainer_class():
    from hybrid_engines.weight_sync import TrainerWeightSource

    return type("PeftTrainer", (TrainerWeightSource, PeftTrainerActor), {})


@pytest.fixture(scope="module")
def cluster():
    import ray

    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False)  # never a foreign cluster
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.shutdown()


def test_the_driver_sends_the_adapter_alone_checked_and_a_corrupted_bucket_names_the_adapter_tensor(cluster):
    """Split placement (broadcast over gloo), then colocated (IPC), into one engine actor built with the adapter:
    each path's first sync has a corrupted bucket (the fault counts the buckets the engine's process receives) and
    ends naming the adapter tensor; the next one is clean, sends the adapter's bytes only, and the engine then
    generates as the trainer's merged model."""
    import ray

    from hybrid_core.placement import PlacementSpec
    from hybrid_core.weight_sync import plan_buckets
    from hybrid_engines.ray_engines import EngineActor, EngineGroup
    from hybrid_engines.weight_sync import WeightSync, choose_sync

    trainer = ray.remote(_trainer_class()).remote(seed=3)
    metas = ray.get(trainer.adapter_metas.remote(), timeout=TIMEOUT)
    plans = {colocated: plan_buckets(metas, BUCKET, split_large=not colocated) for colocated in (False, True)}
    assert len(plans[True]) >= 3
    nth = {False: 2, True: 2 * len(plans[False]) + 2}  # 2 broadcast syncs, then the 2nd bucket of an IPC sync
    faults = ",".join(f"receiver:bucket:corrupt:{n}" for n in nth.values())
    engine = (
        ray.remote(EngineActor)
        .options(runtime_env={"env_vars": {"HYBRID_FAULT": faults}})
        .remote("hf", {"model": LlamaConfig(**CONFIG), "device": "cpu", "seed": 0, "lora": SPEC})
    )
    engines = EngineGroup("rollout", "hf", [engine], [1], TIMEOUT)
    want = ray.get(trainer.merged_greedy.remote(), timeout=TIMEOUT)
    size = ray.get(trainer.adapter_bytes.remote(), timeout=TIMEOUT)
    try:
        for colocated in (False, True):
            plan = PlacementSpec.from_ranges({"actor": "0", "rollout": "0" if colocated else "1"}).plan()
            settings = SyncSettings(group_backend="gloo")
            mode = choose_sync(settings, "hf", plan).mode
            corrupted = plans[colocated][1].pieces[0].meta.name
            sync = WeightSync(
                mode,
                SimpleNamespace(workers=[trainer]),
                engines,
                plan,
                bucket_bytes=BUCKET,
                backend="gloo",
                timeout_s=TIMEOUT,
                adapter_only=True,
            )
            try:
                sync.setup()
                with pytest.raises(WeightSyncMismatch) as caught:
                    sync.sync(wake_engines=False)
                text = str(caught.value)
                assert f"{corrupted} " in text and ".lora_" in corrupted, text
                assert "checked in the engine's parameter" in text, text  # read back from the LoRA layer
                stats = sync.sync(wake_engines=False)
                assert stats.bytes == size  # the adapter's bytes: the transport's own count
                got = engines.generate(PROMPTS, GREEDY)
                assert [[o.token_ids for o in per] for per in got] == want
            finally:
                sync.close()
    finally:
        engines.shutdown(timeout_s=30)


def test_a_bf16_engine_takes_an_fp32_adapter_cast_on_the_way():
    """The engine's LoRA layers are in its dtype; the trainer's fp32 adapter is cast as it loads (and checked so)."""
    engine = HFEngine(LlamaConfig(**CONFIG), device="cpu", seed=0, lora=SPEC, dtype="bfloat16")
    trainer = peft_trainer(1)
    send_ipc(trainer, engine)
    held = dict(engine.model.named_parameters())
    name = next(n for n in adapter_names(trainer) if "lora_B" in n)
    mine = held[name.removeprefix("base_model.model.")]  # the LoRA layer's own tensor
    assert mine.dtype == torch.bfloat16
    assert torch.equal(mine, dict(trainer.named_parameters())[name].to(torch.bfloat16))
