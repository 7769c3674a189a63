"""What a vLLM worker really holds for a checkpoint tensor: the weight-sync check's ``read_back`` on vLLM.

``hybrid_core.weight_sync.verify`` recomputes each checked tensor's checksum over ``read_back(name)`` -- the engine's
tensor filled for ``name`` -- when it gives one of the sent dtype and size, else over the bytes received. vLLM's
parameters are not the checkpoint's: ``load_weights`` (vLLM 0.26 ``AutoWeightsLoader`` with the model's
``hf_to_vllm_mapper``) stacks ``q_proj``/``k_proj``/``v_proj`` into one ``qkv_proj`` (shard ids "q", "k", "v") and
``gate_proj``/``up_proj`` into ``gate_up_proj`` (shard ids 0, 1), along dim 0 (the output dim), shards by tensor
parallel rank and pads the vocabulary. :class:`VllmReadBack` gives, for an HF name, the region of vLLM's own
parameter that holds that tensor byte for byte, and None wherever it does not or may not:

* a direct name (the same name in ``model.named_parameters()``: norms, ``o_proj``, ``down_proj``, embeddings): the
  whole parameter (a padded vocabulary has more rows than sent: the check then takes the bytes received);
* a stacked name: the dim-0 slice of the fused parameter for its shard, by the layer's own numbers --
  ``QKVParallelLinear._get_shard_offset_mapping`` / ``_get_shard_size_mapping`` (what its ``weight_loader_v2``
  uses; else the same sums of ``num_heads``, ``num_kv_heads``, ``head_size``, ``v_head_size`` its ``weight_loader``
  uses for the bias), ``MergedColumnParallelLinear.output_sizes`` divided by ``tp_size``. A dim-0 slice of a
  contiguous weight (or bias) is contiguous: a view, no copy;
* only under tensor parallel size 1: with TP > 1 each rank holds a shard of most tensors (their numel differs from
  the sent one anyway) and replicated KV heads, so nothing is read back;
* only where vLLM's loader copies the tensor as it came: the parameter's ``weight_loader`` is vLLM's
  ``default_weight_loader`` (or none, which means it), or the ``weight_loader`` / ``weight_loader_v2`` of one of
  vLLM's own (exact class, not a subclass or an out-of-tree replacement) unquantized linear or embedding layers.
  Quantized layers, LoRA-wrapped layers, a loader wrapped by layerwise reload (the layer not yet processed), a
  parameter on the meta device, another dtype or numel: None.

Checked at call time, not when the map was built: the map holds the module and the attribute name, so a parameter
that layerwise reload or ``process_weights_after_loading`` re-registered is looked up after the load.

A model whose ``load_weights`` transforms a tensor before the loader sees it (permutes, scales, adds to it) would
show a false mismatch, so every name is *calibrated* at its first load into this worker (:meth:`calibrate`, called
right after ``load_weights``, before the check reads back): the region's checksum is compared with that of the bytes
received, and a name whose region differs is "loaded with a transform" from then on -- never read back, checked over
the bytes received (which the sender's checksum still checks) -- and named in one warning (:meth:`report`). Only names
that passed calibration are read back, so a later sync's stale or skipped load of them (TRL #5312) is a mismatch.
Nothing here raises: a read-back bug must not fail a sync (it falls back to the bytes received, the check of before).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hybrid_core.weight_sync import TensorMeta
from hybrid_core.weight_sync.verify import ReadBack, tensors_checksums
from hybrid_core.weight_sync.wire import tensor_bytes

_log = logging.getLogger(__name__)

#: Where vLLM 0.26 defines the layers and the loader read back here (the classes' ``__module__``).
LINEAR_MODULE = "vllm.model_executor.layers.linear"
EMBEDDING_MODULE = "vllm.model_executor.layers.vocab_parallel_embedding"
DEFAULT_LOADER = ("vllm.model_executor.model_loader.weight_utils", "default_weight_loader")
#: Layers whose loaders copy a checkpoint tensor as it came under TP 1 (narrowing by rank 0 of 1: all of it).
FUSED_LAYERS = frozenset({"QKVParallelLinear", "MergedColumnParallelLinear"})
LAYERS = {
    LINEAR_MODULE: FUSED_LAYERS | {"ColumnParallelLinear", "RowParallelLinear", "ReplicatedLinear"},
    EMBEDDING_MODULE: frozenset({"VocabParallelEmbedding", "ParallelLMHead"}),
}
UNQUANTIZED = frozenset({"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"})
LOADER_METHODS = ("weight_loader", "weight_loader_v2")
#: The stacking of Llama/Qwen2's ``hf_to_vllm_mapper.orig_to_new_stacked`` (and of the ``stacked_params_mapping``
#: of the models that still spell it out), used when a model has no mapper of its own.
DEFAULT_STACKED: Mapping[str, tuple[str, str | int]] = {
    ".q_proj": (".qkv_proj", "q"),
    ".k_proj": (".qkv_proj", "k"),
    ".v_proj": (".qkv_proj", "v"),
    ".gate_proj": (".gate_up_proj", 0),
    ".up_proj": (".gate_up_proj", 1),
}


@dataclass(frozen=True)
class Region:
    """Where an HF tensor lives in vLLM: ``getattr(module, attr)`` rows ``offset:offset + rows`` (None: all)."""

    module: torch.nn.Module
    attr: str
    offset: int | None = None
    rows: int = 0


class VllmReadBack:
    """The read-back of one vLLM model (see the module docstring). ``tp_size``: the engine's tensor parallel size
    (None: unknown, nothing is read back). ``previous``: the reader of the model this one replaces, whose
    calibration carries over (names loaded with a transform stay so for the worker's life)."""

    def __init__(self, model: Any, tp_size: int | None, previous: VllmReadBack | None = None):
        self.model = model
        self.tp_size = tp_size
        self.transformed: set[str] = set(previous.transformed) if previous is not None else set()
        self.calibrated: set[str] = set(previous.calibrated) if previous is not None else set()
        self._new_transformed: list[str] = []
        self._lock = threading.Lock()  # an engine with max_concurrency > 1 may load two buckets at once
        self.regions: dict[str, Region] = {}
        if tp_size == 1:  # TP > 1: a rank's slice is not the whole HF tensor (its numel differs anyway)
            try:
                self.regions = build_regions(model)
            except Exception as e:  # an unexpected model: check the bytes received, as before
                _log.warning("weight sync verify: no read-back of vLLM's parameters (%s: %s)", type(e).__name__, e)

    def read_back(self, name: str) -> torch.Tensor | None:
        """vLLM's region holding ``name`` when it was calibrated and still copies as sent, else None."""
        return self._read(name, None)

    def for_sync(self, metas: Iterable[TensorMeta]) -> ReadBack:
        """:meth:`read_back` that also says None where the region's dtype or numel is not the sent tensor's."""
        try:
            sent = {m.name: m for m in metas}
        except Exception:
            sent = {}
        return lambda name: self._read(name, sent.get(name)) if name in sent else None

    def _read(self, name: str, meta: TensorMeta | None) -> torch.Tensor | None:
        try:
            if name not in self.calibrated or name in self.transformed:
                return None
            view = self._view(name)
            if view is None or (meta is not None and (view.dtype != meta.torch_dtype or view.numel() != meta.numel)):
                return None
            return view
        except Exception:
            return None

    def _view(self, name: str) -> torch.Tensor | None:
        """The region for ``name`` if vLLM's loader copies into it as sent (checked now), else None."""
        region = self.regions.get(name)
        if region is None:
            return None
        param = getattr(region.module, region.attr, None)
        if (
            not isinstance(param, torch.Tensor)
            or param.device.type == "meta"
            or not copies_as_sent(region.module, param)
        ):
            return None
        data = param.data
        if region.offset is not None:
            if data.dim() < 1 or region.offset + region.rows > data.shape[0]:
                return None
            data = data.narrow(0, region.offset, region.rows)
        return data if data.is_contiguous() else None

    def calibrate(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Right after ``load_weights(pairs)``: compare each name loaded for the first time with its region (one
        host read for all of them); a name whose region differs is loaded with a transform (never read back)."""
        try:
            todo = []
            for name, received in pairs:
                if name in self.calibrated or name in self.transformed:
                    continue
                view = self._view(name)
                if view is None or view.dtype != received.dtype or view.numel() != received.numel():
                    continue  # not read back now: calibrated at a load where it is
                todo.append((name, view, received))
            if not todo:
                return
            # the check's own checksums of both sides (one fused launch where the device has the kernel, no
            # temporary of the tensors' size), read once
            datas = [tensor_bytes(v) for _, v, _ in todo] + [tensor_bytes(r) for _, _, r in todo]
            sizes = [_word(v) for _, v, _ in todo] * 2
            sums = tensors_checksums(datas, sizes).tolist()
            differs = [a != b for a, b in zip(sums[: len(todo)], sums[len(todo) :])]
            with self._lock:
                for (name, _, _), bad in zip(todo, differs):
                    self.calibrated.add(name)
                    if bad:
                        self.transformed.add(name)
                        self._new_transformed.append(name)
        except Exception as e:
            _log.warning("weight sync verify: vLLM read-back calibration failed (%s: %s)", type(e).__name__, e)

    def report(self) -> list[str]:
        """Log one warning naming the parameters found loaded with a transform since the last report; returns them."""
        with self._lock:
            names, self._new_transformed = self._new_transformed, []
        if names:
            _log.warning(
                "weight sync verify: vLLM stores %d tensor(s) differently from what the trainer sends (its loader "
                "transforms them): %s%s. They are checked over the bytes received, not read back from vLLM.",
                len(names),
                ", ".join(names[:5]),
                f" and {len(names) - 5} more" if len(names) > 5 else "",
            )
        return names


def _word(tensor: torch.Tensor) -> int:
    """The checksum's word size for a whole tensor: its element size (as ``verify.word_size``)."""
    size = tensor.element_size()
    return size if size in (1, 2, 4, 8) else 1


def build_regions(model: Any) -> dict[str, Region]:
    """HF name -> region of vLLM's parameter, for the direct names and the stacked shards of ``model``."""
    stacked = _stacked_mapping(model)
    params = dict(model.named_parameters())  # deduplicated: a tied weight under its first name only
    regions: dict[str, Region] = {}
    fused: list[tuple[str, torch.nn.Module, str, torch.Tensor]] = []
    for prefix, module in model.named_modules():
        for attr, param in module.named_parameters(recurse=False):
            full = f"{prefix}.{attr}" if prefix else attr
            if params.get(full) is not param:
                continue
            regions[full] = Region(module, attr)
            if _layer_kind(module) in FUSED_LAYERS:
                fused.append((full, module, attr, param))
    for full, module, attr, param in fused:
        for hf_sub, (vllm_sub, shard) in stacked.items():
            if vllm_sub + "." not in full:
                continue
            hf = full.replace(vllm_sub + ".", hf_sub + ".", 1)
            if hf in params or _stack(hf, stacked) != (full, shard):
                continue  # not the name the model's loader maps onto this shard
            span = _shard_rows(module, shard, param)
            if span is not None:
                regions[hf] = Region(module, attr, *span)
    return regions


def _stacked_mapping(model: Any) -> Mapping[str, tuple[str, str | int]]:
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    stacked = getattr(mapper, "orig_to_new_stacked", None)
    return dict(stacked) if isinstance(stacked, Mapping) and stacked else DEFAULT_STACKED


def _stack(name: str, stacked: Mapping[str, tuple[str, str | int]]) -> tuple[str, str | int | None]:
    """``name`` through the stacked part of vLLM's ``WeightsMapper._map_name_with_shard`` (same order, same rule)."""
    shard: str | int | None = None
    for substr, (new, new_shard) in stacked.items():
        if substr in name:
            name = name.replace(substr, new, 1)
            shard = new_shard
    return name, shard


def _shard_rows(module: Any, shard: Any, param: torch.Tensor) -> tuple[int, int] | None:
    """(offset, rows) along dim 0 of this rank's part of shard ``shard`` in a fused ``param``, or None."""
    if getattr(param, "output_dim", None) != 0 or param.dim() < 1:
        return None
    total = int(param.shape[0])
    if _layer_kind(module) == "QKVParallelLinear":
        if shard not in ("q", "k", "v"):
            return None
        offsets, sizes = (
            getattr(module, "_get_shard_offset_mapping", None),
            getattr(module, "_get_shard_size_mapping", None),
        )
        if callable(offsets) and callable(sizes):  # what weight_loader_v2 uses
            offset, rows, end = offsets(shard), sizes(shard), offsets("total")
        else:  # the same sums, as weight_loader (the bias's loader) spells them
            heads, kv, size = int(module.num_heads), int(module.num_kv_heads), int(module.head_size)
            v_size = int(getattr(module, "v_head_size", size))
            starts = {"q": (0, heads * size), "k": (heads * size, kv * size), "v": ((heads + kv) * size, kv * v_size)}
            (offset, rows), end = starts[shard], (heads + kv) * size + kv * v_size
        if offset is None or rows is None or end != total:
            return None
        return int(offset), int(rows)
    if _layer_kind(module) == "MergedColumnParallelLinear":
        tp = int(getattr(module, "tp_size", 1))
        sizes = [int(s) // tp for s in module.output_sizes]
        if not isinstance(shard, int) or isinstance(shard, bool) or not 0 <= shard < len(sizes) or sum(sizes) != total:
            return None
        return sum(sizes[:shard]), sizes[shard]
    return None


def _layer_kind(module: Any) -> str | None:
    """The class name of one of vLLM's own linear/embedding layers (exact class), else None."""
    cls = type(module)
    return cls.__name__ if cls.__name__ in LAYERS.get(cls.__module__, ()) else None


def copies_as_sent(module: Any, param: torch.Tensor) -> bool:
    """Whether vLLM's loader of ``param`` copies a checkpoint tensor into it as it came (under TP 1)."""
    loader = getattr(param, "weight_loader", None)
    kind = _layer_kind(module)
    if kind is None:  # any other module: vLLM's default_weight_loader only (AutoWeightsLoader's when none is set)
        if getattr(module, "quant_method", None) is not None:
            return False
        return (
            loader is None or (getattr(loader, "__module__", None), getattr(loader, "__name__", None)) == DEFAULT_LOADER
        )
    if type(getattr(module, "quant_method", None)).__name__ not in UNQUANTIZED:
        return False
    if int(getattr(module, "tp_size", 1)) != 1:
        return False
    name = getattr(loader, "__name__", None)  # a bound method of this very layer, not a layerwise-reload wrapper
    return (
        name in LOADER_METHODS
        and getattr(loader, "__self__", None) is module
        and getattr(loader, "__func__", None) is getattr(type(module), str(name), None)
    )
