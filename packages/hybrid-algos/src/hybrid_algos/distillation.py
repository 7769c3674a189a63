"""On-policy distillation: the teacher's judgement of every sampled token as a dense advantage.

The student samples; the teacher scores the same tokens. Per response token ``t`` the per-token reverse KL estimate
(k1, on the student's own samples) is ``log pi_student(y_t) - log pi_teacher(y_t)``; minimising
``KL(pi_student || pi_teacher)`` with the policy gradient makes its negative the advantage of that token alone (no
sum over later tokens: each token is judged where it was chosen, which is what makes the signal dense -- Agarwal et
al. 2024, "On-Policy Distillation of Language Models"; Lu et al. 2025, Thinking Machines, "On-Policy Distillation").

    advantage_t = task_coef * task_advantage_t - coef * (log pi_student(y_t) - log pi_teacher(y_t) - b)

``task_coef`` 0 is distillation alone; 1 (and ``coef`` > 0) mixes it with the task's reward, whose advantage the
run's estimator computed as usual. The student's log-probs are the rollout's pre-update ones (the behaviour policy),
so the term is a constant of the update, like any advantage.

``b``, with ``group`` (each sample's prompt): the mean of the term over the *other* samples of the same prompt (all
their response tokens). The raw term is large and of one sign wherever the teacher is sure and the student is not
(a wrong token at -9 nats beside a right one at +2), so every sample would be pushed down and the learning would
come from small differences of large numbers; a baseline that does not depend on the sample's own tokens changes no
expectation of the gradient, only its variance (leave-one-out, as RLOO's).
"""

from __future__ import annotations

import torch

from . import _checks
from ._no_grad import no_grad
from .errors import AlgoInputError


@no_grad
def distillation_advantages(
    task_advantages: torch.Tensor,
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    coef: float = 1.0,
    task_coef: float = 1.0,
    group: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, reverse_kl)``, both ``[B, R]`` and 0 outside ``mask``: the mixed advantage above, and the
    per-token reverse KL estimate (for the metrics, without the baseline). ``group`` (``[B]``, each sample's prompt
    index): subtract the leave-one-out baseline; a sample alone in its group gets none."""
    _checks.tensor("task_advantages", task_advantages, ndim=2, floating=True)
    _checks.tensor("student_logprobs", student_logprobs, ndim=2, floating=True)
    _checks.tensor("teacher_logprobs", teacher_logprobs, ndim=2, floating=True)
    _checks.same_shape("student_logprobs", student_logprobs, "task_advantages", task_advantages)
    _checks.same_shape("teacher_logprobs", teacher_logprobs, "task_advantages", task_advantages)
    valid = _checks.mask("mask", mask, like=task_advantages, like_name="task_advantages")
    coef = _checks.positive_float("coef", coef, allow_zero=True)
    task_coef = _checks.positive_float("task_coef", task_coef, allow_zero=True)
    _checks.finite(
        [
            ("task_advantages", task_advantages, valid),
            ("student_logprobs", student_logprobs, valid),
            ("teacher_logprobs", teacher_logprobs, valid),
        ]
    )
    zero = torch.zeros((), dtype=task_advantages.dtype, device=task_advantages.device)
    reverse_kl = torch.where(valid, (student_logprobs - teacher_logprobs).to(task_advantages.dtype), zero)
    term = reverse_kl
    if group is not None:
        term = reverse_kl - _leave_one_out(reverse_kl, valid, group)[:, None]
    advantages = torch.where(valid, task_coef * task_advantages - coef * term, zero)
    return advantages, reverse_kl


def _leave_one_out(values: torch.Tensor, valid: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Per sample, the mean of ``values`` over the valid tokens of the other samples of its group (0 if none)."""
    _checks.tensor("group", group, ndim=1)
    if group.numel() != values.size(0):
        raise AlgoInputError("group", f"has {group.numel()} entries for {values.size(0)} samples.", "One per sample.")
    ids = torch.unique(group, return_inverse=True)[1]
    n = int(ids.max().item()) + 1 if ids.numel() else 0
    sums = torch.zeros(n, dtype=values.dtype, device=values.device).index_add_(0, ids, values.sum(-1))
    counts = torch.zeros(n, dtype=values.dtype, device=values.device).index_add_(0, ids, valid.sum(-1).to(values.dtype))
    other_sum = sums[ids] - values.sum(-1)
    other_count = counts[ids] - valid.sum(-1).to(values.dtype)
    return torch.where(other_count > 0, other_sum / other_count.clamp(min=1), torch.zeros_like(other_sum))
