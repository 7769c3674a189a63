"""A frozen role (reference, reward model) under FSDP2: its parameters sharded over the role's ranks, for forwards only.

The trainers' layout (``fully_shard`` per decoder layer, then the root) without what training needs: no optimizer,
no gradients, no mixed-precision policy (the parameters stay in the dtype they were loaded in, bf16 with
``trainer.bf16``, and the forward computes in it, as the unsharded model does), and every unit -- the root too --
resharded after its forward, so between passes a rank holds its 1/N shards only, which is what the memory model
counts. Each forward gathers one layer at a time (plus the next one, prefetched) and the root unit for the whole
pass, so every rank of the role must run the same number of forwards, as under ZeRO-3. It sleeps through
:class:`hybrid_core.offload.fsdp2_offload.FSDP2Offloader` (its ``params``: the shards and the buffers).
"""

from __future__ import annotations

import torch

from .fsdp2_setup import decoder_layers, device_mesh


def shard_frozen(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Shard ``model`` (loaded on the host, frozen) in place over every rank of the default group on ``device``."""
    from torch.distributed.fsdp import fully_shard

    mesh = device_mesh(device)
    model.requires_grad_(False).eval()
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)  # no backward follows: nothing stays gathered
    return model


def local_numel(module: torch.nn.Module) -> int:
    """Parameter values this rank holds: its shards' (a DTensor's ``numel`` is the full tensor's)."""
    from torch.distributed.tensor import DTensor

    return sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in module.parameters())
