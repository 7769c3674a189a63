"""The critic role (PPO): a value model under its trainer backend (DeepSpeed or FSDP2) with sleep, per-token
values and clipped value updates; under LoRA (the actor's ``--lora_rank``, as OpenRLHF's one flag for both) PEFT
adapters on its backbone, its value head training whole beside them (:mod:`hybrid_algos.train.lora`).

It reads the trainer and algorithm sections, the rollout's batch shape (``settings.rollout``), the run's seed and
deadline (``settings.run``) and ``settings.models.trust_remote_code``."""

from __future__ import annotations

import os
from typing import Any

import torch

from ... import clipped_value_loss
from ..deepspeed_setup import close_rendezvous, init_distributed, local_device
from ..experience import Rollout
from ..models import load_critic, response_values
from ..trainer_backends.registry import (
    activation_checkpointing_by_loader,
    make_offloader,
    make_training_engine,
    model_dtype,
)
from ..update_guard import UpdateGuard
from .base import RoleWorker
from .policy import (
    ADAPTER_DIR,
    DeviceMeans,
    attn_implementation,
    forward_micro_batches,
    train_micro_batches,
    update_shape,
)


class CriticWorker(RoleWorker):
    def setup(self, model_path: str, master_addr: str, master_port: int, total_steps: int) -> dict[str, Any]:
        settings, trainer = self.settings, self.trainer
        store = init_distributed(
            self.rank, self.world_size, master_addr, master_port, timeout_s=settings.run.call_timeout_s
        )
        model = load_critic(  # on the host: DeepSpeed or fully_shard moves it (FSDP2: shard by shard)
            model_path,
            dtype=model_dtype(trainer),
            attn_implementation=attn_implementation(trainer),
            gradient_checkpointing=activation_checkpointing_by_loader(trainer),
            trust_remote_code=settings.models.trust_remote_code,
        )
        if trainer.lora:  # the adapters and the value head train, the base is frozen
            from ..lora import apply_lora

            model = apply_lora(model, trainer, value_head=True)
        self.engine = make_training_engine(  # the actor's schedule (lr_warmup_ratio, lr_scheduler)
            trainer,
            model,
            trainer.critic_lr,
            update_shape(settings.rollout, self.world_size, total_steps),
            local_device(),
        )
        if trainer.moves_states:  # the residency plan says when
            self.offloader = make_offloader(trainer, self.engine)
        close_rendezvous(store, self.rank, self.world_size)  # the group formed: its store stops listening
        self.freeze_gc()
        return self.where()

    @torch.no_grad()
    def values(self, rollout: Rollout) -> torch.Tensor:
        micro_batch = self.settings.rollout.micro_rollout_batch_size
        self.engine.eval()
        out = torch.zeros(rollout.action_mask.shape, dtype=torch.float32)
        for mb, index in forward_micro_batches(rollout, self.trainer, micro_batch, self.device):
            dev = mb.to(self.device)
            v = response_values(
                self.engine, dev.sequences, dev.attention_mask, dev.response_len, packed=self.trainer.packing
            )
            out[index, : mb.response_len] = v.cpu()
        return out

    def train(self, rollout: Rollout, step: int) -> dict[str, float]:
        """Clipped value-loss epochs, one optimizer update per train_batch_size samples (micro-batches as the
        actor's: fixed size, or by token budget with ``trainer.dynamic_batch``)."""
        shape, algo = self.settings.rollout, self.algorithm
        self.engine.train()
        guard = UpdateGuard(self.role, self.rank)  # in place of DeepSpeed's per-tensor overflow scan
        stats = DeviceMeans()
        gen = torch.Generator().manual_seed(self.settings.run.seed * 100019 + step * 137 + self.rank)
        per_update = shape.train_batch_size // self.world_size
        by_tokens = algo.value_agg_mode == "token-mean"
        for _ in range(shape.max_epochs):
            order = torch.randperm(rollout.batch_size, generator=gen)
            shuffled = rollout.select(order)
            for start in range(0, shuffled.batch_size, per_update):
                plan = train_micro_batches(
                    shuffled.select(slice(start, start + per_update)),
                    self.trainer,
                    shape.micro_train_batch_size,
                    self.device,
                    mask_of=lambda r: r.action_mask,
                    by_tokens=by_tokens,
                )
                for i, (mb, weight) in enumerate(plan):
                    mb = mb.to(self.device)
                    values = response_values(
                        self.engine, mb.sequences, mb.attention_mask, mb.response_len, packed=self.trainer.packing
                    )
                    loss, info = clipped_value_loss(
                        values,
                        mb.values,
                        mb.returns,
                        mb.action_mask,
                        clip=algo.value_clip,
                        agg_mode=algo.value_agg_mode,
                        norm_len=shape.generate_max_len,
                    )
                    guard.add_loss(loss)
                    self.engine.set_gradient_accumulation_boundary(i == len(plan) - 1)
                    self.engine.backward(loss * weight)
                    guard.step(self.engine, step)
                    stats.add("critic/value_loss", loss)
                    stats.add("critic/clip_frac", info.get("clip_frac", 0.0))
        stats.add("critic/lr", self.engine.get_lr()[0])
        return stats.result()

    def save_checkpoint(self, path: str, tag: str) -> None:
        """The backend's state under ``path`` (a resume loads it: adapters, head and optimizer); under LoRA also the
        adapters and the value head alone in ``path/adapter`` (PEFT's format: ``PeftModel.from_pretrained`` over the
        critic's base model, ``models.load_critic``)."""
        self.engine.save_checkpoint(path, tag)
        if self.trainer.lora:
            self.save_adapter(os.path.join(path, ADAPTER_DIR))

    def save_adapter(self, path: str) -> None:
        """The trained parameters alone -- adapters and value head, gathered full; every rank iterates together,
        rank 0 writes -- in PEFT's format."""
        from ..trainer_backends.peft_weights import adapter_weights

        module = self.engine.module
        names = {n: n for n, p in module.named_parameters() if p.requires_grad}
        state = {n: t.detach().to("cpu", copy=True) for n, t in adapter_weights(module, names)}
        if self.rank == 0:
            module.save_pretrained(path, state_dict=state)

    def load_checkpoint(self, path: str, tag: str) -> None:
        try:
            self.engine.load_checkpoint(path, tag)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"critic rank {self.rank}: {e}") from e
