"""The vLLM worker's read-back (``hybrid_engines.vllm_read_back``) on CPU, over stand-ins of vLLM 0.26's layers
(``vllm_layers_standin``: vLLM's class names, modules, attributes and slicing rules, a Qwen2-shaped model).

Checked: each HF tensor's read-back is a view of vLLM's own parameter holding its bytes (a stacked ``q_proj`` its
rows of ``qkv_proj``); None under TP > 1, for a padded vocabulary, unknown names, quantized or wrapped loaders, meta
parameters, another dtype, and never an exception; a name whose loader transforms it is found at its first load and
checked over the bytes received from then on; and end to end, through ``hybrid_core.weight_sync`` (CPU shared-memory
IPC buckets, and the gloo broadcast), a stale ``q_proj`` -- its load skipped -- is caught naming it, which the
check over the bytes received (the worker before the read-back) lets pass.
"""

from __future__ import annotations

import logging
import socket
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
import vllm_layers_standin as v
from vllm_layers_standin import Config, ToyQwen2ForCausalLM, checkpoint

from hybrid_core.errors import WeightSyncMismatch
from hybrid_core.weight_sync import IpcBucketSender, TensorMeta, WeightSender, create_sync_group, load_ipc_bucket
from hybrid_engines.vllm_read_back import VllmReadBack, build_regions
from hybrid_engines.vllm_worker import HybridWorkerExtension

BUCKET = 4096  # several buckets per sync; the embeddings travel alone
Q = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(autouse=True)
def no_faults(monkeypatch):
    monkeypatch.delenv("HYBRID_FAULT", raising=False)


def loaded(c: Config | None = None, *, tp: int = 1, seed: int = 0, dtype=torch.float32):
    """A toy vLLM model loaded with a checkpoint, its reader calibrated on that load."""
    model = ToyQwen2ForCausalLM(c, tp=tp, dtype=dtype)
    weights = checkpoint(model.c, seed)
    reader = VllmReadBack(model, tp)
    model.load_weights(weights)
    reader.calibrate(weights)
    return model, reader, weights


def test_every_tensor_reads_back_as_a_view_of_vllms_parameter_holding_its_bytes():
    model, reader, weights = loaded()
    check = reader.for_sync(TensorMeta.of(n, t) for n, t in weights)
    attn = model.model.layers[0].self_attn
    for name, sent in weights:
        got = check(name)
        assert got is not None, name
        assert got.is_contiguous() and got.dtype == sent.dtype and got.numel() == sent.numel()
        assert torch.equal(got.reshape(sent.shape), sent), name
    # the stacked ones are views into the fused parameter, at vLLM's offsets (GQA: k and v are half of q)
    qkv = attn.qkv_proj.weight
    h = model.c.heads * model.c.head_size
    kv = model.c.kv_heads * model.c.head_size
    for name, offset in ((Q, 0), (Q.replace("q_proj", "k_proj"), h), (Q.replace("q_proj", "v_proj"), h + kv)):
        got = check(name)
        assert got.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()
        assert got.data_ptr() == qkv[offset].data_ptr()
    up = check("model.layers.1.mlp.up_proj.weight")
    assert up.data_ptr() == model.model.layers[1].mlp.gate_up_proj.weight[model.c.inter].data_ptr()
    assert check("model.layers.0.self_attn.v_proj.bias").data_ptr() == attn.qkv_proj.bias[h + kv].data_ptr()
    assert reader.transformed == set() and reader.report() == []


def test_the_map_is_built_once_and_holds_the_stacked_shards():
    model = ToyQwen2ForCausalLM()
    regions = build_regions(model)
    region = regions[Q]
    assert region.module is model.model.layers[0].self_attn.qkv_proj and (region.attr, region.offset) == ("weight", 0)
    assert regions["model.layers.0.mlp.gate_proj.weight"].rows == model.c.inter
    assert regions["model.layers.0.mlp.up_proj.weight"].offset == model.c.inter
    assert "model.layers.0.self_attn.qkv_proj.weight" in regions  # a fused-on-disk name reads the whole parameter
    assert "model.layers.0.self_attn.o_proj.weight" in regions and "model.norm.weight" in regions


def test_a_padded_vocabulary_an_unknown_name_and_another_dtype_read_nothing():
    _, reader, weights = loaded(Config(vocab=100))  # padded to 128 rows in vLLM
    check = reader.for_sync(TensorMeta.of(n, t) for n, t in weights)
    assert check("model.embed_tokens.weight") is None and check("lm_head.weight") is None
    assert check(Q) is not None
    for name in ("model.layers.9.self_attn.q_proj.weight", "nonsense", "", "lm_head"):
        assert check(name) is None and reader.read_back(name) is None
    assert reader.for_sync([TensorMeta(Q, "bfloat16", (16, 16))])(Q) is None  # sent in another dtype
    assert reader.for_sync([TensorMeta(Q, "float32", (8, 16))])(Q) is None  # another numel
    assert reader.for_sync([])(Q) is None  # not in this sync


