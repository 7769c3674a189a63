"""Shard a Hugging Face causal LM with FSDP2: ``fully_shard`` on every decoder layer, then on the root.

Each decoder layer is its own FSDP2 unit (gathered just before its forward, freed after), and the root holds what
remains (embeddings, final norm, LM head: tied weights stay in one unit). The master dtype is the dtype of the
sharded parameters, hence of their gradients and of the optimizer's moments; the compute dtype is what the
gathered parameters are cast to (``MixedPrecisionPolicy.param_dtype``). Activation checkpointing is transformers'
own (non-reentrant, which FSDP2 needs), so parameter names stay those of the checkpoint files.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid_core.errors import ConfigError


@dataclass(frozen=True)
class FSDP2Options:
    """``master_dtype``: sharded parameters, gradients and optimizer state (fp32, or bf16 to halve them).
    ``compute_dtype``: forward/backward (None: the master dtype). ``reduce_dtype``: gradient reduce-scatter (None:
    the compute dtype). ``reshard_after_forward``: free each layer's gathered parameters after its forward (and
    gather again for the backward); off keeps them until the backward, trading memory for one all-gather per layer.
    """

    master_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype | None = torch.bfloat16
    reduce_dtype: torch.dtype | None = torch.float32
    activation_checkpointing: bool = False
    reshard_after_forward: bool = True


def device_mesh(device: torch.device):
    """A 1-D mesh over every rank of the default process group, on ``device``'s type (cuda, or cpu with gloo)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise ConfigError(
            "trainer", "FSDP2 needs torch.distributed initialized first.", "Call init_distributed(...) before."
        )
    return init_device_mesh(device.type, (dist.get_world_size(),))


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: the modules whose class transformers lists in ``_no_split_modules``."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ConfigError(
            "trainer",
            f"{type(model).__name__} names no decoder layer class (_no_split_modules = {sorted(names)}), so FSDP2 "
            "would gather the whole model at once.",
            "Use a transformers causal LM that declares _no_split_modules.",
        )
    return layers


def shard_causal_lm(model: torch.nn.Module, mesh, options: FSDP2Options) -> torch.nn.Module:
    """Shard ``model`` in place over ``mesh`` (it becomes an ``FSDPModule``) and return it."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if options.activation_checkpointing:
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise ConfigError(
                "gradient_checkpointing",
                f"{type(model).__name__} does not support activation checkpointing.",
                "Turn gradient checkpointing off.",
            )
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = False  # training never reuses a KV cache; it would only hold memory
    model.to(options.master_dtype)
    policy = MixedPrecisionPolicy(param_dtype=options.compute_dtype, reduce_dtype=options.reduce_dtype)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=options.reshard_after_forward)
    # the root's parameters are gathered again right away by the backward: resharding them would only add a gather
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    return model
