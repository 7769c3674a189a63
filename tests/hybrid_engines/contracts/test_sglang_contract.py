"""Every SGLang name the adapter uses exists in the installed SGLang (0.5.16 and 0.5.23 are the tested versions).

Driven by the adapter's own constants (``SGLANG_SERVER_ARGS``, ``SGLANG_ENGINE_METHODS``, ``SGLANG_SAMPLING_FIELDS``,
``SGLANG_TAGS``). SGLang installs on CPU but cannot start an engine: run with ``hatch run sglang-contract:test``
(0.5.23) and ``hatch run sglang-contract:test-0516`` (0.5.16's wheel over the same env). The weight-sync wire formats
are checked for real: the trainer's ``SGLangTransport`` against SGLang's own receive code (``init_custom_process_group``
and ``FlattenedTensorBucket`` in another process over gloo; ``MultiprocessingSerializer`` with its allow-listing
unpickler and the model runner's flattened-bucket loader for the IPC payloads).
"""

from __future__ import annotations

import importlib.util
import inspect
import multiprocessing as mp
import socket
from pathlib import Path

import pytest
import torch

sglang = pytest.importorskip(
    "sglang", reason="SGLang is not installed here (optional env: hatch run sglang-contract:test)"
)

from hybrid_core.weight_sync import TensorMeta  # noqa: E402
from hybrid_engines import sglang_engine as adapter  # noqa: E402
from hybrid_engines.protocol import SamplingParams  # noqa: E402
from hybrid_engines.sampling_map import SGLANG_SAMPLING_FIELDS, expand_rows, sglang_sampling_params  # noqa: E402

pytestmark = pytest.mark.contract


def _source(module: str) -> str:
    """A module's source text without importing it (some SGLang modules need a GPU stack to import)."""
    return Path(importlib.util.find_spec(module).origin).read_text()


def test_version_is_one_the_adapter_was_read_against():
    print(f"checked against sglang {sglang.__version__}")
    assert sglang.__version__ in adapter.TESTED_VERSIONS


def _has_sessions() -> bool:
    from sglang.srt.entrypoints.engine import Engine

    return all(callable(getattr(Engine, m, None)) for m in adapter.SGLANG_SESSION_METHODS)


def test_weight_update_sessions_exist_from_0_5_23_on():
    assert _has_sessions() == (sglang.__version__ != "0.5.16")


def test_server_args_has_every_field_the_adapter_sets():
    import dataclasses

    from sglang.srt.server_args import ServerArgs

    try:  # 0.5.23: ServerArgs is a record assembled from field groups
        from sglang.srt.arg_groups.arg_utils import record_fields
    except ImportError:  # 0.5.16: a plain dataclass
        record_fields = dataclasses.fields
    fields = {f.name for f in record_fields(ServerArgs)}
    missing = sorted(set(adapter.SGLANG_SERVER_ARGS.values()) - fields)
    assert not missing, f"ServerArgs has no {missing}"


def test_engine_methods_take_the_arguments_the_adapter_passes():
    from sglang.srt.entrypoints.engine import Engine

    for method, kwargs in adapter.SGLANG_ENGINE_METHODS.items():
        fn = getattr(Engine, method, None)
        assert callable(fn), f"sglang.Engine has no {method}()"
        params = set(inspect.signature(fn).parameters)
        assert set(kwargs) <= params, f"sglang.Engine.{method} lacks {set(kwargs) - params}"


def test_sampling_params_has_every_field_and_accepts_every_mapped_request():
    from sglang.srt.sampling.sampling_params import SamplingParams as SGLangSamplingParams

    fields = set(SGLangSamplingParams.__struct_fields__)
    assert set(SGLANG_SAMPLING_FIELDS) <= fields, f"missing: {set(SGLANG_SAMPLING_FIELDS) - fields}"
    for params in (
        SamplingParams(),
        SamplingParams(temperature=0.0, n=3),
        SamplingParams(top_k=-1, top_p=0.5),
        SamplingParams(temperature=1.3, top_k=20, n=2, seed=7, min_new_tokens=2, stop_token_ids=(2, 5)),
    ):
        for row in expand_rows([[1, 2, 3]], params):
            sp = SGLangSamplingParams(**sglang_sampling_params(params, seed=row.seed, stop_at_eos=True))
            sp.verify(1000)
            assert sp.max_new_tokens == params.max_new_tokens and sp.min_new_tokens == params.min_new_tokens
            assert sp.sampling_seed == row.seed
            if params.greedy:
                assert sp.top_k == 1  # SGLang's own greedy switch


def test_memory_tags_are_sglangs():
    from sglang.srt import constants

    ours = {tag for tags in adapter.SGLANG_TAGS.values() for tag in tags}
    assert ours == set(constants.GPU_MEMORY_ALL_TYPES)  # every tag released at sleep comes back at wake