def test_tensor_parallel_reads_nothing():
    _, reader, weights = loaded(tp=2)  # a rank's q_proj rows are half of the tensor; k/v heads replicated
    assert reader.regions == {}
    assert all(reader.read_back(n) is None for n, _ in weights)
    model, _, weights = loaded()
    unknown = VllmReadBack(model, None)  # the worker could not tell its TP size
    unknown.calibrate(weights)
    assert unknown.regions == {} and unknown.read_back(Q) is None


def test_quantized_wrapped_or_meta_parameters_and_subclasses_read_nothing():
    model, reader, _ = loaded()
    attn = model.model.layers[0].self_attn
    assert reader.read_back(Q) is not None
    attn.qkv_proj.quant_method = v.Fp8LinearMethod()  # quantized: vLLM stores something else
    assert reader.read_back(Q) is None
    attn.qkv_proj.quant_method = v.UnquantizedLinearMethod()
    original = attn.qkv_proj.weight.weight_loader

    def online_process_loader(*args, **kwargs):  # what layerwise reload puts on a layer not yet processed
        return original(*args, **kwargs)

    attn.qkv_proj.weight.weight_loader = online_process_loader
    assert reader.read_back(Q) is None
    attn.qkv_proj.weight.weight_loader = original
    norm = "model.layers.0.input_layernorm.weight"
    layer = model.model.layers[0]
    layer.input_layernorm.weight.weight_loader = lambda p, w: p.data.copy_(w * 2)  # not vLLM's default loader
    assert reader.read_back(norm) is None
    del layer.input_layernorm.weight.weight_loader
    assert reader.read_back(norm) is not None
    kept = layer.input_layernorm.weight
    layer.input_layernorm.weight = torch.nn.Parameter(torch.empty(kept.shape, device="meta"), requires_grad=False)
    assert reader.read_back(norm) is None  # layerwise reload's stand-in before the layer is complete
    layer.input_layernorm.weight = kept

    class MinimaxM3QKVParallelLinearWithIndexer(v.QKVParallelLinear):  # vLLM's own subclass: another layout
        __module__ = v.LINEAR

    class QKVParallelLinear(v.QKVParallelLinear):  # an out-of-tree replacement (PluggableLayer.register_oot)
        __module__ = "my_platform.layers"

    for cls in (MinimaxM3QKVParallelLinearWithIndexer, QKVParallelLinear):
        sub = ToyQwen2ForCausalLM()
        old = sub.model.layers[0].self_attn.qkv_proj
        new = cls.__new__(cls)
        new.__dict__.update(old.__dict__)
        new.weight.weight_loader, new.bias.weight_loader = new.weight_loader_v2, new.weight_loader
        sub.model.layers[0].self_attn.qkv_proj = new
        assert Q not in build_regions(sub)
        assert "model.layers.0.self_attn.qkv_proj.weight" in build_regions(sub)  # a direct name, but ...
        assert VllmReadBack(sub, 1)._view("model.layers.0.self_attn.qkv_proj.weight") is None  # ... not its loader


def test_a_parameter_reallocated_by_the_load_is_looked_up_after_it():
    model, reader, weights = loaded()
    qkv = model.model.layers[0].self_attn.qkv_proj
    fresh = torch.nn.Parameter(qkv.weight.detach().clone() + 1, requires_grad=False)
    fresh.output_dim, fresh.weight_loader = 0, qkv.weight_loader_v2
    qkv.weight = fresh  # as layerwise reload or process_weights_after_loading may re-register it
    got = reader.read_back(Q)
    assert got.untyped_storage().data_ptr() == fresh.untyped_storage().data_ptr()
    assert torch.equal(got, dict(weights)[Q] + 1)


def test_read_back_never_raises():
    _, reader, _ = loaded()

    class Broken(torch.nn.Module):
        def __getattr__(self, name):
            raise RuntimeError("boom")

    reader.regions[Q] = type(reader.regions[Q])(Broken(), "weight", 0, 4)
    assert reader.read_back(Q) is None
    assert reader.read_back(None) is None  # type: ignore[arg-type]
    assert reader.for_sync(None)(Q) is None  # type: ignore[arg-type]

    class NoParameters(torch.nn.Module):
        def named_parameters(self, *a, **k):
            raise RuntimeError("boom")

    assert VllmReadBack(NoParameters(), 1).regions == {}  # built on an odd model: nothing read back, no error
    reader.calibrate([(Q, "not a tensor")])  # type: ignore[list-item]
    reader.calibrate(None)  # type: ignore[arg-type]


def test_a_tensor_the_loader_transforms_is_found_at_its_first_load_and_checked_as_received(caplog):
    norm = "model.layers.1.post_attention_layernorm.weight"
    model = ToyQwen2ForCausalLM()
    model.transform[norm] = lambda t: t + 1  # a model whose load_weights adds to a tensor (Gemma-style)
    worker = Worker(model)
    with caplog.at_level(logging.WARNING, logger="hybrid_engines.vllm_read_back"):
        ipc_sync(worker, checkpoint(model.c, 1))  # the first load: no false mismatch
    assert [r.getMessage() for r in caplog.records if norm in r.getMessage()]
    assert len([r for r in caplog.records if "differently" in r.getMessage()]) == 1  # one warning for the sync
    reader = worker._hybrid_reader
    assert reader.transformed == {norm} and reader.read_back(norm) is None and reader.read_back(Q) is not None
    ipc_sync(worker, checkpoint(model.c, 2))  # later syncs check it over the bytes received
    model.skip.add(Q)
    with pytest.raises(WeightSyncMismatch, match=r"q_proj\.weight \(bucket \d+, checked in the engine's parameter\)"):
        ipc_sync(worker, checkpoint(model.c, 3))


