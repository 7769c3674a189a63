"""Full weights of a PEFT-wrapped (LoRA) model as the engines and Hugging Face load them: merged, under base names.

A trained role's model may be a ``peft`` model (``get_peft_model(model, LoraConfig(...))``): its parameters are
named ``base_model.model.<hf name>``, each adapted linear layer holds ``base_layer.weight`` (frozen) beside its
``lora_A`` / ``lora_B`` weights. The engines and ``from_pretrained`` expect the base model's names and one weight per
layer, so the export merges every adapted layer, ``W + scaling * B @ A`` (per active adapter; transposed for
``fan_in_fan_out`` layers, as PEFT's own ``get_delta_weight``), and renames the rest. It works on the stream of
gathered ``(name, tensor)`` pairs a backend hands out (FSDP2's buckets, ZeRO-3's groups): a base weight is held
until its adapters' tensors arrive (they follow it in parameter order), so no more than one layer's parts are held.
What this code cannot merge exactly (DoRA and other LoRA variants, LoRA biases, adapted embeddings or convolutions,
``modules_to_save`` copies, an adapter already merged) is refused by name, never exported wrong.

For syncs that send the adapter alone (``hybrid_engines.weight_sync.adapter``), :func:`adapter_weights` hands out only
the adapter's A / B tensors, gathered whole, under PEFT's saved-adapter names (:func:`adapter_names`; the same
refusals first).

``peft`` is imported only when it is already loaded: a model wrapped by it cannot exist otherwise, so plain models
cost nothing and need no ``peft`` install.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from hybrid_core.errors import ConfigError

_ADAPTER_PARTS = ("lora_A", "lora_B")


@dataclass
class _Merge:
    """One adapted linear layer: its exported weight's name, and the parts of the merge (by parameter name)."""

    export: str
    fan_in_fan_out: bool
    scaling: dict[str, float]  # active adapter -> scaling
    parts: dict[str, tuple[str, str]] = field(default_factory=dict)  # param name -> ("weight", "") or (A|B, adapter)


