"""Every SGLang name the adapter uses exists in the installed SGLang (written against 0.5.23).

Driven by the adapter's own constants (``SGLANG_SERVER_ARGS``, ``SGLANG_ENGINE_METHODS``, ``SGLANG_SAMPLING_FIELDS``,
``SGLANG_TAGS``). SGLang installs on CPU but cannot start an engine: run with ``hatch run sglang-contract:test``.
The weight-sync wire format is checked for real: our trainer side against SGLang's own receive code (its
``FlattenedTensorBucket`` and ``init_custom_process_group``, in another process, over gloo).
"""

from __future__ import annotations

import importlib.util
import inspect
import multiprocessing as mp
import socket
from pathlib import Path

import pytest
import torch

sglang = pytest.importorskip("sglang",
                             reason="SGLang is not installed here (optional env: hatch run sglang-contract:test)")

from hybrid_core.weight_sync import TensorMeta  # noqa: E402
from hybrid_engines import sglang_engine as adapter  # noqa: E402
from hybrid_engines.protocol import SamplingParams  # noqa: E402
from hybrid_engines.sampling_map import SGLANG_SAMPLING_FIELDS, expand_rows, sglang_sampling_params  # noqa: E402

pytestmark = pytest.mark.contract


def _source(module: str) -> str:
    """A module's source text without importing it (some SGLang modules need a GPU stack to import)."""
    return Path(importlib.util.find_spec(module).origin).read_text()


def test_version_is_the_one_the_adapter_was_read_against():
    print(f"checked against sglang {sglang.__version__}")
    assert sglang.__version__


def test_server_args_has_every_field_the_adapter_sets():
    from sglang.srt.arg_groups.arg_utils import record_fields
    from sglang.srt.server_args import ServerArgs

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
    for params in (SamplingParams(), SamplingParams(temperature=0.0, n=3), SamplingParams(top_k=-1, top_p=0.5),
                   SamplingParams(temperature=1.3, top_k=20, n=2, seed=7, min_new_tokens=2, stop_token_ids=(2, 5))):
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
    assert '"update_weights_from_distributed must run between "' in scheduler  # the session
    assert '"begin_weight_update() and end_weight_update()"' in scheduler
    runner = _source("sglang.srt.model_executor.model_runner_components.weight_updater")
    assert 'load_format == "flattened_bucket"' in runner and "FlattenedTensorBucket.empty" in runner
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
    return [("a", torch.randn(3, 5, generator=g).to(torch.bfloat16)),  # 30 bytes: the float32 after it is unaligned
            ("b", torch.randn(4, generator=g)), ("c", torch.randint(0, 9, (7,), generator=g)),
            ("d", torch.randn(64, 64, generator=g).half()), ("e", torch.randn(2, 2, generator=g))]


def test_flattened_buckets_split_where_sglang_would_refuse_and_rebuild_exactly():
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    named = _tensors()
    metas = [TensorMeta.of(n, t) for n, t in named]
    with pytest.raises(ValueError, match="Unaligned"):  # one bucket for all: SGLang refuses it
        FlattenedTensorBucket.empty([m.name for m in metas], [m.dtype for m in metas], [m.shape for m in metas], "cpu")
    by_name = dict(named)
    plan = adapter.sglang_bucket_plan(metas, bucket_bytes=4096)
    assert [[m.name for m in b] for b in plan] == [["a"], ["b", "c"], ["d"], ["e"]]
    for bucket in plan:
        received = FlattenedTensorBucket.empty([m.name for m in bucket], [m.dtype for m in bucket],
                                               [list(m.shape) for m in bucket], "cpu")
        received.get_flattened_tensor().copy_(adapter.flatten_bucket([by_name[m.name] for m in bucket]))
        for name, tensor in received.reconstruct_tensors():
            assert tensor.dtype == by_name[name].dtype and torch.equal(tensor, by_name[name])


def _sglang_side(port: int, metas, bucket_bytes: int, conn) -> None:
    """Rank 1, exactly as SGLang 0.5.23 joins (init_custom_process_group) and receives (flattened_bucket)."""
    try:
        from sglang.srt.utils.common import init_custom_process_group
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

        pg = init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=1,
                                       group_name="hybrid-test")
        got = {}
        for bucket in adapter.sglang_bucket_plan(metas, bucket_bytes):
            received = FlattenedTensorBucket.empty([m.name for m in bucket], [m.dtype for m in bucket],
                                                   [list(m.shape) for m in bucket], "cpu")
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
        pg = adapter.sglang_trainer_group("127.0.0.1", port, 2, group_name="hybrid-test", backend="gloo",
                                          timeout_s=400)
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
