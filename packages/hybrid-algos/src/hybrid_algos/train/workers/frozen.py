"""Roles that only run forward passes: the reference policy (KL) and a reward model. They sleep with hybrid-core's
StateOffloader (weights to pinned host memory and back)."""

from __future__ import annotations

from typing import Any

import torch

from hybrid_core.offload import StateOffloader

from ..experience import Rollout
from ..models import load_causal_lm, load_reward_model, response_logprobs, sequence_scores
from .base import RoleWorker
from .policy import attn_implementation, forward_micro_batches


def _frozen_dtype(cfg) -> torch.dtype:
    return torch.bfloat16 if cfg.bf16 else torch.float32


class ReferenceWorker(RoleWorker):
    def setup(self, model_path: str) -> dict[str, Any]:
        model = load_causal_lm(model_path, dtype=_frozen_dtype(self.config), attn_implementation=attn_implementation(self.config),
                               trust_remote_code=self.config.trust_remote_code)
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.offloader = StateOffloader(self.model)
        self.settle()
        return self.where()

    @torch.no_grad()
    def logprobs(self, rollout: Rollout) -> torch.Tensor:
        out = torch.zeros(rollout.action_mask.shape, dtype=torch.float32)
        for mb, index in forward_micro_batches(rollout, self.config, self.device):  # by tokens with --use_dynamic_batch
            dev = mb.to(self.device)
            lp = response_logprobs(self.model, dev.sequences, dev.attention_mask, dev.response_len,
                                   temperature=self.config.temperature, packed=self.config.packing_samples)
            out[index, : mb.response_len] = lp.cpu()
        return out


class RewardModelWorker(RoleWorker):
    def setup(self, model_path: str) -> dict[str, Any]:
        model = load_reward_model(model_path, dtype=_frozen_dtype(self.config), attn_implementation=attn_implementation(self.config),
                                  trust_remote_code=self.config.trust_remote_code)
        self.model = model.to(self.device)
        self.offloader = StateOffloader(self.model)
        self.settle()
        return self.where()

    @torch.no_grad()
    def scores(self, rollout: Rollout) -> torch.Tensor:
        out = []
        for mb in rollout.micro_batches(self.config.micro_rollout_batch_size):
            mb = mb.to(self.device)
            out.append(sequence_scores(self.model, mb.sequences, mb.attention_mask).cpu())
        return torch.cat(out)