def test_behaviours_the_adapter_relies_on_are_in_the_source():
    sampler = _source("sglang.srt.layers.sampler")
    assert 'get_bool_env_var("SGLANG_RETURN_ORIGINAL_LOGPROB")' in sampler  # raw logprobs switch
    scheduler = _source("sglang.srt.managers.scheduler_components.weight_updater")
    if _has_sessions():  # 0.5.23: updates outside a session are refused, which is why the adapter opens one
        assert '"update_weights_from_distributed must run between "' in scheduler
        assert '"begin_weight_update() and end_weight_update()"' in scheduler
    runner = _source("sglang.srt.model_executor.model_runner_components.weight_updater")
    assert 'load_format == "flattened_bucket"' in runner
    assert "FlattenedTensorBucket.empty" in runner or "FlattenedTensorBucket(named_tensors=named_tensors)" in runner
    assert "def _update_weights_from_flattened_bucket" in runner  # the IPC payload's loader
    tp_worker = _source("sglang.srt.managers.tp_worker")
    assert "monkey_patch_torch_reductions()" in tp_worker  # device UUIDs in CUDA handles are understood
    assert "_device_from_maybe_uuid" in _source("sglang.srt.utils.patch_torch")
    batch = _source("sglang.srt.managers.schedule_batch")
    assert "if self.sampling_params.ignore_eos:\n            return False" in batch  # why stop_at_eos=False is refused
    info = _source("sglang.srt.sampling.sampling_batch_info")
    assert "if enable_deterministic" in info  # sampling_seed needs deterministic inference


def test_ray_engine_places_tensor_parallel_schedulers_on_given_bundles():
    ray_engine = _source("sglang.srt.ray.engine")
    assert 'kwargs.pop("placement_group", None)' in ray_engine and "class RayEngine(Engine)" in ray_engine
    assert "SGLANG_RAY_BUNDLE_INDICES" in ray_engine
    assert "num_gpus=1" in ray_engine  # whole GPUs per scheduler: why shared GPUs are refused
    assert "SGLANG_RAY_BUNDLE_INDICES" in _source("sglang.srt.environ")


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [
        ("a", torch.randn(3, 5, generator=g).to(torch.bfloat16)),  # 30 bytes: the float32 after it is unaligned
        ("b", torch.randn(4, generator=g)),
        ("c", torch.randint(0, 9, (7,), generator=g)),
        ("d", torch.randn(64, 64, generator=g).half()),
        ("e", torch.randn(2, 2, generator=g)),
    ]


def _receive_bucket(metas):
    """The engine's receive buffer for one bucket, as the installed SGLang makes it (0.5.23: ``empty``; 0.5.16: a
    bucket of empty tensors)."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    names, dtypes, shapes = [m.name for m in metas], [m.dtype for m in metas], [list(m.shape) for m in metas]
    if hasattr(FlattenedTensorBucket, "empty"):
        return FlattenedTensorBucket.empty(names, dtypes, shapes, "cpu")
    return FlattenedTensorBucket(
        named_tensors=[(n, torch.empty(s, dtype=getattr(torch, d))) for n, d, s in zip(names, dtypes, shapes)]
    )


def test_flattened_buckets_split_where_sglang_would_refuse_and_rebuild_exactly():
    named = _tensors()
    metas = [TensorMeta.of(n, t) for n, t in named]
    with pytest.raises((ValueError, RuntimeError)):  # one bucket for all: SGLang refuses (0.5.23) or cannot view it
        _receive_bucket(metas).reconstruct_tensors()
    by_name = dict(named)
    plan = adapter.sglang_bucket_plan(metas, bucket_bytes=4096)
    assert [[m.name for m in b] for b in plan] == [["a"], ["b", "c"], ["d"], ["e"]]
    for bucket in plan:
        received = _receive_bucket(bucket)
        received.get_flattened_tensor().copy_(adapter.flatten_bucket([by_name[m.name] for m in bucket]))
        for name, tensor in received.reconstruct_tensors():
            assert tensor.dtype == by_name[name].dtype and torch.equal(tensor, by_name[name])


def test_ipc_payloads_pass_sglangs_unpickler_and_load_through_its_flattened_bucket_loader():
    """CPU buckets (shared memory) in the form the trainer's SGLangTransport makes them, read as a scheduler does:
    ``MultiprocessingSerializer.deserialize`` (allow-listing unpickler) then the runner's flattened-bucket loader."""
    from types import SimpleNamespace

    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
    from sglang.srt.utils.common import MultiprocessingSerializer

    from hybrid_core.weight_sync import IpcBucketSender
    from hybrid_engines.weight_sync.sglang import SGLangTransport

    loaded = {}
    model = SimpleNamespace(load_weights=lambda pairs: loaded.update({n: t.clone() for n, t in pairs}))
    runner = SimpleNamespace(get_model=lambda: model)
    transport, named = SGLangTransport(), _tensors()

    def deliver(bucket):
        payload = transport.encode_ipc([bucket])
        for data in payload.data:
            obj = MultiprocessingSerializer.deserialize(data)
            ok, message = WeightUpdater._update_weights_from_flattened_bucket(runner, obj)
            assert ok, message

    sender = IpcBucketSender(4096, device="cpu")
    sender.send(iter(named), deliver=deliver, wait=lambda _: None)
    sender.close()
    for name, tensor in named:
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor)


