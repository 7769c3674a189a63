"""The trainer's side of SGLang's weight sync: SGLang's own group and wire formats, not hybrid-core's.

Read in the SGLang 0.5.16 and 0.5.23 wheels (the same in both where it matters here):

* Broadcast. The engine joins with ``init_weights_update_group`` (``utils/common.py::init_custom_process_group``:
  torch's TCP ``rendezvous``, ``PrefixStore(group_name)``, ``_new_process_group_helper``; TP rank r is
  ``rank_offset + r``, the trainer rank 0), then per bucket ``update_weights_from_distributed(names, dtypes, shapes,
  load_format="flattened_bucket")`` posts ONE broadcast from rank 0 of the bucket's tensors' bytes back to back
  (``weight_sync/tensor_bucket.py::FlattenedTensorBucket``; 0.5.23 refuses a tensor whose byte offset is not a
  multiple of its element size, 0.5.16 fails on it when viewing, so such a tensor opens a new bucket). No handshake, no
  header: sender and engine must cut the stream alike, which :func:`sglang_bucket_plan` does for both sides.
* IPC (engine on the trainer's GPU). ``update_weights_from_tensor(named_tensors=[payload per TP rank],
  load_format="flattened_bucket")``: each TP scheduler deserializes its own payload with SGLang's
  ``MultiprocessingSerializer`` (a ``ForkingPickler`` stream read by an allow-listing unpickler: torch, builtins,
  ``types``, ``multiprocessing`` and some SGLang modules only), getting ``{"flattened_tensor": uint8 tensor,
  "metadata": [objects with name, shape, dtype, start_idx, end_idx, numel]}``. The tensor is rebuilt from a CUDA-IPC
  handle by ``torch.multiprocessing.reductions.rebuild_cuda_tensor``, which SGLang patches (``utils/patch_torch.py``)
  to take the GPU's UUID in place of a device index -- device indices differ between the trainer and SGLang's
  scheduler process. The handle must come from the process that owns the memory: torch refuses to re-share a CUDA
  tensor received from another process, so the trainer encodes it here and the engine actor only forwards bytes.

Every collective has a deadline (the group is a hybrid-core ``SyncGroup``, so NCCL work is polled and the
communicator aborted at the deadline instead of hanging).
"""

from __future__ import annotations

import collections
import io
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from types import SimpleNamespace
from typing import Any, ClassVar

import torch

from hybrid_core.errors import ConfigError, RoleFailure
from hybrid_core.stats import TransferStats
from hybrid_core.weight_sync.group import GROUP_NAME

from .transport import WeightTransport

FLATTENED = "flattened_bucket"
_CPU_ALIVE: collections.deque[torch.Tensor] = collections.deque(maxlen=3)  # see _shared_tensor


class SGLangTransport(WeightTransport):
    """What :class:`~hybrid_engines.sglang_engine.SGLangEngine` receives (``SGLangEngine.weight_transport()``)."""

    name = "sglang"
    wire: ClassVar[dict[str, str]] = {
        "broadcast": "SGLang's weight-update group, flattened buckets (update_weights_from_distributed)",
        "ipc": "CUDA-IPC flattened buckets in SGLang's serialized form (update_weights_from_tensor)",
    }
    # One payload per TP rank, each from the trainer rank on that rank's GPU; SGLang's own TP > 1 engines take whole
    # GPUs (RayEngine), so a colocated TP > 1 engine does not exist to serve.
    ipc_max_tp = 1
    # SGLang loads with its own code from its own formats: no hybrid-core checksums travel, so no verify= argument
    # (hybrid_engines.weight_sync.choice.verify_note says so at start).
    verifies = False

    def join(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        *,
        backend: str,
        timeout_s: float,
        device: torch.device | str | None,
        group_name: str = GROUP_NAME,
    ) -> Any:
        return sglang_trainer_group(
            master_address,
            master_port,
            world_size,
            group_name=group_name,
            backend=backend,
            timeout_s=timeout_s,
            device=device,
        )

    # no verify=: SGLang's format has no checksums (verifies = False), so callers pass none (driver._verify_kwargs)
    def broadcast(  # type: ignore[override]
        self, group: Any, named_tensors: Iterable[tuple[str, torch.Tensor]], *, bucket_bytes: int
    ) -> TransferStats:
        return send_to_sglang(group, named_tensors, bucket_bytes)

    def close_group(self, group: Any) -> None:
        if group is None:
            return
        group.close()
        try:  # the group was registered in torch's process-group table: drop it there too
            torch.distributed.destroy_process_group(group.backend_pg)
        except Exception:  # already gone (aborted), or torch keeps no entry: nothing left to release
            pass

    def encode_ipc(self, buckets: Sequence[Any]) -> SGLangIpcPayload:
        return SGLangIpcPayload.of(buckets)