@dataclass
class PeftExport:
    """How each parameter name of a PEFT model becomes an exported weight: renamed, a part of a merge, or dropped
    (an inactive adapter's weights: not part of what the model computes)."""

    renamed: dict[str, str]  # param name -> exported name
    merges: dict[str, _Merge]  # param name (every part) -> its layer's merge
    dropped: set[str]

    def names(self, metas: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> list[tuple[str, torch.dtype, tuple]]:
        """``(name, dtype, full shape)`` of the exported weights, from the model's own (no gather)."""
        out = []
        for name, dtype, shape in metas:
            if name in self.renamed:
                out.append((self.renamed[name], dtype, shape))
            elif name in self.merges and self.merges[name].parts[name][0] == "weight":
                out.append((self.merges[name].export, dtype, shape))
        return out

    def merged(self, weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The exported ``(name, tensor)`` stream of a backend's ``(param name, full tensor)`` stream."""
        pending: dict[str, dict[tuple[str, str], torch.Tensor]] = {}
        for name, tensor in weights:
            if name in self.renamed:
                yield self.renamed[name], tensor
            elif name in self.merges:
                merge = self.merges[name]
                got = pending.setdefault(merge.export, {})
                got[merge.parts[name]] = tensor
                if len(got) == len(merge.parts):
                    del pending[merge.export]
                    yield merge.export, _merged(merge, got)
            elif name not in self.dropped:
                raise ConfigError("peft", f"the backend exported {name!r}, which the PEFT model does not have.")
        if pending:
            raise ConfigError("peft", f"the weight export ended before these layers' adapters came: {sorted(pending)}.")


def _merged(merge: _Merge, parts: dict[tuple[str, str], torch.Tensor]) -> torch.Tensor:
    """``W + sum over active adapters of scaling * B @ A``, computed in float32, in ``W``'s dtype."""
    weight = parts[("weight", "")]
    delta = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    for adapter, scaling in merge.scaling.items():
        b_a = parts[("lora_B", adapter)].float() @ parts[("lora_A", adapter)].float()
        delta += scaling * (b_a.T if merge.fan_in_fan_out else b_a)
    return (weight.float() + delta).to(weight.dtype)


def peft_export(module: torch.nn.Module) -> PeftExport | None:
    """The export plan of ``module`` (a PEFT model, possibly sharded by FSDP2 or inside DeepSpeed), or None when no
    PEFT adapter is in it. Names are ``module.named_parameters()``'s; exported names are the transformers model's."""
    peft = sys.modules.get("peft")
    if peft is None:
        return None
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = {n: m for n, m in module.named_modules() if isinstance(m, BaseTunerLayer)}
    if not layers and not isinstance(module, peft.PeftModel):
        return None
    hf = module.get_base_model() if isinstance(module, peft.PeftModel) else module
    prefix = next(n for n, m in module.named_modules() if m is hf)
    prefix = f"{prefix}." if prefix else ""
    plan = PeftExport({}, {}, set())
    claimed: set[str] = set()
    for path, layer in layers.items():
        merge = _layer_merge(path, layer, LoraLinear, prefix)
        for pname, _ in layer.named_parameters(prefix=path):
            claimed.add(pname)
            part = _part_of(pname, path, layer)
            if part is None:
                plan.dropped.add(pname)  # an inactive adapter's weights
            elif part[0] == "bias":
                plan.renamed[pname] = _hf_name(f"{path}.bias", prefix)
            else:
                merge.parts[pname] = part
                plan.merges[pname] = merge
    for pname, _ in module.named_parameters():
        if pname not in claimed:
            plan.renamed[pname] = _hf_name(pname, prefix)
    leftover = [n for n in plan.renamed.values() if any(k in n for k in ("lora_", "base_layer", "modules_to_save"))]
    if leftover:
        raise ConfigError(
            "peft",
            f"these parameters are PEFT's and have no merged form here: {leftover[:4]}.",
            "Use plain LoRA on linear layers (no modules_to_save, no trainable tokens).",
        )
    return plan


def _layer_merge(path: str, layer: Any, lora_linear: Any, prefix: str) -> _Merge:
    """What merging one adapted layer takes, or a ConfigError for what cannot be merged exactly."""
    active = [a for a in layer.active_adapters if a in layer.lora_A]  # as PEFT's forward: the layer's own only
    problem = None
    if not isinstance(layer, lora_linear):
        problem = f"is a {type(layer).__name__}, not a LoRA linear layer"
    elif layer.merged:
        problem = "has its adapter merged into the base weight already"
    elif any(layer.lora_variant.get(a) is not None for a in active):
        problem = "uses a LoRA variant (DoRA, ...) whose merge is not W + scaling * B @ A"
    elif any(layer.lora_bias.get(a) for a in active):
        problem = "has a LoRA bias (lora_bias)"
    elif layer.disable_adapters:
        problem = "has its adapters disabled"
    if problem:
        raise ConfigError(
            "peft", f"{path} {problem}: its full weight cannot be exported.", "Use plain LoRA on linear layers."
        )
    scaling = {a: float(layer.scaling[a]) for a in active}
    return _Merge(_hf_name(f"{path}.weight", prefix), bool(layer.fan_in_fan_out), scaling)


def _part_of(pname: str, path: str, layer: torch.nn.Module) -> tuple[str, str] | None:
    """Which part of ``layer``'s merge ``pname`` is: ("weight", ""), ("bias", ""), (lora_A|lora_B, adapter), or None
    for an inactive adapter's."""
    rest = pname[len(path) + 1 :]
    if rest == "base_layer.weight":
        return ("weight", "")
    if rest == "base_layer.bias":
        return ("bias", "")
    kind, adapter, *_ = rest.split(".")
    if kind in _ADAPTER_PARTS:
        return (kind, adapter) if adapter in layer.active_adapters else None
    raise ConfigError("peft", f"{pname}: a PEFT parameter of unknown role in a LoRA layer.")


def _hf_name(name: str, prefix: str) -> str:
    return name[len(prefix) :] if name.startswith(prefix) else name


def hf_model(module: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a PEFT wrapper (``module`` itself otherwise): what saves a Hugging Face
    folder with the merged weights (a ``PeftModel`` would save only the adapter)."""
    peft = sys.modules.get("peft")
    return module.get_base_model() if peft is not None and isinstance(module, peft.PeftModel) else module


# ---- adapter-only weight sync (hybrid_engines.weight_sync.adapter) ------------------------------------------------
def adapter_names(module: torch.nn.Module) -> dict[str, str]:
    """Each adapter tensor of a PEFT model -- parameter name -> its wire name, PEFT's saved-adapter name
    (``base_model.model.<hf module>.lora_A.weight``) -- for syncs that send the adapter alone. What the engines could
    not apply as this one adapter (several active adapters, and everything :func:`peft_export` refuses: DoRA, LoRA
    biases, modules_to_save, ...) is a ConfigError naming it."""
    from hybrid_engines.weight_sync.adapter import PEFT_PREFIX

    plan = peft_export(module)
    if plan is None:
        raise ConfigError("peft", "adapter-only weight sync needs a PEFT (LoRA) model, and this one has no adapter.")
    names: dict[str, str] = {}
    for pname, merge in plan.merges.items():
        kind, _ = merge.parts[pname]
        if kind == "weight":
            continue
        if len(merge.scaling) != 1:
            raise ConfigError(
                "peft",
                f"{merge.export} has {len(merge.scaling)} active adapters; the engines apply one.",
                "Train one adapter, or use sync.lora merged (--lora_sync merged).",
            )
        names[pname] = f"{PEFT_PREFIX}{merge.export.removesuffix('.weight')}.{kind}.weight"
    return names


def adapter_metas(
    module: torch.nn.Module, names: dict[str, str], dtype: torch.dtype | None = None
) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """``(wire name, dtype, full shape)`` of the adapter tensors :func:`adapter_weights` hands out (no gather: ZeRO-3
    keeps the full shape aside, a DTensor's shape is the full one)."""
    return [
        (names[n], dtype or p.dtype, tuple(p.ds_shape) if hasattr(p, "ds_shape") else tuple(p.shape))
        for n, p in module.named_parameters()
        if n in names
    ]


def adapter_weights(
    module: torch.nn.Module, names: dict[str, str], dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapter's tensors alone, full, under their wire names (``dtype``: cast on the way, as the backend's full
    weights are). Only they are gathered -- ZeRO-3 partitions together in one group, FSDP2's DTensors one by one --,
    so a sync costs the adapter's bytes, not the model's; collective: every rank iterates together."""
    import contextlib

    params = [(n, p) for n, p in module.named_parameters() if n in names]
    partitioned = [p for _, p in params if hasattr(p, "ds_id")]  # ZeRO-3's
    gathered: Any = contextlib.nullcontext()
    if partitioned:
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None)
    with torch.no_grad(), gathered:
        for name, p in params:
            tensor = p.detach() if dtype is None else p.detach().to(dtype)
            full = getattr(tensor, "full_tensor", None)  # a DTensor (FSDP2): the all-gather of its shards
            yield names[name], full() if full is not None else tensor