def test_cuda_ipc_payload_names_only_what_sglangs_unpickler_allows():
    """A CUDA bucket's payload (made here from a stand-in handle; no GPU) unpickles under SGLang's allow-list into
    ``rebuild_cuda_tensor`` with the GPU's UUID as the device, which SGLang's patched rebuild maps to its index."""
    from sglang.srt.utils.common import SafeUnpickler

    from hybrid_core.weight_sync import IpcBucket, IpcHandle
    from hybrid_engines.weight_sync.sglang import serialize_bucket

    seen = []

    class Probe(SafeUnpickler):
        def find_class(self, module, name):
            found = super().find_class(module, name)  # raises for anything SGLang would block
            seen.append(f"{module}.{name}")
            # torch's rebuild_cuda_tensor, or SGLang's patched one if this process was patched: both are allowed
            return (lambda *args: ("rebuilt", args)) if "rebuild_cuda_tensor" in name else found

    import io

    args = (
        torch.Tensor,
        (64,),
        (1,),
        0,
        torch.UntypedStorage,
        torch.uint8,
        3,
        b"handle",
        64,
        0,
        False,
        b"rc",
        0,
        b"event",
        True,
    )
    meta = TensorMeta("w", "bfloat16", (4, 8))
    bucket = IpcBucket(0, IpcHandle("cuda", args, 64, "GPU-1234"), ((meta, 0),), last=True)
    obj = Probe(io.BytesIO(serialize_bucket(bucket))).load()
    kind, rebuilt = obj["flattened_tensor"]
    assert kind == "rebuilt" and rebuilt[6] == "GPU-1234" and rebuilt[7] == b"handle"
    (m,) = obj["metadata"]
    assert (m.name, tuple(m.shape), m.dtype, m.start_idx, m.end_idx, m.numel) == (
        "w",
        (4, 8),
        torch.bfloat16,
        0,
        64,
        64,
    )
    assert any("rebuild_cuda_tensor" in s for s in seen)


def _sglang_side(port: int, metas, bucket_bytes: int, conn) -> None:
    """Rank 1, exactly as SGLang joins (init_custom_process_group) and receives (flattened_bucket)."""
    try:
        from sglang.srt.utils.common import init_custom_process_group

        pg = init_custom_process_group(
            backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=1, group_name="hybrid-test"
        )
        got = {}
        for bucket in adapter.sglang_bucket_plan(metas, bucket_bytes):
            received = _receive_bucket(bucket)
            torch.distributed.broadcast(received.get_flattened_tensor(), src=0, group=pg)
            got.update({n: t.clone() for n, t in received.reconstruct_tensors()})
        conn.send(("ok", got))
    except Exception as e:  # report, do not hang the parent
        conn.send(("error", repr(e)))
    conn.poll(60)  # exit only once the parent has the answer (a dying child can cut the pipe mid-message)


def test_trainer_group_and_sender_speak_sglangs_protocol():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    named = _tensors()
    metas = [TensorMeta.of(n, t) for n, t in named]
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_sglang_side, args=(port, metas, 100, child), daemon=True)
    proc.start()
    try:
        # generous deadlines: the child imports SGLang first, minutes on a loaded 2-core machine
        pg = adapter.sglang_trainer_group("127.0.0.1", port, 2, group_name="hybrid-test", backend="gloo", timeout_s=400)
        stats = adapter.send_to_sglang(pg, iter(named), bucket_bytes=100)
        assert parent.poll(450), "SGLang's side did not answer"
        status, got = parent.recv()
        parent.send("bye")
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.terminate()
    assert status == "ok", got
    assert stats.bytes == sum(t.numel() * t.element_size() for _, t in named)
    for name, tensor in named:
        assert torch.equal(got[name], tensor)


def test_partial_rollout_pause_and_stream_exist_as_the_adapter_calls_them():
    """Partial rollouts: the tokenizer manager's pause / continue with the request types and the retract mode the
    adapter uses, streamed rows with cumulative output_ids, and the event loop the adapter runs in its own thread."""
    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.managers import io_struct
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    for method, request, kwargs in adapter.SGLANG_PAUSE.values():
        assert inspect.iscoroutinefunction(getattr(TokenizerManager, method)), f"TokenizerManager.{method}"
        cls = getattr(io_struct, request)
        cls(**kwargs)  # the fields exist and take these values
    mode = inspect.get_annotations(io_struct.PauseGenerationReqInput)["mode"]
    assert "retract" in str(mode)
    params = set(inspect.signature(Engine.async_generate).parameters)
    assert set(adapter.SGLANG_STREAM_ARGS) <= params
    manager = _source("sglang.srt.managers.tokenizer_manager")
    assert "incremental_streaming_output" in manager  # off by default: streamed output_ids are cumulative
    engine = _source("sglang.srt.entrypoints.engine")
    assert "self.loop.run_until_complete(" in engine  # every sync Engine method goes through its loop attribute
