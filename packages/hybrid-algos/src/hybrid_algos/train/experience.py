"""The rollout batch that flows through a step: generated sequences plus everything computed about them.

Layout: ``sequences[b] = [left-padded prompt (P) | right-padded response (R)]``; ``action_mask[b, t]`` marks the
response tokens the policy produced (the stop token included). In a multi-turn sample (:mod:`.agents`) the response
also holds the environment's replies between the model's turns: attended to (``attention_mask`` 1) but with
``action_mask`` 0, so no loss, KL, advantage or mismatch statistic sees them. Samples are prompt-major: the ``n``
samples of prompt 0, then of prompt 1, so ``group`` (the prompt index) is what GRPO / RLOO group by.

A vision-language rollout also carries each sample's images (``images[b]``: its prompt's
:class:`~hybrid_engines.protocol.MultimodalInput`, or None), through every slice, shard and micro-batch, so the
trainer's forward gets the pixel values and grids the engine had; the ``n`` samples of a prompt share one object.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

OPTIONAL_FIELDS = (
    "old_logprobs",
    "ref_logprobs",
    "values",
    "scores",
    "advantages",
    "returns",
    "token_rewards",
    "sample_mask",
)


@dataclass
class Rollout:
    sequences: torch.Tensor  # [B, P+R] long
    attention_mask: torch.Tensor  # [B, P+R] long
    action_mask: torch.Tensor  # [B, R] float (1 = response token)
    group: torch.Tensor  # [B] long, prompt index within the step
    engine_logprobs: torch.Tensor | None = None  # [B, R] from the engine (raw model distribution)
    old_logprobs: torch.Tensor | None = None  # [B, R] actor before this step's update
    ref_logprobs: torch.Tensor | None = None  # [B, R]
    values: torch.Tensor | None = None  # [B, R] critic
    scores: torch.Tensor | None = None  # [B] reward per sequence
    token_rewards: torch.Tensor | None = None  # [B, R] scores on the last token, KL penalty on every token
    advantages: torch.Tensor | None = None  # [B, R]
    returns: torch.Tensor | None = None  # [B, R]
    sample_mask: torch.Tensor | None = None  # [B] bool: False = left out of the policy loss (a truncated completion)
    images: list[Any] | None = None  # [B] MultimodalInput or None per sample (vision-language prompts); None: text

    @property
    def batch_size(self) -> int:
        return self.sequences.size(0)

    @property
    def response_len(self) -> int:
        return self.action_mask.size(1)

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.action_mask.sum(-1)

    @property
    def loss_mask(self) -> torch.Tensor:
        """``action_mask`` without the samples ``sample_mask`` leaves out: the tokens the policy loss sees."""
        if self.sample_mask is None:
            return self.action_mask
        return self.action_mask * self.sample_mask.to(self.action_mask.dtype)[:, None]

    @classmethod
    def from_generations(
        cls,
        prompts: Sequence[Sequence[int]],
        completions: Sequence[Sequence[Sequence[int]]],
        pad_id: int,
        logprobs: Sequence[Sequence[Sequence[float]]] | None = None,
        *,
        action_masks: Sequence[Sequence[Sequence[int] | None]] | None = None,
        sample_prompts: Sequence[Sequence[Sequence[int]]] | None = None,
        images: Sequence[Any] | None = None,
    ) -> Rollout:
        """Build from per-prompt lists of completions (``completions[i]`` = the samples of prompt ``i``).

        Multi-turn samples: ``action_masks[i][j]`` (1 = the model's token, 0 = the environment's; None = all the
        model's) and ``sample_prompts[i][j]`` (the prompt the sample really started from, when the environment
        rewrote it) are nested like ``completions``. ``images[i]``: prompt ``i``'s images (``MultimodalInput`` or
        None), given to each of its samples."""
        flat_prompts, flat_resp, flat_lp, flat_mask, group = [], [], [], [], []
        for i, (prompt, samples) in enumerate(zip(prompts, completions)):
            for j, resp in enumerate(samples):
                flat_prompts.append(list(sample_prompts[i][j] if sample_prompts is not None else prompt))
                flat_resp.append(list(resp))
                group.append(i)
                mask = action_masks[i][j] if action_masks is not None else None
                if mask is not None and len(mask) != len(resp):
                    raise ValueError(
                        f"sample {j} of prompt {i}: action mask of {len(mask)} tokens for a response of {len(resp)}"
                    )
                flat_mask.append(mask)
                if logprobs is not None:
                    flat_lp.append(list(logprobs[i][j]))
        if not flat_resp:
            raise ValueError("no completions to build a rollout from")
        P = max(len(p) for p in flat_prompts)
        R = max(1, max(len(r) for r in flat_resp))
        B = len(flat_resp)
        seq = torch.full((B, P + R), pad_id, dtype=torch.long)
        att = torch.zeros((B, P + R), dtype=torch.long)
        act = torch.zeros((B, R), dtype=torch.float32)
        elp = torch.zeros((B, R), dtype=torch.float32) if logprobs is not None else None
        for b, (p, r) in enumerate(zip(flat_prompts, flat_resp)):
            seq[b, P - len(p) : P] = torch.tensor(p, dtype=torch.long)
            att[b, P - len(p) : P] = 1
            if r:
                seq[b, P : P + len(r)] = torch.tensor(r, dtype=torch.long)
                att[b, P : P + len(r)] = 1
                mask = flat_mask[b]
                act[b, : len(r)] = 1 if mask is None else torch.tensor(mask, dtype=torch.float32)
                if elp is not None:
                    elp[b, : len(r)] = torch.tensor(flat_lp[b][: len(r)], dtype=torch.float32)
        if elp is not None:
            elp = elp * act  # an environment token has no engine log-prob: 0, as at padding
        per_sample = None
        if images is not None and any(m is not None for m in images):
            per_sample = [images[i] for i in group]
        return cls(seq, att, act, torch.tensor(group, dtype=torch.long), engine_logprobs=elp, images=per_sample)

    # ---- slicing ------------------------------------------------------------------------------------------------
    def select(self, index: torch.Tensor | slice) -> Rollout:
        return dataclasses.replace(
            self,
            **{
                f.name: (v[index] if isinstance(v := getattr(self, f.name), torch.Tensor) else v)
                for f in dataclasses.fields(self)
                if f.name != "images"
            },
            images=_select_list(self.images, index),
        )

    def split(self, parts: int) -> list[Rollout]:
        """Contiguous, equal shards (one per data-parallel rank); the batch must divide evenly."""
        if self.batch_size % parts:
            raise ValueError(f"batch of {self.batch_size} samples does not split into {parts} equal shards")
        size = self.batch_size // parts
        return [self.select(slice(i * size, (i + 1) * size)) for i in range(parts)]

    def micro_batches(self, size: int) -> list[Rollout]:
        return [self.select(slice(i, i + size)).trimmed() for i in range(0, self.batch_size, size)]

    def token_micro_batches(
        self, budget: int, *, packed: bool, device: torch.device | str = "cpu", sync: bool = True
    ) -> tuple[list[Rollout], list[torch.Tensor]]:
        """Micro-batches of at most ``budget`` tokens each (see :mod:`.batching`), and each one's sample indices."""
        from .batching import plan_micro_batches

        bins = plan_micro_batches(
            self.attention_mask, self.response_len, budget=budget, packed=packed, device=torch.device(device), sync=sync
        )
        index = [torch.tensor(b, dtype=torch.long) for b in bins]
        return [self.select(i).trimmed() for i in index], index

    def trimmed(self) -> Rollout:
        """Drop prompt columns that are padding in every row and response columns past the longest response."""
        R_keep = int(self.action_mask.sum(0).nonzero().max().item()) + 1 if self.action_mask.any() else 1
        P = self.sequences.size(1) - self.response_len
        prompt_cols = self.attention_mask[:, :P].any(0).nonzero()
        P_start = int(prompt_cols.min().item()) if len(prompt_cols) else P - 1
        changes = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, torch.Tensor) or v.dim() < 2:
                continue
            if f.name in ("sequences", "attention_mask"):
                changes[f.name] = v[:, P_start : P + R_keep]
            else:
                changes[f.name] = v[:, :R_keep]
        return dataclasses.replace(self, **changes)

    @staticmethod
    def cat(parts: Sequence[Rollout]) -> Rollout:
        """Concatenate shards with the same layout (as returned by :meth:`split`)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(Rollout):
            values = [getattr(p, f.name) for p in parts]
            out[f.name] = torch.cat(values) if all(isinstance(v, torch.Tensor) for v in values) else None
        if any(p.images is not None for p in parts):
            out["images"] = [m for p in parts for m in (p.images or [None] * p.batch_size)]
        return Rollout(**out)

    def to(self, device: torch.device | str) -> Rollout:
        return dataclasses.replace(
            self,
            **{
                f.name: v.to(device)
                for f in dataclasses.fields(self)
                if isinstance(v := getattr(self, f.name), torch.Tensor)
            },
        )

    def with_(self, **fields: torch.Tensor) -> Rollout:
        return dataclasses.replace(self, **fields)


def _select_list(values: list[Any] | None, index: torch.Tensor | slice) -> list[Any] | None:
    """``values[index]`` for a per-sample list, indexed like the tensors (a slice, or a tensor of indices / a mask)."""
    if values is None:
        return None
    if isinstance(index, slice):
        return values[index]
    index = torch.as_tensor(index)
    if index.dtype == torch.bool:
        index = index.nonzero().squeeze(-1)
    return [values[i] for i in index.reshape(-1).tolist()]
