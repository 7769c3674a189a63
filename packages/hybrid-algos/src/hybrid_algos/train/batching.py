"""Micro-batches by token budget (``--use_dynamic_batch``): as many samples per forward as fit in
``--train_max_tokens_per_gpu`` (training) or ``--rollout_max_tokens_per_gpu`` (log-prob / value passes).

A micro-batch's cost is what its forward really processes: the sum of the samples' lengths when packed
(``--packing_samples``), ``rows x (longest prompt + longest response)`` when padded. Bins are filled first-fit
decreasing; a sample longer than the budget gets a micro-batch of its own (it cannot be split).

Under DeepSpeed every data-parallel rank must run the same number of forward passes (ZeRO-3 gathers the weights
in each), so the ranks agree on the largest count (:func:`agree_on_count`) and those with fewer split their
largest micro-batches until they have as many.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SampleShape:
    prompt: int  # real prompt tokens
    response: int  # real response tokens

    @property
    def total(self) -> int:
        return self.prompt + self.response


def sample_shapes(attention_mask: torch.Tensor, response_len: int) -> list[SampleShape]:
    P = attention_mask.shape[1] - response_len
    prompt = attention_mask[:, :P].sum(-1).tolist()
    response = attention_mask[:, P:].sum(-1).tolist()
    return [SampleShape(int(p), int(r)) for p, r in zip(prompt, response)]


def bin_cost(shapes: list[SampleShape], packed: bool) -> int:
    if not shapes:
        return 0
    if packed:
        return sum(s.total for s in shapes)
    return len(shapes) * (max(s.prompt for s in shapes) + max(s.response for s in shapes))


def token_bins(shapes: list[SampleShape], budget: int, *, packed: bool, count: int | None = None) -> list[list[int]]:
    """Sample indices per micro-batch: each micro-batch costs at most ``budget`` tokens (unless one sample alone
    does), in as few micro-batches as first-fit decreasing finds, or exactly ``count`` of them when it is given."""
    if budget < 1:
        raise ValueError(f"token budget must be >= 1, got {budget}")
    order = sorted(range(len(shapes)), key=lambda i: (-shapes[i].total, i))
    bins: list[list[int]] = []
    for i in order:
        for b in bins:
            if bin_cost([shapes[j] for j in [*b, i]], packed) <= budget:
                b.append(i)
                break
        else:
            bins.append([i])
    if count is not None:
        if count < len(bins) or count > len(shapes):
            raise ValueError(f"cannot make {count} micro-batches of {len(shapes)} samples (need >= {len(bins)})")
        while len(bins) < count:  # split the costliest splittable micro-batch in two; costs only go down
            b = max((b for b in bins if len(b) > 1), key=lambda b: bin_cost([shapes[j] for j in b], packed))
            bins.remove(b)
            bins += [b[0::2], b[1::2]]
    return [sorted(b) for b in sorted(bins, key=lambda b: b[0])]


def agree_on_count(count: int, device: torch.device) -> int:
    """The largest ``count`` over the data-parallel ranks of this process's group (itself when alone)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return count
    t = torch.tensor([count], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def plan_micro_batches(
    attention_mask: torch.Tensor,
    response_len: int,
    *,
    budget: int,
    packed: bool,
    device: torch.device,
    sync: bool = True,
) -> list[list[int]]:
    """Token-budget micro-batches of one rank's samples, with the count agreed across ranks when ``sync``."""
    shapes = sample_shapes(attention_mask, response_len)
    bins = token_bins(shapes, budget, packed=packed)
    if sync:
        bins = token_bins(shapes, budget, packed=packed, count=agree_on_count(len(bins), device))
    return bins
