"""Remove and restore the padding of a (batch, seqlen, ...) tensor, in plain torch.

The names and return shapes follow the ones OpenRLHF calls (``unpad_input`` returns five values, as flash-attn
>= 2.7 does); the code is ours. Every function is differentiable through torch's own indexing ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange  # re-exported: openrlhf.models.ring_attn_utils imports it from here

__all__ = ["index_first_axis", "pad_input", "rearrange", "unpad_input"]


def index_first_axis(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Rows ``indices`` of ``x`` along its first axis (``x[indices]`` for any trailing shape)."""
    return x.index_select(0, indices)


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask: torch.Tensor | None = None):
    """Keep the positions where ``attention_mask`` (batch, seqlen) is nonzero.

    Returns ``(packed, indices, cu_seqlens, max_seqlen, seqlens)``: ``packed`` is (total, ...) with the kept
    positions in row-major order, ``indices`` their positions in the flattened (batch * seqlen) layout,
    ``cu_seqlens`` the int32 prefix sums of the per-row lengths (batch + 1 entries, starting at 0), ``max_seqlen``
    the longest row as a Python int and ``seqlens`` the int32 per-row lengths. ``unused_mask`` (positions that
    are kept but not attended to) is added to the kept set, and ``seqlens`` counts only the attended ones.
    """
    keep = attention_mask.bool() if unused_mask is None else (attention_mask.bool() | unused_mask.bool())
    lengths = keep.sum(dim=-1, dtype=torch.int32)
    used = attention_mask.bool().sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(keep.flatten(), as_tuple=False).flatten()
    max_seqlen = int(lengths.max().item()) if lengths.numel() else 0
    cu_seqlens = F.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen, used


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Inverse of :func:`unpad_input`: scatter the (total, ...) rows back into a zero (batch, seqlen, ...) tensor."""
    rest = hidden_states.shape[1:]
    out = hidden_states.new_zeros(batch * seqlen, *rest)
    out = out.index_copy(0, indices, hidden_states)
    return out.reshape(batch, seqlen, *rest)
