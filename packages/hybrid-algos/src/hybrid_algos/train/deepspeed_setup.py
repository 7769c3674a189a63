"""DeepSpeed for the trained roles (actor, critic): distributed init, the engine config, the engine itself.

The optimizer is declared in the DeepSpeed config (not passed in) because ``engine.offload_states()`` — the trainer's
sleep — only works with DeepSpeed's own optimizer.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch


def local_device() -> torch.device:
    """The worker's device: Ray gives each GPU worker CUDA_VISIBLE_DEVICES of its own GPU, so it is cuda:0."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int, *, timeout_s: float):
    """Join the role's torch.distributed group (NCCL on GPU, gloo on CPU) with a timeout on every collective.

    ``master_addr`` is the group's rendezvous host (:func:`hybrid_core.rendezvous.choose`: 127.0.0.1 on one node):
    the store is made here, listening on that address only, rather than by torch's ``env://`` (which binds every
    interface), and the gloo / NCCL sockets are pointed at the same interface. Returns the store: call
    :func:`close_rendezvous` once set-up made every group."""
    import deepspeed
    import torch.distributed as dist

    from hybrid_core import rendezvous

    timeout = timedelta(seconds=timeout_s)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK="0",
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
    )
    rendezvous.use_interface(rendezvous.bind_address(master_addr))
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if dist.is_initialized():  # a second set-up in this process (DeepSpeed keeps the group it has)
        deepspeed.init_distributed(dist_backend=backend, timeout=timeout, verbose=False)
        return None
    store = rendezvous.open_store(
        master_addr,
        master_port,
        world_size,
        is_master=rank == 0,
        timeout=timeout,
        what=f"DeepSpeed group rank {rank}/{world_size}",
    )
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    deepspeed.init_distributed(dist_backend=backend, timeout=timeout, verbose=False)  # takes the group made here
    return store


def close_rendezvous(store, rank: int, world_size: int) -> None:
    """End of a role's set-up: build every group's communicator now, then close the store (rank 0 stops listening
    once every rank is done with it)."""
    from hybrid_core import rendezvous

    if store is None or store.closed:
        return
    rendezvous.form_groups(local_device())
    store.close_when_formed(rank, world_size)


def deepspeed_config(
    *,
    zero_stage: int,
    bf16: bool,
    micro_batch: int,
    grad_accum: int,
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
    max_norm: float,
    adam_offload: bool,
    warmup_steps: int = 0,
    num_params: int | None = None,
    lr_scheduler: str = "constant_with_warmup",
    total_updates: int = 0,
    min_lr_ratio: float = 0.1,
    bf16_master_weights: bool = False,
    bf16_optimizer_states: bool = False,
) -> dict[str, Any]:
    """The DeepSpeed config of a trained role. ``bf16_master_weights`` / ``bf16_optimizer_states``: the ZeRO
    optimizer keeps its master weights and gradients (and Adam's m, v) in bf16 -- DeepSpeed's
    ``bf16.bf16_master_weights_and_grads`` / ``bf16.bf16_optimizer_states`` (``TrainerSettings`` checks the combinations
    DeepSpeed accepts; under CPU Adam, DeepSpeed then builds it with ``fp32_optimizer_states`` off by itself)."""
    # Communication buckets no larger than the model: DeepSpeed allocates them whole (5e8 elements = 2 GB in fp32).
    # (rounded up to a multiple of 4096: DeepSpeed wants multiples of its alignment factor).
    bucket = int(min(5e8, -(-num_params // 4096) * 4096)) if num_params else int(5e8)
    zero: dict[str, Any] = {
        "stage": zero_stage,
        "reduce_bucket_size": bucket,
        "allgather_bucket_size": bucket,
        "overlap_comm": False,
    }
    if zero_stage == 3:
        zero.update(
            stage3_gather_16bit_weights_on_model_save=True,
            stage3_param_persistence_threshold=0,
            stage3_prefetch_bucket_size=int(min(5e7, bucket)),
        )
    if adam_offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "zero_optimization": zero,
        # check_grad_overflow off: DeepSpeed's scan of every gradient tensor before each step is replaced by one
        # check per update in the workers (update_guard.py), which ends the run on a NaN/inf instead of skipping
        "bf16": {
            "enabled": bool(bf16),
            **({"check_grad_overflow": False} if bf16 else {}),
            **({"bf16_master_weights_and_grads": True} if bf16_master_weights else {}),
            **({"bf16_optimizer_states": True} if bf16_optimizer_states else {}),
        },
        "gradient_clipping": max_norm,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": list(betas), "weight_decay": weight_decay}},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if lr_scheduler == "cosine_with_min_lr" and total_updates > 0:
        params: dict[str, Any] = {
            "total_num_steps": int(total_updates),
            "warmup_num_steps": max(1, int(warmup_steps)),
            "warmup_min_ratio": 0.0,
            "cos_min_ratio": float(min_lr_ratio),
            "warmup_type": "linear",
        }
        if warmup_steps <= 0:
            # DeepSpeed warms up over at least 2 updates and sets the rate to 0 before the first: with no warm-up
            # asked, the warm-up runs at the full rate and the first update keeps the optimizer's own rate.
            params.update(warmup_min_ratio=1.0, last_batch_iteration=0)
        config["scheduler"] = {"type": "WarmupCosineLR", "params": params}
    elif warmup_steps > 0:
        config["scheduler"] = {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": 0.0,
                "warmup_max_lr": lr,
                "warmup_num_steps": warmup_steps,
                "warmup_type": "linear",
            },
        }
    return config


#: The oldest DeepSpeed a trained role runs on, the floor hybrid-algos[train] declares. 0.19.8 reports a non-finite
#: gradient norm as inf (``deepspeed.runtime.utils.combine_grad_norm_groups``); before it ZeRO turned an inf/NaN norm
#: into a finite 1.0 and applied the update, unseen by the update guard that replaces DeepSpeed's own scan
#: (update_guard.py). (The bf16 options came earlier: ``bf16_master_weights_and_grads`` and ``bf16_optimizer_states``
#: in 0.18.3, CPU Adam's bf16 moments under ``bf16_optimizer_states`` in 0.19.1; ``check_grad_overflow`` in 0.17.1.)
DEEPSPEED_FLOOR = "0.19.8"


def make_engine(model: torch.nn.Module, config: dict[str, Any]):
    import deepspeed

    from hybrid_core import versions

    versions.require(
        "deepspeed",
        deepspeed.__version__,
        DEEPSPEED_FLOOR,
        "a trained role (the update guard reads the gradient norm DeepSpeed reports for every update)",
    )
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=config
    )
    return engine
