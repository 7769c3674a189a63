"""Roles that only run forward passes: the reference policy (KL) and a reward model. Whole on each worker's GPU, or,
where the trainers' parameters are sharded (``trainer.zero_stage`` 3, or ``trainer.backend`` fsdp2) and the role has
several ranks, sharded over them by the trainers' backend (``trainer_backends.registry.shard_frozen``: ZeRO-3 as
OpenRLHF shards them, :mod:`.zero3_frozen`, or FSDP2's ``fully_shard``). Whole, they sleep with hybrid-core's
StateOffloader; sharded, with their backend's offloader (this rank's shards to pinned host memory and back).

They read the trainer section, ``settings.rollout`` (micro-batch size, sampling temperature), the run's deadline
(``settings.run.call_timeout_s``) and ``settings.models.trust_remote_code``."""

from __future__ import annotations

from typing import Any

import torch

from hybrid_core.offload import StateOffloader

from ..deepspeed_setup import close_rendezvous, init_distributed
from ..experience import Rollout
from ..models import load_causal_lm, load_reward_model, response_logprobs, sequence_scores
from ..trainer_backends.fsdp2_frozen import local_numel
from ..trainer_backends.registry import frozen_sharded, shard_frozen
from ..vision import rollout_pixels
from .base import RoleWorker
from .policy import attn_implementation, forward_micro_batches
from .settings import TrainerSettings


def _frozen_dtype(trainer: TrainerSettings) -> torch.dtype:
    return torch.bfloat16 if trainer.bf16 else torch.float32


class FrozenWorker(RoleWorker):
    """What the reference and the reward model share: how the model is built and where its parameters live."""

    @property
    def sharded(self) -> bool:
        """The trainers' backend shards this role's parameters over its ranks (the memory model's rule, so the plan
        counts 1/N)."""
        return frozen_sharded(self.trainer, self.world_size)

    def setup(
        self, model_path: str, master_addr: str | None = None, master_port: int | None = None, total_steps: int = 0
    ) -> dict[str, Any]:
        """Load the model. ``master_addr`` / ``master_port``: the role's rendezvous (as the trainers get it), used
        only when the role is sharded; ``total_steps`` is the trainers' and means nothing here."""
        self.model_path = model_path  # its image processor, for vision-language rollouts
        if not self.sharded:
            self.model = self.load(model_path).to(self.device)
            self.offloader = StateOffloader(self.model)
            self.freeze_gc()
            return self.where()
        if master_addr is None or master_port is None:
            raise ValueError(
                f"{self.role}: sharded ({self.trainer.backend}) over {self.world_size} ranks, setup needs the "
                "role's rendezvous (master_addr, master_port)"
            )
        settings = self.settings
        store = init_distributed(
            self.rank, self.world_size, master_addr, master_port, timeout_s=settings.run.call_timeout_s
        )
        # the forward goes through the sharded module's hooks (DeepSpeed's engine, or FSDP2's units)
        self.model, self.offloader = shard_frozen(
            self.trainer, self.load(model_path), self.device, micro_batch=settings.rollout.micro_rollout_batch_size
        )
        close_rendezvous(store, self.rank, self.world_size)
        self.freeze_gc()
        return self.where()

    def load(self, model_path: str) -> torch.nn.Module:
        raise NotImplementedError

    def held_params(self) -> int:
        """Parameter values this rank holds on its device (its shards when sharded): what the plan counts."""
        module = getattr(self.model, "module", self.model)
        if any(hasattr(p, "ds_tensor") for p in module.parameters()):  # ZeRO-3's partitions
            return sum(p.ds_tensor.numel() for p in module.parameters())
        return local_numel(module)  # FSDP2's shards, or the whole model


class ReferenceWorker(FrozenWorker):
    def load(self, model_path: str) -> torch.nn.Module:
        model = load_causal_lm(
            model_path,
            dtype=_frozen_dtype(self.trainer),
            attn_implementation=attn_implementation(self.trainer),
            trust_remote_code=self.settings.models.trust_remote_code,
        )
        return model.eval().requires_grad_(False)

    @torch.no_grad()
    def logprobs(self, rollout: Rollout) -> torch.Tensor:
        # sharded: every rank runs the same number of forwards (equal shards, and the token-budget micro-batch
        # count is agreed across the role's group), or ZeRO-3's / FSDP2's gathers would wait for a rank that is done
        out = torch.zeros(rollout.action_mask.shape, dtype=torch.float32)
        micro_batch = self.settings.rollout.micro_rollout_batch_size
        rollout = rollout_pixels(rollout, self)  # a vision-language rollout's pixel values (train/vision.py)
        batches = forward_micro_batches(rollout, self.trainer, micro_batch, self.device)
        for mb, index in batches:  # by tokens with trainer.dynamic_batch
            dev = mb.to(self.device)
            lp = response_logprobs(
                self.model,
                dev.sequences,
                dev.attention_mask,
                dev.response_len,
                temperature=self.settings.rollout.temperature,
                packed=self.trainer.packing,
                images=mb.images,
            )
            out[index, : mb.response_len] = lp.cpu()
        return out


class RewardModelWorker(FrozenWorker):
    def load(self, model_path: str) -> torch.nn.Module:
        return load_reward_model(
            model_path,
            dtype=_frozen_dtype(self.trainer),
            attn_implementation=attn_implementation(self.trainer),
            trust_remote_code=self.settings.models.trust_remote_code,
        )

    @torch.no_grad()
    def scores(self, rollout: Rollout) -> torch.Tensor:
        out = []
        for mb in rollout.micro_batches(self.settings.rollout.micro_rollout_batch_size):
            mb = mb.to(self.device)
            out.append(sequence_scores(self.model, mb.sequences, mb.attention_mask).cpu())
        return torch.cat(out)
