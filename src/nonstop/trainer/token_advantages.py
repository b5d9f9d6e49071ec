"""Pure tensor functions of token-level advantages: process rewards and on-policy distillation.

Shapes: B samples, T completion positions (padded); `mask` (B, T) is True on completion tokens
(padding False). Both functions take the per-sample advantage A (B,) of the task reward (or
(B, T) already) and return (B, T), zero on padding.

- Process rewards: `token_rewards` r (B, T) hold each step's score at the last token of the step
  (0 elsewhere). The return of token t is R_t = sum_{t' >= t} r_t' (the score of its own step
  and of every later step of the completion). Returns are centred per group, over every token of
  every sample of the group: P_t = R_t - mean_group(R). The advantage is A + P_t.
- Distillation (reverse KL to a teacher on the student's own samples): with student logprob
  s_t = log pi_student(a_t) and teacher logprob q_t = log pi_teacher(a_t), the per-token term is
  k_t = s_t - q_t (a one-sample estimate of KL(pi_student || pi_teacher) at position t), and the
  advantage is A - coef * k_t, or -coef * k_t alone without the task reward (pure
  distillation). The student logprob is detached: the term is a reward, not a loss. With
  `normalize`, k is standardised over the batch's completion tokens first, (k_t - mean k) / std k,
  as GRPO standardises rewards: the mean is a baseline (it does not bias the gradient), and the
  scale no longer depends on how far the teacher is from the student, so coef weighs the term
  against a task advantage of unit scale.
"""

from __future__ import annotations

import torch


def process_advantages(
    adv: torch.Tensor, token_rewards: torch.Tensor, mask: torch.Tensor, group_of: torch.Tensor
) -> torch.Tensor:
    """adv (B,) or (B, T); token_rewards (B, T); mask (B, T) bool; group_of (B,) group index -> (B, T)."""
    m = mask.to(token_rewards.dtype)
    r = token_rewards * m  # (B, T)
    returns = r.flip(-1).cumsum(-1).flip(-1) * m  # (B, T): R_t = sum_{t' >= t} r_t'
    groups = int(group_of.max()) + 1 if group_of.numel() else 0
    tok_sum = torch.zeros(groups, dtype=r.dtype).index_add_(0, group_of, returns.sum(-1))  # (G,)
    tok_count = torch.zeros(groups, dtype=r.dtype).index_add_(0, group_of, m.sum(-1))  # (G,)
    mean = tok_sum / tok_count.clamp_min(1.0)  # (G,)
    centred = (returns - mean[group_of][:, None]) * m  # (B, T)
    base = adv if adv.dim() == 2 else adv[:, None]
    return (base + centred) * m


def distill_term(student_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """k_t = log pi_student(a_t) - log pi_teacher(a_t): (B, T) -> (B, T), zero on padding, detached."""
    return (student_logp.detach() - teacher_logp) * mask.to(teacher_logp.dtype)


def distill_advantages(
    adv: torch.Tensor,
    student_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    task_reward: bool = True,
    normalize: bool = False,
) -> torch.Tensor:
    """adv (B,) or (B, T); logprobs (B, T); mask (B, T) -> A_t - coef * k_t (or -coef * k_t alone)."""
    m = mask.to(teacher_logp.dtype)
    k = distill_term(student_logp, teacher_logp, mask)  # (B, T)
    if normalize:
        inside = k[mask]
        if inside.numel() > 1:
            k = (k - inside.mean()) / (inside.std(unbiased=False) + 1e-6) * m
    term = -coef * k
    if not task_reward:
        return term
    base = adv if adv.dim() == 2 else adv[:, None]
    return (base + term) * m