class Worker(HybridWorkerExtension):
    """The worker extension on a CPU "worker" (vLLM's WorkerBase sets these attributes)."""

    def __init__(self, model, tp: int | None = 1):
        self.rank, self.device, self.model_config, self.model = 0, torch.device("cpu"), None, model
        self.parallel_config = SimpleNamespace(tensor_parallel_size=tp)

    def get_model(self):
        return self.model


def ipc_sync(worker, weights):
    sender = IpcBucketSender(BUCKET, device="cpu", verify=True)
    try:
        sender.send(weights, deliver=lambda b: worker.hybrid_load_ipc([b]), wait=lambda _: None)
    finally:
        sender.close()


def test_a_stale_fused_parameter_is_caught_through_ipc_naming_q_proj():
    model = ToyQwen2ForCausalLM()
    worker = Worker(model)
    ipc_sync(worker, checkpoint(model.c, 1))
    model.skip.add(Q)  # the load skipped for q_proj: qkv_proj keeps sync 1's rows (TRL #5312's stale weights)
    stale = r"model\.layers\.0\.self_attn\.q_proj\.weight \(bucket \d+, checked in the engine's parameter\)"
    with pytest.raises(WeightSyncMismatch, match=stale) as e:
        ipc_sync(worker, checkpoint(model.c, 2))
    assert "1 of" in str(e.value)  # only q_proj: k/v rows of the same parameter were loaded
    assert worker._hybrid_reader.model is model  # built once, kept across syncs
    model.skip.clear()
    ipc_sync(worker, checkpoint(model.c, 3))  # the next good sync passes again


def test_without_the_read_back_the_same_stale_load_passes():
    """What the worker did before: only the bytes received were checked, so the stale rows pass."""
    model = ToyQwen2ForCausalLM()
    first = checkpoint(model.c, 1)
    model.load_weights(first)
    model.skip.add(Q)
    second = checkpoint(model.c, 2)
    sender = IpcBucketSender(BUCKET, device="cpu", verify=True)
    try:
        sender.send(second, deliver=lambda b: load_ipc_bucket(b, model.load_weights), wait=lambda _: None)
    finally:
        sender.close()
    stale = model.model.layers[0].self_attn.qkv_proj.weight[: model.c.heads * model.c.head_size]
    assert torch.equal(stale, dict(first)[Q]) and not torch.equal(stale, dict(second)[Q])
    worker = Worker(ToyQwen2ForCausalLM(), tp=None)  # a worker that cannot tell its TP size reads nothing back
    ipc_sync(worker, checkpoint(worker.model.c, 1))
    worker.model.skip.add(Q)
    ipc_sync(worker, checkpoint(worker.model.c, 2))


def test_a_new_model_object_gets_a_new_map_and_keeps_what_calibration_found():
    model = ToyQwen2ForCausalLM()
    model.transform["model.norm.weight"] = lambda t: t * 2
    worker = Worker(model)
    ipc_sync(worker, checkpoint(model.c, 1))
    first = worker._hybrid_reader
    worker.model = ToyQwen2ForCausalLM()
    ipc_sync(worker, checkpoint(model.c, 2))
    assert worker._hybrid_reader is not first and worker._hybrid_reader.model is worker.model
    assert worker._hybrid_reader.transformed == {"model.norm.weight"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("stale", [False, True])
def test_the_broadcast_path_reads_back_too(stale):
    model = ToyQwen2ForCausalLM()
    worker = Worker(model)
    port = free_port()
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(worker.hybrid_init_weight_group, "127.0.0.1", port, 1, 2, "gloo", 30.0, "read-back")
        group = create_sync_group("127.0.0.1", port, 0, 2, backend="gloo", timeout_s=30, group_name="read-back")
        joined.result(timeout=60)
        try:
            for seed in (1, 2):
                weights = checkpoint(model.c, seed)
                if seed == 2 and stale:
                    model.skip.add(Q)
                metas = [(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in weights]
                got = pool.submit(worker.hybrid_receive_weights, metas, BUCKET, False)
                WeightSender(group, BUCKET, verify=True).send(weights)
                if seed == 2 and stale:
                    with pytest.raises(WeightSyncMismatch, match=r"q_proj\.weight.*checked in the engine.s parameter"):
                        got.result(timeout=60)
                else:
                    assert got.result(timeout=60)["bytes"] == sum(t.numel() * 4 for _, t in weights)
        finally:
            group.close()
            worker.hybrid_close_weight_group()
    if not stale:
        assert torch.equal(worker._hybrid_reader.read_back(Q), dict(weights)[Q])