# ---- broadcast ---------------------------------------------------------------------------------------------------
class _BucketCutter:
    """Where SGLang flattened buckets end: at most ``bucket_bytes`` each (a larger tensor travels alone); a tensor whose
    offset would not be a multiple of its element size opens a new bucket."""

    def __init__(self, bucket_bytes: int):
        if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ConfigError("bucket_bytes", f"must be a positive int, got {bucket_bytes!r}.")
        self.bucket_bytes, self.used = bucket_bytes, None

    def opens_bucket(self, meta: Any) -> bool:
        size = meta.nbytes
        new = self.used is None or self.used + size > self.bucket_bytes or self.used % meta.torch_dtype.itemsize
        self.used = (0 if new else self.used) + size
        return bool(new)


def sglang_bucket_plan(metas: Iterable[Any], bucket_bytes: int) -> list[list[Any]]:
    """The ``TensorMeta`` lists of the buckets, in order (the engine and :func:`send_to_sglang` cut alike)."""
    cutter = _BucketCutter(bucket_bytes)
    buckets: list[list[Any]] = []
    for meta in metas:
        if cutter.opens_bucket(meta):
            buckets.append([])
        buckets[-1].append(meta)
    return buckets


def flatten_bucket(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The bytes of ``tensors`` back to back: what SGLang's ``FlattenedTensorBucket`` receives and splits."""
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def sglang_trainer_group(
    master_address: str,
    master_port: int,
    world_size: int,
    *,
    group_name: str,
    backend: str = "nccl",
    timeout_s: float = 600.0,
    device: torch.device | str | None = None,
):
    """Rank 0 (the trainer) of the group SGLang's ``init_weights_update_group`` joins, built the way SGLang's
    ``init_custom_process_group`` builds it (same rendezvous, store prefix and torch helper), returned as a
    hybrid-core ``SyncGroup`` so every broadcast has a deadline."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    from hybrid_core.errors import RemoteTimeout
    from hybrid_core.weight_sync import SyncGroup

    if backend not in ("nccl", "gloo"):
        raise ConfigError(
            "backend", f"must be 'nccl' or 'gloo', got {backend!r}.", "Use nccl between GPUs, gloo on CPU."
        )
    if backend == "nccl":
        device = torch.device(device if device is not None else "cuda")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)  # NCCL binds the communicator to the current device
    else:
        device = torch.device("cpu")
    timeout = timedelta(seconds=timeout_s)
    where = f"SGLang weight-update group {group_name!r} at {master_address}:{master_port} (rank 0 of {world_size})"
    try:
        # not torch's tcp:// rendezvous (its store listens on every interface): one on the rendezvous address only
        from hybrid_core import rendezvous as meeting

        meeting.use_interface(meeting.bind_address(master_address))
        store = meeting.open_store(master_address, master_port, world_size, is_master=True, timeout=timeout, what=where)
        rank, size = 0, world_size
        pg, _ = _new_process_group_helper(
            size,
            rank,
            [],
            Backend(backend),
            PrefixStore(group_name, store),
            group_name=group_name,
            backend_options=None,
            timeout=timeout,
        )
    except (RuntimeError, TimeoutError) as e:
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if isinstance(e, TimeoutError) or "timeout" in text.lower() or "timed out" in text.lower():
            raise RemoteTimeout(f"{where}: the engines did not join within {timeout_s:g} s ({text})") from e
        raise RoleFailure(f"{where}: could not create the {backend} group: {text}") from e
    _world.pg_group_ranks[pg] = {i: i for i in range(size)}
    return SyncGroup(pg, store, rank, size, backend, device, timeout_s)


def send_to_sglang(group: Any, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> TransferStats:
    """Broadcast ``named_tensors`` from rank 0 of ``group`` (:func:`sglang_trainer_group`), one flattened bucket at a
    time, while the engine's ``update_weights(metas, bucket_bytes=bucket_bytes)`` runs with the metas of exactly these
    tensors, in this order. Streamed: a lazy iterator (ZeRO-3 gathers) is consumed one tensor at a time; at most two
    buckets (one on the wire, one being packed) are held. Each broadcast waits under the group's deadline."""
    from hybrid_core.weight_sync import TensorMeta

    cutter = _BucketCutter(bucket_bytes)
    current: list[torch.Tensor] = []
    start, nbytes, index, pending = time.perf_counter(), 0, 0, None
    on_device = group.device.type == "cuda"

    def flush() -> Any:
        nonlocal nbytes, index
        flat = flatten_bucket([t.to(group.device, non_blocking=on_device) for t in current])
        work = group.broadcast(flat, what=f"SGLang weight sync bucket {index}")
        nbytes, index = nbytes + flat.numel(), index + 1
        return work, flat  # keep the buffer alive until the broadcast is done

    with torch.no_grad():
        for name, tensor in named_tensors:
            if cutter.opens_bucket(TensorMeta.of(name, tensor)) and current:
                work = flush()
                if pending is not None:
                    pending[0].wait()
                pending, current = work, []
            current.append(tensor)
        if current:
            work = flush()
            if pending is not None:
                pending[0].wait()
            pending = work
        if pending is not None:
            pending[0].wait()
    if on_device:
        torch.cuda.current_stream(group.device).synchronize()
    return TransferStats(nbytes, time.perf_counter() - start, "sglang weight sync")


# ---- ipc ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SGLangIpcPayload:
    """One delivery to an SGLang engine's ``update_weights_from_ipc``: SGLang's serialized flattened bucket, one
    per TP rank (each made from the trainer's bucket on that rank's GPU), plus where it sits in the sync."""

    index: int
    data: tuple[bytes, ...]  # empty: the sync's bare end marker
    names: tuple[str, ...]
    nbytes: int
    last: bool

    @classmethod
    def of(cls, buckets: Sequence[Any]) -> SGLangIpcPayload:
        """From hybrid-core ``IpcBucket`` s (one per GPU of the engine, in TP-rank order), in the process that packed
        them (their handles are that process's memory)."""
        first = buckets[0]
        data = tuple(serialize_bucket(b) for b in buckets) if first.handle is not None else ()
        return cls(first.index, data, tuple(m.name for m, _ in first.entries), first.nbytes, first.last)


def serialize_bucket(bucket: Any) -> bytes:
    """A hybrid-core ``IpcBucket`` as SGLang's ``MultiprocessingSerializer`` bytes of a flattened-bucket dict (only
    globals that SGLang's allow-listing unpickler admits: torch rebuild functions, ``types.SimpleNamespace``,
    ``torch.Size`` and dtypes)."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as tmp

    metadata = [
        SimpleNamespace(
            name=meta.name,
            shape=torch.Size(meta.shape),
            dtype=meta.torch_dtype,
            start_idx=offset,
            end_idx=offset + meta.nbytes,
            numel=meta.nbytes,
        )
        for meta, offset in bucket.entries
    ]
    flat = _shared_tensor(bucket.handle)
    buf = io.BytesIO()
    strategy = tmp.get_sharing_strategy()
    if bucket.handle.kind == "shm":
        tmp.set_sharing_strategy("file_system")
    try:
        ForkingPickler(buf).dump({"flattened_tensor": flat, "metadata": metadata})
    finally:
        tmp.set_sharing_strategy(strategy)
    return buf.getvalue()


class _CudaIpcTensor:
    """Pickles as the CUDA tensor behind a hybrid-core CUDA handle, with the GPU's UUID as its device (SGLang's
    form)."""

    def __init__(self, handle: Any):
        self.handle = handle

    def __reduce__(self):
        from torch.multiprocessing import reductions

        args = list(self.handle.payload)
        args[6] = self.handle.device_uuid  # rebuild_cuda_tensor's device argument, as SGLang's patched version takes
        return reductions.rebuild_cuda_tensor, tuple(args)


def _shared_tensor(handle: Any) -> Any:
    if handle.kind == "cuda":
        return _CudaIpcTensor(handle)
    if handle.kind == "shm":
        # CPU (tests): a copy in torch's "file_system" shared memory, which any process on the host attaches to by
        # name (torch's default descriptor passing authenticates per process tree); SGLang's unpickler allows its
        # rebuild functions. Kept alive until the next-but-one bucket (the sender has two in flight at most).
        copy = torch.from_file(handle.payload, shared=True, size=handle.nbytes, dtype=torch.uint8).clone()
        _CPU_ALIVE.append(copy)
        return copy
    raise ConfigError("IpcHandle.kind", f"unknown kind {handle.kind!r}.", "Use buckets from IpcBucketSender.")
