"""Full weights out of a sharded model for weight sync and Hugging Face export, a bucket at a time.

Parameters are gathered in order (``DTensor.full_tensor()``, one all-gather each) until the next one would take the
bucket past its byte budget; the bucket is then handed out and dropped before anything more is gathered. So the
gathered bytes held at once stay under one bucket plus the largest tensor, never the whole model. Every rank must
iterate together (each gather is a collective); only what the caller keeps outlives its bucket. A PEFT model's
weights come out merged, under the base model's names (:mod:`.peft_weights`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .peft_weights import peft_export


def full_weight_buckets(
    module: torch.nn.Module, bucket_bytes: int, dtype: torch.dtype | None = None
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Lists of ``(name, full tensor)`` of at most ``bucket_bytes`` each (a larger tensor comes alone).

    ``dtype``: cast each shard before its gather (e.g. bf16 for the rollout engines: half the bytes sent)."""
    from torch.distributed.tensor import DTensor

    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    with torch.no_grad():
        for name, p in module.named_parameters():
            nbytes = p.numel() * (dtype.itemsize if dtype is not None else p.element_size())
            if bucket and size + nbytes > bucket_bytes:
                yield bucket
                bucket, size = [], 0  # our references go before the next gather
            t = p.detach() if dtype is None else p.detach().to(dtype)
            bucket.append((name, t.full_tensor() if isinstance(t, DTensor) else t))
            size += nbytes
    if bucket:
        yield bucket


def full_weights(
    module: torch.nn.Module, bucket_bytes: int, dtype: torch.dtype | None = None, *, merged: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` pairs, gathered bucket by bucket (see :func:`full_weight_buckets`); a PEFT model's
    merged (an adapted layer's base weight waits for its adapters, which follow it) unless ``merged`` is False."""
    plan = peft_export(module) if merged else None
    weights = _handed_out(full_weight_buckets(module, bucket_bytes, dtype))
    return weights if plan is None else plan.merged(weights)


def _handed_out(buckets: Iterator[list[tuple[str, torch.Tensor]]]) -> Iterator[tuple[str, torch.Tensor]]:
    for bucket in buckets:
        bucket.reverse()
        while bucket:  # pop as we go: a handed-out tensor is not kept alive by the bucket while the next gathers
            yield bucket.pop()
