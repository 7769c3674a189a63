"""On-policy distillation's advantage: the task's advantage mixed with minus the teacher's per-token reverse KL, each
token on its own (no sum over later tokens), zero outside the response mask."""

import pytest
import torch

from hybrid_algos import AlgoInputError, distillation_advantages

MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
TASK = torch.tensor([[0.5, 0.5, 9.0], [-1.0, 9.0, 9.0]])
STUDENT = torch.tensor([[-0.1, -2.0, -7.0], [-0.5, -7.0, -7.0]])
TEACHER = torch.tensor([[-1.1, -0.5, -3.0], [-0.5, -1.0, -1.0]])


def test_each_token_gets_minus_its_own_reverse_kl_beside_the_task_advantage():
    adv, rkl = distillation_advantages(TASK, STUDENT, TEACHER, MASK, coef=2.0, task_coef=0.5)
    # token (0, 0): the student is surer than the teacher (log-ratio +1) -> pushed down; (0, 1): less sure -> up
    assert torch.allclose(rkl, torch.tensor([[1.0, -1.5, 0.0], [0.0, 0.0, 0.0]]))
    assert torch.allclose(adv, torch.tensor([[0.25 - 2.0, 0.25 + 3.0, 0.0], [-0.5, 0.0, 0.0]]))


def test_distillation_alone_ignores_the_task_and_agreement_gives_nothing():
    adv, _ = distillation_advantages(TASK, STUDENT, TEACHER, MASK, coef=1.0, task_coef=0.0)
    assert torch.allclose(adv, -(STUDENT - TEACHER) * MASK)
    same, rkl = distillation_advantages(TASK, TEACHER, TEACHER, MASK, coef=1.0, task_coef=0.0)
    assert torch.count_nonzero(same) == 0 and torch.count_nonzero(rkl) == 0
    task_only, _ = distillation_advantages(TASK, STUDENT, TEACHER, MASK, coef=0.0, task_coef=1.0)
    assert torch.allclose(task_only, TASK * MASK)


def test_the_baseline_is_the_mean_over_the_other_samples_of_the_prompt():
    group = torch.tensor([0, 0, 1])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    task = torch.zeros(3, 2)
    student = torch.tensor([[-1.0, -2.0], [-3.0, -9.0], [-1.0, -1.0]])
    teacher = torch.tensor([[-2.0, -1.0], [-1.0, -9.0], [-4.0, -1.0]])
    adv, rkl = distillation_advantages(task, student, teacher, mask, task_coef=0.0, group=group)
    assert torch.allclose(rkl, torch.tensor([[1.0, -1.0], [-2.0, 0.0], [3.0, 0.0]]))
    # sample 0's baseline: sample 1's tokens (-2); sample 1's: sample 0's (0); sample 2 is alone: none
    assert torch.allclose(adv, torch.tensor([[-3.0, -1.0], [2.0, 0.0], [-3.0, 0.0]]))
    # a teacher surer of everything by the same amount changes nothing: only differences within a prompt count
    shifted, _ = distillation_advantages(
        task[:2], student[:2], teacher[:2] + 5.0, mask[:2], task_coef=0.0, group=group[:2]
    )
    assert torch.allclose(shifted, adv[:2])


def test_the_result_is_detached_and_padding_garbage_stays_out():
    student = STUDENT.clone().requires_grad_(True)
    bad_teacher = TEACHER.clone()
    bad_teacher[0, 2] = float("nan")  # a padded position: never read
    adv, rkl = distillation_advantages(TASK, student, bad_teacher, MASK)
    assert not adv.requires_grad and torch.isfinite(adv).all() and torch.isfinite(rkl).all()


def test_bad_input_is_named():
    with pytest.raises(AlgoInputError, match="teacher_logprobs"):
        distillation_advantages(TASK, STUDENT, TEACHER[:, :2], MASK)
    with pytest.raises(AlgoInputError, match="coef"):
        distillation_advantages(TASK, STUDENT, TEACHER, MASK, coef=-1.0)
    nan = TEACHER.clone()
    nan[0, 0] = float("nan")
    with pytest.raises(AlgoInputError, match="teacher_logprobs"):
        distillation_advantages(TASK, STUDENT, nan, MASK)
