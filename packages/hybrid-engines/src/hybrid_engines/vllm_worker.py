"""Code that runs inside each vLLM GPU worker: joins hybrid's weight-sync group and loads received weights.

vLLM 0.26 mixes the class named by ``LLM(worker_extension_cls="hybrid_engines.vllm_worker.HybridWorkerExtension")``
into its ``Worker`` class (``v1/worker/worker_base.py::WorkerWrapperBase.init_worker``) and refuses any attribute
that ``Worker`` already has, so every name here starts with ``hybrid_`` (a contract test checks there is no clash).
The adapter reaches these methods with ``LLM.collective_rpc("hybrid_...")``; arguments and results are plain
Python values so they survive vLLM's executors (in-process, multiprocessing, Ray).

Weights are loaded with the model's own ``load_weights``, so vLLM maps checkpoint names onto its fused parameters
(``q_proj``/``k_proj``/``v_proj`` -> ``qkv_proj``, TP sharding, tied embeddings) exactly as at start-up.

Verification (``hybrid_core.weight_sync.verify``, on unless the trainer sends without checksums): each worker
recomputes the trainer's checksums after the load over vLLM's own parameters where they hold a checkpoint tensor byte
for byte (``hybrid_engines.vllm_read_back``: under TP 1, the tensors vLLM's unquantized layers and default loader
store as sent, a stacked ``q_proj`` as its rows of ``qkv_proj``), so a stale or skipped load shows; elsewhere (TP > 1,
a padded vocabulary, quantized layers, a tensor the model's loader transforms, found at its first load) over the bytes
it received (the buckets it hands to ``load_weights``). ``_hybrid_result`` reports the parameters ``load_weights``
never reached after a level-2 sleep. A mismatch raises ``WeightSyncMismatch`` (after the whole stream, so the trainer
is not left waiting), naming the parameter.

LoRA (adapter-only sync, ``hybrid_engines.weight_sync.adapter``): ``hybrid_receive_adapter`` /
``hybrid_load_adapter_ipc`` receive the adapter's tensors over the same transports (checked against the trainer's
checksums over this worker's own copies of them, the tensors the adapter is built from), then build vLLM's
``LoRAModel`` from them in memory and put it in the worker's LoRA manager under the run's one adapter id, replacing
the previous one, by the steps of vLLM's own ``LRUCacheWorkerLoRAManager.add_adapter`` with the tensors in place of
its ``_load_adapter``'s file: ``LoRAModel.from_lora_tensors`` (what ``from_local_checkpoint`` ends in) with a
``PEFTHelper.from_dict`` of the run's LoRA config, the model's *unstacked* name mapper and its skipped prefixes, the
same check of module names; then the model manager's ``remove_adapter``, ``remove_oldest_adapter`` when full,
``add_adapter`` (which packs ``q_proj``/``k_proj``/``v_proj`` into ``qkv_proj``'s per-slice lists) and
``activate_adapter``. No file is written or read, and a request carrying that id finds it loaded. A sync whose tensors
do not pair up (an A without its B), name other modules than the last one or modules vLLM does not expect is
refused, naming them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from hybrid_core.weight_sync import SyncGroup, WeightReceiver

    from .vllm_read_back import VllmReadBack

#: Method names the adapter calls through ``collective_rpc`` (the contract test checks none exists on vLLM's Worker).
RPC_METHODS = (
    "hybrid_free_bytes",
    "hybrid_init_weight_group",
    "hybrid_close_weight_group",
    "hybrid_receive_weights",
    "hybrid_load_ipc",
    "hybrid_expect_full_reload",
    "hybrid_receive_adapter",
    "hybrid_load_adapter_ipc",
    "hybrid_release_kv_cache",
    "hybrid_reacquire_kv_cache",
)
#: The sleep-mode allocator's tag of the KV cache (vLLM 0.26 ``v1/worker/gpu_worker.py`` allocates it under it).
KV_TAG = "kv_cache"


class HybridWorkerExtension:
    """Mixed into vLLM's GPU ``Worker``: ``self`` is the worker (``self.device``, ``self.rank``, ``get_model()``)."""

    if TYPE_CHECKING:  # for mypy only: nothing is defined at run time (vLLM refuses names its Worker has)
        # what vLLM's Worker provides
        rank: int
        device: torch.device
        model_runner: Any
        model_config: Any

        def get_model(self) -> Any: ...

        # what the methods below set
        _hybrid_group: SyncGroup | None
        _hybrid_receiver: WeightReceiver | None
        _hybrid_missing: set[str]
        _hybrid_kv_released: Sequence[int]
        _hybrid_adapter_parts: dict[str, torch.Tensor]
        _hybrid_adapter_names: frozenset[str]
        _hybrid_reader: VllmReadBack | None

    # ---- introspection -------------------------------------------------------------------------------------------
    def hybrid_free_bytes(self) -> int:
        torch.cuda.synchronize(self._hybrid_device())
        return int(torch.cuda.mem_get_info(self._hybrid_device())[0])

    # ---- weight-sync group ---------------------------------------------------------------------------------------
    def hybrid_init_weight_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        backend: str,
        timeout_s: float,
        group_name: str,
    ) -> int:
        """Join the trainer's group as rank ``rank_offset + self.rank`` (as vLLM's own NCCL engine numbers workers:
        ``distributed/weight_transfer/nccl_common.py::worker_init_process_group``). Returns that rank."""
        from hybrid_core.weight_sync import create_sync_group

        self.hybrid_close_weight_group()
        rank = rank_offset + int(self.rank)
        self._hybrid_group = create_sync_group(
            master_address,
            master_port,
            rank,
            world_size,
            backend=backend,
            timeout_s=timeout_s,
            device=self._hybrid_device(),
            group_name=group_name,
        )
        return rank

    def hybrid_close_weight_group(self) -> None:
        group = getattr(self, "_hybrid_group", None)
        if group is not None:
            group.close()
        self._hybrid_group = None
        self._hybrid_receiver = None

    # ---- loading -------------------------------------------------------------------------------------------------
    def hybrid_expect_full_reload(self) -> int:
        """After a level-2 sleep: every parameter counts as missing until a load brings it (returns how many)."""
        self._hybrid_missing = {name for name, _ in self.get_model().named_parameters()}
        return len(self._hybrid_missing)

    def hybrid_receive_weights(
        self, metas: Sequence[tuple[str, str, Sequence[int]]], bucket_bytes: int, layerwise: bool
    ) -> dict[str, Any]:
        """Receive one broadcast sync (``WeightSender`` on the trainer's rank 0) and load it.

        ``layerwise``: wrap the load in vLLM 0.26's layerwise reload (``model_executor/model_loader/reload``, what its
        own NCCL/IPC weight-transfer engines do), which re-runs ``process_weights_after_loading`` per layer: needed for
        quantized or otherwise post-processed weights. Its loaders keep the received tensors until a layer is
        complete, so they get copies here (the receive buffers are reused).
        """
        from hybrid_core.weight_sync import TensorMeta, WeightReceiver

        group = getattr(self, "_hybrid_group", None)
        if group is None:
            raise RuntimeError(f"vLLM worker rank {self.rank}: no weight-sync group; call init_weight_update_group.")
        receiver = getattr(self, "_hybrid_receiver", None)
        if receiver is None or receiver.bucket_bytes != bucket_bytes:
            receiver = self._hybrid_receiver = WeightReceiver(group, bucket_bytes, self._hybrid_device())
        wanted = [TensorMeta(name, dtype, tuple(shape)) for name, dtype, shape in metas]
        model = self.get_model()
        reader = self._hybrid_read_back(model)
        loaded: set[str] = set()

        def load(pairs: list[tuple[str, torch.Tensor]]) -> None:
            if layerwise:
                pairs = [(name, t.clone()) for name, t in pairs]
            loaded.update(model.load_weights(pairs) or ())
            reader.calibrate(pairs)  # before the check reads back: a name's first load tells how vLLM stores it

        try:
            # under layerwise reload a layer's parameters are vLLM's own again once the layer is complete (read
            # back then); before, they are on the meta device behind wrapped loaders (None: the bytes received)
            with _on(self._hybrid_device()), self._hybrid_reload(layerwise):
                stats = receiver.receive(wanted, load, reader.for_sync(wanted))
        finally:
            reader.report()
        return self._hybrid_result(stats.bytes, stats.seconds, loaded)

    def hybrid_load_ipc(self, buckets: Sequence[Any]) -> dict[str, Any]:
        """Load the CUDA-IPC bucket (``hybrid_core.weight_sync.IpcBucket``) that lives on this worker's GPU.

        ``buckets`` holds one bucket per GPU (matched by GPU UUID: with TP > 1 each worker takes its own). Loads
        directly (no layerwise reload): a bucket may hold only part of a fused layer, which layerwise reload would
        finish with the rest of that layer uninitialised.
        """
        from hybrid_core.weight_sync import load_ipc_bucket

        mine = self._hybrid_my_bucket(buckets)
        model = self.get_model()
        reader = self._hybrid_read_back(model)
        loaded: set[str] = set()

        def load(pairs: list[tuple[str, torch.Tensor]]) -> None:
            loaded.update(model.load_weights(pairs) or ())
            reader.calibrate(pairs)  # before the check reads back: a name's first load tells how vLLM stores it

        try:
            with _on(self._hybrid_device()):
                stats = load_ipc_bucket(mine, load, reader.for_sync(meta for meta, _ in mine.entries))
        finally:
            if mine.last:
                reader.report()
        return self._hybrid_result(stats.bytes, stats.seconds, loaded)

    def _hybrid_my_bucket(self, buckets: Sequence[Any]) -> Any:
        """The bucket of ``buckets`` (one per GPU of the engine) that lives on this worker's GPU."""
        dev = self._hybrid_device()
        uuid = str(torch.cuda.get_device_properties(dev).uuid) if dev.type == "cuda" else ""  # "": CPU shm buckets
        mine = [b for b in buckets if b.handle is not None and b.handle.device_uuid == uuid]
        if not mine and buckets and all(b.handle is None for b in buckets):
            mine = list(buckets[:1])  # the sync's bare end marker (no tensors): every worker takes it
        if len(mine) != 1:
            raise RuntimeError(
                f"vLLM worker rank {self.rank} (GPU {uuid}): expected exactly one IPC bucket from this "
                f"GPU, got {len(mine)} of {len(buckets)}. Colocate a trainer rank with every engine "
                "worker's GPU, or use the broadcast path (update_weights)."
            )
        return mine[0]

    # ---- LoRA: the adapter alone ------------------------------------------------------------------------------
    def hybrid_receive_adapter(
        self,
        metas: Sequence[tuple[str, str, Sequence[int]]],
        bucket_bytes: int,
        peft_config: dict[str, Any],
        lora_id: int,
    ) -> dict[str, Any]:
        """Receive one broadcast adapter sync (the trainer's ``WeightSender`` of the adapter's tensors, under PEFT's
        saved-adapter names) and make it the adapter ``lora_id`` (see the module docstring)."""
        from hybrid_core.weight_sync import TensorMeta, WeightReceiver

        group = getattr(self, "_hybrid_group", None)
        if group is None:
            raise RuntimeError(f"vLLM worker rank {self.rank}: no weight-sync group; call init_weight_update_group.")
        receiver = getattr(self, "_hybrid_receiver", None)
        if receiver is None or receiver.bucket_bytes != bucket_bytes:
            receiver = self._hybrid_receiver = WeightReceiver(group, bucket_bytes, self._hybrid_device())
        parts: dict[str, torch.Tensor] = {}

        def load(pairs: list[tuple[str, torch.Tensor]]) -> None:
            for name, t in pairs:
                parts[name] = t.clone()  # the receive buffers are reused; the adapter is built after the stream

        with _on(self._hybrid_device()):
            stats = receiver.receive(
                [TensorMeta(name, dtype, tuple(shape)) for name, dtype, shape in metas], load, parts.get
            )
            self._hybrid_set_adapter(parts, peft_config, lora_id)
        return self._hybrid_result(stats.bytes, stats.seconds, set())

    def hybrid_load_adapter_ipc(
        self, buckets: Sequence[Any], peft_config: dict[str, Any], lora_id: int
    ) -> dict[str, Any]:
        """One CUDA-IPC bucket of an adapter sync (the one on this worker's GPU, as :meth:`hybrid_load_ipc`); the
        sync's last bucket makes the tensors received the adapter ``lora_id``."""
        from hybrid_core.weight_sync import load_ipc_bucket

        mine = self._hybrid_my_bucket(buckets)
        if mine.index == 0:
            self._hybrid_adapter_parts = {}  # a new sync
        parts = self._hybrid_adapter_parts

        def load(pairs: list[tuple[str, torch.Tensor]]) -> None:
            for name, t in pairs:
                parts[name] = t.clone()  # the trainer reuses the bucket once this returns

        with _on(self._hybrid_device()):
            stats = load_ipc_bucket(mine, load, parts.get)
            if mine.last:
                self._hybrid_adapter_parts = {}
                self._hybrid_set_adapter(parts, peft_config, lora_id)
        return self._hybrid_result(stats.bytes, stats.seconds, set())

    def _hybrid_set_adapter(self, tensors: dict[str, torch.Tensor], peft_config: dict[str, Any], lora_id: int) -> None:
        """vLLM's ``LoRAModel`` from ``tensors`` in memory, in the LoRA manager as ``lora_id`` (replacing the last)."""
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        names = frozenset(tensors)
        unpaired = sorted(n for n in names if _partner(n) not in names)
        before = getattr(self, "_hybrid_adapter_names", None)
        if unpaired or not names or (before is not None and names != before):
            changed = sorted(names ^ before) if before is not None else []
            raise RuntimeError(
                f"vLLM worker rank {self.rank}: the adapter sync brought {len(names)} tensors; unpaired: "
                f"{unpaired[:3]}; unlike the last sync's: {changed[:3]}. Send every lora_A with its lora_B, the "
                "same modules each sync."
            )
        manager = self.model_runner.lora_manager  # vLLM's LRUCacheWorkerLoRAManager (LLM(enable_lora=True))
        adapters = manager._adapter_manager  # its LRUCacheLoRAModelManager
        # PEFTHelper.from_local_dir's one addition to the file's config
        helper = PEFTHelper.from_dict({**peft_config, "vllm_max_position_embeddings": manager.max_position_embeddings})
        helper.validate_legal(manager.lora_config)  # the rank against max_lora_rank, as a file's config is checked
        model = adapters.model
        # As _load_adapter: the mapper without its q/k/v -> qkv_proj (gate/up -> gate_up_proj) fusion, so the names
        # stay q_proj... and add_adapter packs them into per-slice lists; the loading mapper would put all three
        # under one qkv_proj weight, which the merged layer's set_lora cannot take (IndexError in set_lora).
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        if mapper is not None:
            mapper = mapper.get_unstacked_mapper()
        lora = LoRAModel.from_lora_tensors(
            lora_model_id=lora_id,
            tensors=tensors,
            peft_helper=helper,
            device=str(self._hybrid_device()),  # already here: no round trip through host memory
            dtype=manager.lora_config.lora_dtype,
            model_vocab_size=manager.vocab_size,
            weights_mapper=mapper,
            skip_prefixes=getattr(model, "lora_skip_prefixes", None),
        )
        # from_local_checkpoint's check: a module no layer takes would be dropped silently by activate_adapter
        unexpected = _unexpected_lora_modules(
            lora.loras, adapters.supported_lora_modules, adapters.packed_modules_mapping
        )
        if unexpected:
            raise RuntimeError(
                f"vLLM worker rank {self.rank}: the adapter names modules vLLM's model has no LoRA layer for: "
                f"{unexpected[:3]}. Target only the model's linear layers (names as in the HF checkpoint)."
            )
        # LRUCacheWorkerLoRAManager.add_adapter from here on (the adapter replaced in place, as load_inplace=True)
        adapters.remove_adapter(lora.id)
        if len(adapters) + 1 > adapters.capacity:
            adapters.remove_oldest_adapter()
        adapters.add_adapter(lora)
        adapters.activate_adapter(lora.id)
        self._hybrid_adapter_names = names

    # ---- the KV cache alone (residency) --------------------------------------------------------------------------
    def hybrid_release_kv_cache(self) -> int:
        """Unmap the KV cache tensors' physical memory and keep everything else: vLLM's own ``sleep`` always takes
        the weights too, and it also drops the small bookkeeping buffers allocated under the same "kv_cache" tag
        (attention metadata, block tables), which are not refilled before they are read again.

        Only the allocations that back the KV cache tensors themselves are released. The sleep-mode allocator keeps
        each allocation's virtual address, so the CUDA graphs captured over the cache stay valid once
        :meth:`hybrid_reacquire_kv_cache` maps memory back. Returns the bytes released."""
        from vllm.device_allocator.cumem import CuMemAllocator, unmap_and_release

        torch.cuda.synchronize(self._hybrid_device())
        pools = CuMemAllocator.get_instance().pointer_to_data
        ptrs = self._hybrid_kv_pointers()
        freed = 0
        for ptr in ptrs:
            data = pools.get(ptr)
            if data is None:
                raise RuntimeError(
                    f"vLLM worker rank {self.rank}: a KV cache tensor is not in the sleep-mode pool "
                    "(built without enable_sleep_mode?): it cannot be released"
                )
            if not data.is_asleep:
                unmap_and_release(data.handle)
                data.is_asleep = True
                freed += int(data.handle[1])
        self._hybrid_kv_released = ptrs
        torch.cuda.empty_cache()
        return freed

    def hybrid_reacquire_kv_cache(self) -> int:
        """Map memory back under the released KV cache tensors and zero them, as vLLM allocated them (the prefix
        cache was reset: nothing in them is read before it is written again)."""
        from vllm.device_allocator.cumem import CuMemAllocator, create_and_map

        pools = CuMemAllocator.get_instance().pointer_to_data
        taken = 0
        for ptr in getattr(self, "_hybrid_kv_released", ()):
            data = pools[ptr]
            if data.is_asleep:
                create_and_map(data.handle)
                data.is_asleep = False
                taken += int(data.handle[1])
        self._hybrid_kv_released = ()
        for tensor in self._hybrid_kv_tensors():
            tensor.zero_()
        post = getattr(self.model_runner, "post_kv_cache_wake_up", None)
        if post is not None:  # what vLLM's own wake-up of the KV cache does next (FP8 KV scales)
            post()
        torch.cuda.synchronize(self._hybrid_device())
        return taken

    def _hybrid_kv_tensors(self) -> list:
        """The model runner's KV cache tensors (per layer; several may view one allocation)."""
        found, stack = [], [getattr(self.model_runner, "kv_caches", [])]
        while stack:
            item = stack.pop()
            if isinstance(item, torch.Tensor):
                found.append(item)
            elif isinstance(item, (list, tuple)):
                stack.extend(item)
            elif isinstance(item, dict):
                stack.extend(item.values())
        if not found:
            raise RuntimeError(f"vLLM worker rank {self.rank}: no KV cache tensors found on the model runner")
        return found

    def _hybrid_kv_pointers(self) -> list[int]:
        return sorted({t.untyped_storage().data_ptr() for t in self._hybrid_kv_tensors()})

    # ---- helpers -------------------------------------------------------------------------------------------------
    def _hybrid_device(self) -> torch.device:
        dev = getattr(self, "device", None) or torch.device("cuda")
        return dev if dev.type != "cuda" or dev.index is not None else torch.device("cuda", torch.cuda.current_device())

    def _hybrid_read_back(self, model: Any) -> VllmReadBack:
        """This worker's read-back of ``model``'s parameters (built once per model object; a new model gets a new
        one, keeping what calibration found). Nothing is read back where the TP size is unknown."""
        from .vllm_read_back import VllmReadBack

        reader = getattr(self, "_hybrid_reader", None)
        if reader is None or reader.model is not model:
            tp = getattr(getattr(self, "parallel_config", None), "tensor_parallel_size", None)  # vLLM's WorkerBase
            reader = self._hybrid_reader = VllmReadBack(model, tp if isinstance(tp, int) else None, reader)
        return reader

    def _hybrid_reload(self, layerwise: bool):
        return _LayerwiseReload(self.get_model(), self.model_config) if layerwise else _Nothing()

    def _hybrid_result(self, nbytes: int, seconds: float, loaded: set[str]) -> dict[str, Any]:
        # vLLM's own start-up check compares named_parameters() with what load_weights returned
        # (model_executor/model_loader/default_loader.py); the same comparison tells when a level-2 reload is whole.
        missing = getattr(self, "_hybrid_missing", None)
        if missing is not None:
            missing -= loaded
        left = sorted(missing) if missing else []
        return {
            "rank": int(self.rank),
            "bytes": int(nbytes),
            "seconds": float(seconds),
            "loaded": len(loaded),
            "missing_count": len(left),
            "missing": left[:5],
        }


