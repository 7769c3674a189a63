"""Batched KV-cache decoding for the built-in engine: one micro-batch of prompts, ``n`` rows per prompt.

Prompts of different lengths are left-padded; the 2-D attention mask hides the padding and ``position_ids`` count
real tokens only, so each row sees exactly what an unpadded forward pass of its own sequence sees. Each prompt is
prefilled once and its cache repeated for its ``n`` samples. Rows that have stopped are dropped from the batch (and
the cache) once enough of them have, so long tails do not pay for finished rows. Everything per step is tensor ops
over the whole batch, with one host sync per step (are all rows done?); the only per-row Python runs once per
call, outside the decode loop.

Weight updates between decoding steps (partial rollouts): ``before_forward`` is called before every forward pass
(the prefill and each decoding step); it may block (the engine parks the loop there while its weights change) and
returns the version of the weights the forward will use. Each token is marked with the version of the forward whose
logits sampled it, and the rows, their cache and their sampling streams carry over the pause unchanged.

Known cost: transformers' ``DynamicCache`` grows by concatenation, so each step copies the cache (quadratic in the
completion length). It is what ``model.generate`` uses too; the vLLM/SGLang backends are the fast path on GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from .hf_sampling import choose_tokens
from .multimodal import vision_forward_inputs
from .protocol import MultimodalInput, SamplingParams

#: Drop finished rows from the batch once this fraction of the live rows has stopped.
_COMPACT_FRACTION = 0.25


@dataclass
class DecodedBatch:
    """Per row (prompt-major): generated ids, their raw-model log-probabilities, length and whether it stopped."""

    tokens: torch.Tensor  # [rows, steps] int64 (entries past ``lengths`` are meaningless)
    logprobs: torch.Tensor  # [rows, steps] float32
    lengths: torch.Tensor  # [rows] int64
    stopped: torch.Tensor  # [rows] bool: ended on a stop token (included in tokens)
    versions: torch.Tensor  # [rows, steps] int64: the weight version whose forward pass sampled each token


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)``, both ``[len(prompts), longest]``, padding on the left."""
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p) :] = torch.as_tensor(p, dtype=torch.long)
        mask[i, longest - len(p) :] = 1
    return ids.to(device), mask.to(device)


@torch.inference_mode()
def decode(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    *,
    stop_ids: torch.Tensor,
    uniforms: torch.Tensor | None,
    pad_id: int,
    keep_last_logits: bool,
    with_logprobs: bool = True,
    before_forward: Callable[[], int] | None = None,
    multimodal: Sequence[MultimodalInput | None] | None = None,
) -> DecodedBatch:
    """Generate ``params.n`` completions for each prompt; ``uniforms [rows, max_new_tokens]`` drive sampling.
    ``before_forward``: see the module docstring (None: version 0, nothing can pause the loop). ``multimodal``: per
    prompt its images with their pixel values, or None; the prefill then gets the pixel values, grids and the 3-D
    rotary positions of :func:`~hybrid_engines.multimodal.vision_forward_inputs` (the trainer's too), and decoding
    goes on from each row's largest position + 1."""
    device = stop_ids.device
    version = before_forward() if before_forward is not None else 0
    n, steps = params.n, params.max_new_tokens
    ids, mask = left_pad(prompts, pad_id, device)
    positions = (mask.cumsum(-1) - 1).clamp_(min=0)
    cache = DynamicCache(config=model.config)
    extra: dict = {"logits_to_keep": 1} if keep_last_logits else {}
    vision = vision_forward_inputs(model, ids, mask, multimodal)
    if vision:
        positions = vision.pop("position_ids")  # [3, B, T]
        extra.update(vision)
    out = model(
        input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True, **extra
    )
    logits = out.logits[:, -1].float()
    if n > 1:  # one prefill per prompt, shared by its n samples
        cache.batch_repeat_interleave(n)
        logits = logits.repeat_interleave(n, dim=0)
        mask = mask.repeat_interleave(n, dim=0)
        positions = positions.repeat_interleave(n, dim=-2)  # the rows' axis of [B, T] and of [3, B, T]
    # M-RoPE ([3, B, T]): the next text position is one past the largest of any axis
    last = positions.amax(dim=0).amax(dim=-1, keepdim=True) if positions.dim() == 3 else positions[:, -1:]
    next_pos = last + 1

    rows_total = len(prompts) * n
    tokens = torch.zeros(rows_total, steps, dtype=torch.long, device=device)
    logprobs = torch.zeros(rows_total, steps, dtype=torch.float32, device=device)
    lengths = torch.full((rows_total,), steps, dtype=torch.long, device=device)
    stopped = torch.zeros(rows_total, dtype=torch.bool, device=device)
    versions = torch.zeros(rows_total, steps, dtype=torch.long, device=device)
    rows = torch.arange(rows_total, device=device)  # global index of each live row
    done = torch.zeros(rows_total, dtype=torch.bool, device=device)

    for t in range(steps):
        banned = stop_ids if t < params.min_new_tokens else None
        u = uniforms[rows, t] if uniforms is not None else None
        tok = choose_tokens(logits, params, u, banned)
        tokens[rows, t] = tok
        versions[rows, t] = version
        if with_logprobs:  # of the raw model: log_softmax of the float32 logits, before any sampling transform
            logprobs[rows, t] = torch.log_softmax(logits, dim=-1).gather(-1, tok.unsqueeze(-1)).squeeze(-1)
        hit = torch.isin(tok, stop_ids) & ~done
        lengths[rows] = torch.where(hit, t + 1, lengths[rows])
        stopped[rows] |= hit
        done |= hit
        n_done = int(done.sum())  # the one host sync per step
        if n_done == len(rows) or t == steps - 1:
            break
        if n_done >= max(1, int(_COMPACT_FRACTION * len(rows))):
            keep = (~done).nonzero().squeeze(-1)
            cache.batch_select_indices(keep)
            rows, tok, mask, next_pos = rows[keep], tok[keep], mask[keep], next_pos[keep]
            done = done[keep]
        mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=-1)
        if before_forward is not None:
            version = before_forward()  # may park here while the weights change (the rows and cache stay)
        out = model(
            input_ids=tok.unsqueeze(-1),
            attention_mask=mask,
            position_ids=next_pos,
            past_key_values=cache,
            use_cache=True,
        )
        logits = out.logits[:, -1].float()
        next_pos = next_pos + 1
    return DecodedBatch(tokens, logprobs, lengths, stopped, versions)
