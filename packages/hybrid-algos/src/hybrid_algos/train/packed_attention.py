"""Attention for packed rows that never looks across samples (``--packing_samples``).

A packed micro-batch is one row ``[1, N]`` holding several samples back to back, position ids restarting at 0 for
each. Left to itself, transformers' sdpa path turns that into a dense ``N x N`` block-diagonal mask and computes all
``N^2`` scores: more attention work than the padded batch it replaces, plus an ``N x N`` mask in memory. This module
registers an attention implementation with transformers' ``AttentionInterface`` that attends within each sample only:

* ``varlen``: one call of PyTorch's variable-length flash kernel (``torch.nn.attention.varlen.varlen_attn``), on CUDA
  with fp16 / bf16 when this torch has it;
* ``segments``: a loop over the samples, each a causal ``scaled_dot_product_attention`` of its own length
  (CPU, float32, dropout, or a torch without ``varlen_attn``).

Calls with an attention mask (the padded path) go to transformers' own sdpa unchanged, and the registered mask
function builds no mask at all when there is none to honour, so the ``N x N`` mask never exists. The sample
boundaries come from the position ids (a new sample wherever the position does not follow its predecessor); the
trainer's :func:`hybrid_algos.train.models.model_inputs` attaches them to the position ids it builds, so nothing is
recomputed (and the GPU is not synchronised) per layer.

``HYBRID_PACKED_ATTENTION`` picks the path: ``auto`` (default), ``varlen`` or ``segments`` (refused with a message
if it cannot run), or ``sdpa-mask`` (don't install: transformers' dense block-diagonal mask, for comparison).
"""

from __future__ import annotations

import collections
import inspect
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

#: The name registered with transformers (the model's ``config._attn_implementation`` while installed).
NAME = "hybrid_packed_sdpa"
ENV = "HYBRID_PACKED_ATTENTION"
MODES = ("auto", "varlen", "segments", "sdpa-mask")

#: Attention calls per path taken ("varlen", "segments", "sdpa" for padded calls): what really ran.
CALLS: collections.Counter = collections.Counter()

_SEGMENTS_ATTR = "_hybrid_packed_segments"  # where model_inputs leaves the boundaries on its position ids tensor


def mode() -> str:
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"{ENV}={value!r}: expected one of {', '.join(MODES)}")
    return value


# ---- sample boundaries ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Segments:
    """Where the samples of a packed (flattened) row start and end."""

    cu_seqlens: torch.Tensor  # [S+1] int32 on the row's device: 0, end of sample 0, ..., N
    lengths: tuple[int, ...]  # on the host, for the loop and max_len (no device sync per layer)

    @property
    def max_len(self) -> int:
        return max(self.lengths, default=0)


def segments_from_lengths(lengths: list[int] | tuple[int, ...], device) -> Segments:
    lengths = tuple(int(n) for n in lengths)
    if any(n <= 0 for n in lengths):
        raise ValueError(f"packed samples must have at least one token, got lengths {lengths}")
    cu = torch.tensor((0, *lengths), dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)
    return Segments(cu, lengths)


def segments_from_position_ids(position_ids: torch.Tensor) -> Segments:
    """Samples of ``position_ids`` ``[B, N]`` taken row after row: a sample starts at every row start and wherever a
    position is not its predecessor + 1 (a restart at 0, or any jump)."""
    pos = position_ids.reshape(position_ids.shape[0] if position_ids.dim() > 1 else 1, -1)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    idx = starts.reshape(-1).nonzero().reshape(-1).tolist()  # the one host sync, cached on the tensor below
    total = pos.numel()
    return Segments(
        torch.tensor([*idx, total], dtype=torch.int32, device=pos.device),
        tuple(b - a for a, b in zip(idx, [*idx[1:], total])),
    )


def attach_segments(position_ids: torch.Tensor, segments: Segments) -> torch.Tensor:
    """Remember ``segments`` on ``position_ids`` (the same tensor object reaches every layer, and a checkpointed
    layer's recomputation), so the attention reads them instead of deriving them per layer."""
    setattr(position_ids, _SEGMENTS_ATTR, segments)
    return position_ids