class _LayerwiseReload:
    """vLLM's checkpoint-format reload around a load; finalized even when the load fails (restores untouched layers)."""

    def __init__(self, model: torch.nn.Module, model_config: Any):
        self.model, self.model_config = model, model_config

    def __enter__(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def __exit__(self, *exc: Any) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        torch.cuda.synchronize()


def _unexpected_lora_modules(
    modules: Iterable[str], supported: Iterable[str], packed_mapping: dict[str, list[str]]
) -> list[str]:
    """The parsed LoRA module names (``model.layers.0.self_attn.q_proj``) vLLM would refuse in an adapter's file:
    ``WorkerLoRAManager._load_adapter``'s expected names (a packed module stands for its parts: ``qkv_proj`` for
    ``q_proj``/``k_proj``/``v_proj``, never itself) checked as ``LoRAModel.from_local_checkpoint`` checks them."""
    expected: set[str] = set()
    for module in supported:
        expected.update(packed_mapping.get(module, [module]))
        if module == "experts":
            expected.add(module)
    unexpected = []
    for name in modules:
        if "base_layer" in name:  # PEFT's 3-D MoE layout (experts.base_layer: gate_up_proj), as vLLM skips it
            continue
        suffix = name[name.find(".experts") + 1 :] if ".experts" in name else name.rsplit(".", 1)[-1]
        if suffix not in expected:
            unexpected.append(name)
    return sorted(unexpected)


def _partner(name: str) -> str:
    """The other half of an adapter tensor: ``...lora_A.weight`` <-> ``...lora_B.weight``."""
    return name.replace(".lora_A.", ".lora_B.") if ".lora_A." in name else name.replace(".lora_B.", ".lora_A.")


def _on(device: torch.device):
    """Make ``device`` current while IPC handles are opened and tensors allocated (a CPU device: nothing to do)."""
    return torch.cuda.device(device) if device.type == "cuda" else _Nothing()


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None
