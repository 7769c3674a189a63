"""ZeRO-3 for the frozen roles (reference, reward model): their parameters sharded over the role's ranks, as OpenRLHF
shards them (its reference and reward models are DeepSpeed inference engines with the trainers' ``--zero_stage``), so
a 70B reference on 4 GPUs holds a quarter of its weights on each, gathering one layer at a time for its forward.

The memory model decides the same way (:func:`hybrid_core.residency.memory.frozen_shards`, which
``trainer_backends.registry`` asks for the worker): sharded under ``trainer.zero_stage`` 3 with more than one rank;
with one rank there is nothing to split and the worker keeps the model whole. (Under ``trainer.backend`` fsdp2 the
frozen roles are sharded by ``fully_shard`` instead: ``trainer_backends/fsdp2_frozen.py``.)

DeepSpeed cannot offload the states of an engine without an optimizer (``offload_states`` asserts), so the residency
plan's moves of a sharded frozen model go through :class:`ShardOffloader`: hybrid-core's ``StateOffloader`` over each
parameter's ZeRO-3 partition (``ds_tensor``), which DeepSpeed gathers from at every forward.
"""

from __future__ import annotations

from typing import Any

import torch

from hybrid_core.offload import AsleepError, StateOffloader

from .settings import TrainerSettings


def frozen_deepspeed_config(trainer: TrainerSettings, *, micro_batch: int) -> dict[str, Any]:
    """The DeepSpeed config of a sharded frozen model: ZeRO-3 without an optimizer (an inference engine). Every
    parameter is partitioned (persistence threshold 0, as the trainers configure it), so a rank holds 1/N of all of
    them, which is what the memory model counts."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": bool(trainer.bf16)},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def sharded_engine(model: torch.nn.Module, config: dict[str, Any]):
    """``model`` (loaded in host memory) as a ZeRO-3 inference engine over the process group already initialised.

    The parameters are converted to ZeRO-3 ones first, one at a time (each goes to the GPU, is partitioned, and only
    this rank's shard stays): ``deepspeed.initialize`` on a plain module would move the whole model to the GPU before
    partitioning it, which is what a model too big for one GPU cannot survive."""
    import deepspeed

    deepspeed.zero.Init(module=model, config_dict_or_path=config)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return engine


class ShardOffloader:
    """The residency moves of a sharded frozen model: this rank's parameter shards (and the module's buffers) to
    pinned host memory and back, through hybrid-core's ``StateOffloader``; a forward while they are away raises
    :class:`~hybrid_core.offload.AsleepError` (DeepSpeed would gather from freed memory)."""

    def __init__(self, module: torch.nn.Module, device: torch.device):
        self.inner = StateOffloader(_Shards(module), device=device)
        self._hook = module.register_forward_pre_hook(self._refuse, prepend=True)  # before ZeRO-3 gathers

    def _refuse(self, *_args, **_kwargs) -> None:
        if self.inner.asleep:
            raise AsleepError("the frozen model's shards are offloaded (asleep): reload them before a forward.")

    @property
    def asleep(self) -> bool:
        return self.inner.asleep

    def device_bytes(self) -> int:
        return self.inner.device_bytes()

    def offload(self, states=("params",)):
        return self.inner.offload(states)

    def reload(self, states=None):
        return self.inner.reload(states)

    def sleep(self):
        return self.inner.sleep()

    def wake(self):
        return self.inner.wake()


class _Shards(torch.nn.Module):
    """What a rank of a sharded frozen model holds, as buffers a ``StateOffloader`` moves: every parameter's ZeRO-3
    partition (the very tensor objects DeepSpeed gathers from, so their storage moving is seen there) and the
    module's own buffers (rotary tables: not partitioned)."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        for i, p in enumerate(module.parameters()):
            self.register_buffer(f"shard{i}", p.ds_tensor, persistent=False)
        for i, b in enumerate(module.buffers()):
            self.register_buffer(f"buffer{i}", b, persistent=False)
