"""A stand-in for ``sglang.Engine`` on CPU that receives weights exactly as SGLang's scheduler does.

SGLang's engine cannot start on a CPU, but its weight-receiving contract is small and written down in its source
(``utils/common.py::init_custom_process_group``, ``model_runner_components/weight_updater.py``, ``weight_sync/
tensor_bucket.py``, ``utils/common.py::MultiprocessingSerializer`` / ``SafeUnpickler``, 0.5.16 and 0.5.23 alike).
:class:`WireEngine` implements that contract -- calling SGLang's own functions for it when SGLang is installed
(the ``sglang-contract`` env), torch's same calls otherwise -- so the adapter and the trainer's
``SGLangTransport`` are tested against the receiving side, not against themselves.
"""

from __future__ import annotations

import importlib.util
import io
import pickle
import sys
import types
from typing import Any

import torch


def _real_sglang() -> bool:
    module = sys.modules.get("sglang")
    if module is not None:  # another test's fake module has no file
        return getattr(module, "__file__", None) is not None
    return importlib.util.find_spec("sglang") is not None


HAVE_SGLANG = _real_sglang()

# SGLang's SafeUnpickler allow-list (0.5.16/0.5.23 ``utils/common.py``), the part a weight payload can touch.
ALLOWED_PREFIXES = (
    "builtins.",
    "collections.",
    "copyreg.",
    "functools.",
    "itertools.",
    "operator.",
    "types.",
    "weakref.",
    "torch.",
    "multiprocessing.resource_sharer.",
    "multiprocessing.reduction.",
    "sglang.srt.weight_sync.tensor_bucket.",
    "sglang.srt.utils.",
)


class _AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if any((module + ".").startswith(p) for p in ALLOWED_PREFIXES):
            return super().find_class(module, name)
        raise RuntimeError(f"SGLang's unpickler blocks {module}.{name}")


def deserialize(data: bytes) -> Any:
    if HAVE_SGLANG:
        from sglang.srt.utils.common import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()  # as the scheduler does before deserializing
        return MultiprocessingSerializer.deserialize(data)
    return _AllowListUnpickler(io.BytesIO(data)).load()


def join_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str, backend: str):
    if HAVE_SGLANG:
        from sglang.srt.utils.common import init_custom_process_group

        return init_custom_process_group(
            backend=backend,
            init_method=f"tcp://{master_address}:{master_port}",
            world_size=world_size,
            rank=rank,
            group_name=group_name,
        )
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        default_pg_timeout,
        rendezvous,
    )

    store, rank, world_size = next(
        rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=default_pg_timeout)
    )
    store.set_timeout(default_pg_timeout)
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        PrefixStore(group_name, store),
        group_name=group_name,
        backend_options=None,
        timeout=default_pg_timeout,
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def unflatten(flat: torch.Tensor, metadata) -> list[tuple[str, torch.Tensor]]:
    if HAVE_SGLANG:
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

        meta = [
            FlattenedTensorMetadata(
                name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx, end_idx=m.end_idx, numel=m.numel
            )
            for m in metadata
        ]
        return FlattenedTensorBucket(flattened_tensor=flat, metadata=meta).reconstruct_tensors()
    return [(m.name, flat[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape)) for m in metadata]


class WireEngine:
    """``sglang.Engine`` for weight sync on CPU: its group, its flattened-bucket broadcast and its serialized
    ``update_weights_from_tensor`` payloads; memory calls and flushes are recorded. ``sessions``: 0.5.23's
    begin/end weight-update session is required around updates (0.5.16: no such methods)."""

    sessions = True

    def __init__(self, **kwargs: Any):
        self.kwargs, self.calls, self.weights, self.groups = kwargs, [], {}, {}
        self._in_session = False

    def _session_ok(self, what: str):
        if self.sessions and not self._in_session:
            return False, f"{what} must run between begin_weight_update() and end_weight_update()"
        return None

    def begin_weight_update(self):
        self._in_session = True
        return True, "ok"

    def end_weight_update(self):
        self._in_session = False
        return True, "ok"

    def init_weights_update_group(
        self, master_address, master_port, rank_offset, world_size, group_name, backend="nccl"
    ):
        self.calls.append("init_weights_update_group")
        self.groups[group_name] = join_group(master_address, master_port, rank_offset, world_size, group_name, backend)
        return True, "Succeeded to initialize custom process group."

    def update_weights_from_distributed(
        self, names, dtypes, shapes, group_name="weight_update_group", flush_cache=True, load_format=None
    ):
        self.calls.append("update_weights_from_distributed")
        refused = self._session_ok("update_weights_from_distributed")
        if refused:
            return refused
        if load_format != "flattened_bucket":
            return False, f"this stand-in receives flattened buckets only, got {load_format!r}"
        # 0.5.16: FlattenedTensorBucket(named_tensors=empties) (a torch.cat of their bytes); 0.5.23: .empty(...)
        named = [(n, torch.empty(s, dtype=getattr(torch, d))) for n, d, s in zip(names, dtypes, shapes)]
        flat = torch.cat([t.flatten().view(torch.uint8) for _, t in named])
        metadata, offset = [], 0
        for n, t in named:
            size = t.numel() * t.element_size()
            metadata.append(
                types.SimpleNamespace(
                    name=n, shape=t.shape, dtype=t.dtype, start_idx=offset, end_idx=offset + size, numel=size
                )
            )
            offset += size
        torch.distributed.broadcast(flat, src=0, group=self.groups[group_name])
        self.weights.update({n: t.clone() for n, t in unflatten(flat, metadata)})
        return True, "Succeeded to update parameter online."

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append("update_weights_from_tensor")
        refused = self._session_ok("update_weights_from_tensor")
        if refused:
            return refused
        obj = deserialize(named_tensors[0])  # TP rank 0's own payload
        self.weights.update({n: t.clone() for n, t in unflatten(obj["flattened_tensor"], obj["metadata"])})
        return True, "Success"

    def release_memory_occupation(self, tags=None):
        self.calls.append(("release", tuple(tags or ())))

    def resume_memory_occupation(self, tags=None):
        self.calls.append(("resume", tuple(tags or ())))

    def flush_cache(self):
        self.calls.append("flush_cache")
        return types.SimpleNamespace(success=True)

    def shutdown(self):
        for pg in self.groups.values():
            try:
                torch.distributed.destroy_process_group(pg)
            except Exception:
                pass
        self.groups = {}


class WireEngine0516(WireEngine):
    sessions = False

    def __getattribute__(self, name):
        if name in ("begin_weight_update", "end_weight_update"):
            raise AttributeError(name)
        return super().__getattribute__(name)


def install(version: str = "0.5.23") -> None:
    """Make ``sglang.Engine`` the stand-in in this process (the real package stays importable for its receive code)."""
    if HAVE_SGLANG:
        import sglang as module
    else:
        module = sys.modules.setdefault("sglang", types.ModuleType("sglang"))
    module.Engine = WireEngine if version == "0.5.23" else WireEngine0516
