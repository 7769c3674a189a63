"""One finiteness check per optimizer update, in place of DeepSpeed's scan of every gradient tensor.

With bf16 (fp32's exponent range: nothing overflows that fp32 would not), DeepSpeed 0.19's ZeRO-1/2 still scans each
gradient tensor for inf/NaN before every optimizer step: an amax, an amin, two isfinite and an add per tensor, ~1,100
kernel launches for the 219 tensors of a 357M model, most of the host time between the end of the backward pass and
Adam (the profile of 2026-11-24, H100). The training loop turns that scan off (``bf16.check_grad_overflow``, see
:func:`~hybrid_algos.train.deepspeed_setup.deepspeed_config`) and checks twice per update instead, with one host read
each: the update's micro-batch losses before the step (a non-finite loss never reaches the optimizer), and the global
gradient norm DeepSpeed computes anyway for clipping after it. Either ends the run with :class:`NonFiniteUpdate`;
the run saves nothing of that step, so its last checkpoint is the state before the bad update.
"""

from __future__ import annotations

import math
from typing import Any

import torch


class NonFiniteUpdate(RuntimeError):
    """A trainer's update met a NaN or inf (loss or gradient norm); the message says what and what to do."""


class UpdateGuard:
    """Wraps a DeepSpeed engine's ``step()``: ``add_loss`` each micro-batch's loss, then ``step(engine, step)``."""

    def __init__(self, role: str, rank: int):
        self.role, self.rank = role, rank
        self._losses: list[torch.Tensor] = []

    def add_loss(self, loss: torch.Tensor) -> None:
        self._losses.append(loss.detach().float().reshape(()))

    def step(self, engine: Any, step: int) -> None:
        boundary = engine.is_gradient_accumulation_boundary()  # asked before step(): it advances the micro-step
        if boundary and self._losses:
            losses, self._losses = torch.stack(self._losses), []
            if not bool(torch.isfinite(losses).all()):  # one read, after the backward pass is queued
                bad = [v for v in losses.tolist() if not math.isfinite(v)]
                raise NonFiniteUpdate(
                    f"{self.role} rank {self.rank}, step {step + 1}: {len(bad)} of {losses.numel()} micro-batch "
                    f"losses of this update are {bad[0]}; the update was not applied, and nothing of this step is "
                    "saved (the last checkpoint holds the weights before it). Look for NaN/inf rewards or "
                    "advantages, lower the learning rate, or keep --max_norm on; then --resume."
                )
        engine.step()
        if boundary:
            norm = engine.get_global_grad_norm()
            if norm is not None and not math.isfinite(float(norm)):
                raise NonFiniteUpdate(
                    f"{self.role} rank {self.rank}, step {step + 1}: the gradient norm of this update is "
                    f"{float(norm)} though every loss was finite (a backward pass overflowed); the weights after it "
                    "are not trusted and nothing of this step is saved: the last checkpoint holds the weights before "
                    "it. "
                    "Lower the learning rate or the sequence length, then --resume."
                )