def segments_of(position_ids: torch.Tensor) -> Segments:
    cached = getattr(position_ids, _SEGMENTS_ATTR, None)
    if cached is None:
        cached = segments_from_position_ids(position_ids)
        attach_segments(position_ids, cached)
    return cached


# ---- the two kernels --------------------------------------------------------------------------------------------
def _varlen_fn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, frozenset()
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def varlen_unsupported(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout: float, sliding_window: int | None
) -> str | None:
    """Why the varlen kernel cannot run this call (None: it can)."""
    fn, params = _varlen_fn()
    if fn is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn (added in 2.10)"
    if not query.is_cuda:
        return "the varlen kernel is CUDA only"
    if not torch.backends.cuda.is_flash_attention_available():
        return "this torch build has no flash attention kernels"
    if torch.cuda.get_device_capability(query.device) < (8, 0):
        return "the flash kernel needs a GPU of compute capability 8.0 or newer"
    if query.dtype not in (torch.float16, torch.bfloat16):
        return f"the flash kernel takes float16 / bfloat16, not {query.dtype}"
    d = query.shape[-1]
    if key.shape[-1] != d or value.shape[-1] != d or d > 256 or d % 8:
        return f"head dims q/k/v {d}/{key.shape[-1]}/{value.shape[-1]} (the flash kernel needs equal dims, <= 256, x8)"
    if dropout > 0:
        return "varlen_attn has no dropout"
    if sliding_window is not None and "window_size" not in params:
        return "this varlen_attn has no window_size (sliding-window attention)"
    if "window_size" not in params and "is_causal" not in params:
        return "this varlen_attn has neither window_size nor is_causal"
    return None


def varlen_attention(
    query, key, value, segments: Segments, scaling: float | None, sliding_window: int | None
) -> torch.Tensor:
    """``[B, H, N, D]`` in (one flattened packed row), ``[B, N, H, D]`` out: one varlen flash call."""
    fn, params = _varlen_fn()
    B, Hq, N, D = query.shape
    Hkv = key.shape[1]
    q = query.transpose(1, 2).reshape(B * N, Hq, D).contiguous()
    k = key.transpose(1, 2).reshape(B * N, Hkv, D).contiguous()
    v = value.transpose(1, 2).reshape(B * N, Hkv, D).contiguous()
    kwargs: dict[str, Any] = {}
    if Hq != Hkv:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:  # older varlen_attn: one KV head per query head (transformers' repeat_kv order)
            k, v = k.repeat_interleave(Hq // Hkv, dim=1), v.repeat_interleave(Hq // Hkv, dim=1)
    if "scale" in params:
        kwargs["scale"] = scaling
    elif scaling is not None and abs(scaling - D**-0.5) > 1e-12 * scaling:
        q = q * (scaling / D**-0.5)  # the kernel scales by 1/sqrt(D); fold the model's own scale into q
    if "window_size" in params:
        # transformers' window W attends to the W positions ending at the query: W-1 to its left (as its flash path)
        kwargs["window_size"] = (-1, 0) if sliding_window is None else (int(sliding_window) - 1, 0)
    else:
        kwargs["is_causal"] = True
    cu = segments.cu_seqlens
    out = fn(q, k, v, cu, cu, segments.max_len, segments.max_len, **kwargs)
    return out.reshape(B, N, Hq, D)


def segment_attention(
    query, key, value, segments: Segments, scaling: float | None, dropout: float, sliding_window: int | None
) -> torch.Tensor:
    """``[B, H, N, D]`` in, ``[B, N, H, D]`` out: causal SDPA over each sample on its own (a mask of one sample's
    length only when a sliding window is shorter than it)."""
    B, Hq, N, _ = query.shape
    flat = lambda t: t if B == 1 else t.transpose(0, 1).reshape(1, t.shape[1], B * N, t.shape[-1])  # noqa: E731
    q, k, v = flat(query), flat(key), flat(value)
    gqa = {"enable_gqa": True} if k.shape[1] != Hq else {}
    outs, start = [], 0
    for n in segments.lengths:
        sl = slice(start, start + n)
        start += n
        mask, causal = None, True
        if sliding_window is not None and n > sliding_window:
            i = torch.arange(n, device=q.device)
            mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - int(sliding_window))
            causal = False
        outs.append(
            torch.nn.functional.scaled_dot_product_attention(
                q[:, :, sl],
                k[:, :, sl],
                v[:, :, sl],
                attn_mask=mask,
                dropout_p=dropout,
                is_causal=causal,
                scale=scaling,
                **gqa,
            )
        )
    out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    return out.transpose(1, 2).reshape(B, N, Hq, value.shape[-1])


