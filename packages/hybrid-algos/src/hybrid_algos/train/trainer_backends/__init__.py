"""Trainer backends behind one surface (:class:`~.engine.TrainingEngine`): the train step a trained role drives.

The workers (``workers/policy.py``, ``workers/critic.py``) get theirs from :mod:`.registry` by ``trainer.backend``:
:mod:`.deepspeed_engine` adapts DeepSpeed's engine; :mod:`.fsdp2_engine` is the torch-native one (FSDP2's
``fully_shard``), set up by :mod:`.fsdp2_setup`, exporting weights bucket by bucket (:mod:`.fsdp2_weights`) and
checkpointing through ``torch.distributed.checkpoint`` (:mod:`.fsdp2_checkpoint`). Its sleep is
:class:`hybrid_core.offload.fsdp2_offload.FSDP2Offloader`; its frozen roles are sharded by :mod:`.fsdp2_frozen`.
A PEFT-wrapped model's full weights come out merged under either backend (:mod:`.peft_weights`).
"""

from .engine import TrainingEngine
from .fsdp2_engine import FSDP2Engine
from .fsdp2_setup import FSDP2Options, shard_causal_lm

__all__ = ["FSDP2Engine", "FSDP2Options", "TrainingEngine", "shard_causal_lm"]