# ---- the function transformers calls ----------------------------------------------------------------------------
def packed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: ``query`` ``[B, Hq, N, D]``, ``key`` / ``value`` ``[B, Hkv, N, D]``;
    returns ``([B, N, Hq, D], None)`` as its sdpa does."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    position_ids = kwargs.get("position_ids")
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    # a mask (padded rows), decoding against a cache, no positions, or a bidirectional module: not a packed forward
    if attention_mask is not None or position_ids is None or not causal or query.shape[2] != key.shape[2]:
        CALLS["sdpa"] += 1
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if kwargs.get("softcap") is not None:
        raise ValueError(
            f"--packing_samples: {type(module).__name__} soft-caps its attention logits "
            f"(softcap={kwargs['softcap']}), which the packed attention does not do; train this model "
            "without --packing_samples, or with --flash_attn and the flash-attn package"
        )
    segments = segments_of(position_ids)
    if len(segments.lengths) == query.shape[0]:  # one sample per row: plain causal attention
        CALLS["sdpa"] += 1
        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling, **kwargs)
    sliding_window = kwargs.get("sliding_window")
    chosen = mode()
    why_not = (
        varlen_unsupported(query, key, value, dropout, sliding_window)
        if chosen in ("auto", "varlen")
        else f"{ENV}={chosen}"
    )
    if chosen == "varlen" and why_not:
        raise RuntimeError(f"{ENV}=varlen: {why_not}; use {ENV}=auto (falls back to a loop over the samples)")
    if not why_not:
        CALLS["varlen"] += 1
        return varlen_attention(query, key, value, segments, scaling, sliding_window), None
    CALLS["segments"] += 1
    return segment_attention(query, key, value, segments, scaling, dropout, sliding_window), None


def _packed_mask(*, attention_mask=None, **kwargs):
    """No mask when there is no padding mask to honour (packed rows: the attention delimits samples itself);
    otherwise transformers' sdpa mask, as the padded path always had."""
    if attention_mask is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(attention_mask=attention_mask, **kwargs)


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, packed_attention_forward)
    AttentionMaskInterface.register(NAME, _packed_mask)


def install(model: torch.nn.Module) -> str:
    """Make ``model`` (a transformers model) attend through :func:`packed_attention_forward`; idempotent.

    Only over sdpa: flash-attention implementations already run varlen kernels from the position ids, and eager /
    flex keep transformers' own (dense) packed mask. Returns the implementation the model now uses.
    """
    config = model.config
    current = config._attn_implementation
    if current == NAME or mode() == "sdpa-mask":
        return current
    if current != "sdpa":
        if not getattr(model, "_hybrid_packed_note", False):
            log.info(
                "%s uses %s attention: packed rows go through transformers' own %s path",
                type(model).__name__,
                current,
                current,
            )
            model._hybrid_packed_note = True
        return current
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap:
        raise ValueError(
            f"--packing_samples: {type(model).__name__} soft-caps its attention logits "
            f"(attn_logit_softcapping={softcap}), which the packed attention does not do; train it "
            "without --packing_samples, or with --flash_attn and the flash-attn package"
        )
    register()
    config._attn_implementation = NAME
    return NAME
