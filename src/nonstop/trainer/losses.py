"""Pure tensor functions of the policy-gradient objectives. No model, no state.

Shapes: B samples, T completion positions (padded), V vocabulary, G groups of n samples.
`mask` is True on completion tokens the loss counts (padding, environment-written tokens and
rejected tokens are False). `old_logp` is the logprob the ratio is taken against: the behaviour
logprob for plain GRPO, the proximal (trainer, start of step) logprob under a correction.
`weights` (B, T) are detached importance weights from `correction.is_weights` (1 = none).

Loss family (config `trainer.loss`):
- grpo         : token ratio, clip [1-eps, 1+eps_high], mean per sample then over the samples
                 that have loss tokens ('sequence');
- dr_grpo      : as grpo without length normalisation: sum over tokens / (B x max_new_tokens),
                 a constant, so padding does not change the loss ('constant');
- dapo         : token-level normalisation (mean over all tokens), clip-higher; the trainer
                 also drops truncated (overlong) samples from the loss ('token');
- gspo         : one ratio per sequence, exp(mean_t log ratio_t), clipped per sequence, mean
                 over the samples that have loss tokens;
- reinforce_pp : as dapo's token normalisation, with batch-normalised advantages.
Optional dual clip (`clip_ratio_c` = c > 1): for A < 0 the per-token (GSPO: per-sequence) loss is
capped at -c A, so a ratio far above 1 on a bad sample cannot grow the loss without bound.
"""

from __future__ import annotations

from typing import Literal

import torch

LossType = Literal["grpo", "dr_grpo", "dapo", "gspo", "reinforce_pp"]
AdvantageMode = Literal["group_std", "group_mean", "batch"]
KLEstimator = Literal["k1", "k2", "k3"]
GroupStd = Literal["population", "unbiased"]
Norm = Literal["sequence", "token", "constant"]


def group_advantages(
    rewards: torch.Tensor,
    mode: AdvantageMode | Literal["std", "none"] = "group_std",
    std: GroupStd = "population",
    eps: float = 1e-6,
) -> torch.Tensor:
    """Advantages from rewards (G, n) -> (G, n).

    group_std : (r - group mean) / (group std + eps)   (GRPO)
    group_mean: r - group mean                           (Dr. GRPO: no std normalisation)
    batch     : (r - group mean) / (batch std + eps)   (REINFORCE++ style global normalisation)
    `std` is the group std's estimator: 'population' divides the squared deviations by n,
    'unbiased' by n - 1 (verl's and TRL's choice); for a fixed n they differ by the constant
    factor sqrt(n / (n - 1)). The batch std is always the population one over all G x n values.
    A group whose rewards are all equal (or a group of one) gets zero advantages in every mode.
    """
    centred = rewards - rewards.mean(dim=-1, keepdim=True)  # (G, n)
    if mode in ("group_mean", "none"):
        return centred
    if mode == "batch":
        return centred / (centred.std(unbiased=False) + eps)
    # n = 1 has no unbiased std; its centred reward is 0, and so is its advantage with either
    sd = rewards.std(dim=-1, keepdim=True, unbiased=std == "unbiased" and rewards.shape[-1] > 1)  # (G, 1)
    return centred / (sd + eps)


def masked_mean(
    x: torch.Tensor,
    mask: torch.Tensor,
    norm: Norm,
    denom: torch.Tensor | None = None,
    max_new_tokens: int | None = None,
) -> torch.Tensor:
    """Reduce per-token values x (B, T) over mask (B, T) to a scalar.

    sequence: sum_b [sum_t m x / sum_t m] / #{b : sum_t m > 0}  (a sample with no loss token
              counts in neither sum: it would only shrink the others' weight);
    token   : sum m x / sum m;
    constant: sum m x / (B x max_new_tokens), the generation budget, not the batch's padded
              width, so the same samples padded differently give the same value (Dr. GRPO).
    `denom` replaces the divisor (samples with tokens, tokens, or B x max_new_tokens) when this
    batch is one rank's share of a larger one: every rank then divides by the global count
    (trainer/parallel.py). An all-empty batch reduces to 0."""
    m = mask.to(x.dtype)
    if norm == "sequence":
        n = m.sum(-1)  # (B,)
        per_sample = (x * m).sum(-1) / n.clamp_min(1.0)  # (B,), 0 on an empty row
        return per_sample.sum() / ((n > 0).sum().clamp_min(1).to(x.dtype) if denom is None else denom)
    if norm == "token":
        return (x * m).sum() / (m.sum().clamp_min(1.0) if denom is None else denom)
    if denom is None:
        if max_new_tokens is None:
            raise ValueError("the 'constant' normalisation divides by B x max_new_tokens: pass max_new_tokens")
        denom = torch.tensor(float(x.shape[0] * max_new_tokens))
    return (x * m).sum() / denom


def clipped_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    norm: Norm = "sequence",
    weights: torch.Tensor | None = None,
    denom: torch.Tensor | None = None,
    clip_ratio_c: float | None = None,
    max_new_tokens: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO/GRPO clipped surrogate with a per-token ratio.

    logp, old_logp: (B, T); advantages: (B,), or (B, T) per token (process rewards, distillation);
    mask: (B, T) bool; weights: (B, T) or None.
    ratio_t = exp(logp_t - old_logp_t); per token: l_t = -min(ratio_t A, clip(ratio_t, 1-eps, 1+eps_high) A);
    with dual clip c, l_t = min(l_t, -c A) where A < 0; then l_t w_t, reduced by `norm`.
    Returns the scalar loss and detached statistics over masked tokens.
    """
    high = clip_eps if clip_eps_high is None else clip_eps_high
    ratio = torch.exp(logp - old_logp)  # (B, T)
    adv = advantages if advantages.dim() == 2 else advantages.unsqueeze(-1)  # (B, T) or (B, 1)
    unclipped = ratio * adv  # (B, T)
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + high) * adv  # (B, T)
    per_token = -torch.minimum(unclipped, clipped)  # (B, T)
    per_token, dual = _dual_clip(per_token, adv.expand_as(per_token), clip_ratio_c)
    if weights is not None:
        per_token = per_token * weights
    loss = masked_mean(per_token, mask, norm, denom, max_new_tokens)
    return loss, _ratio_stats(ratio, clipped < unclipped, mask, dual)


def gspo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 3e-4,
    clip_eps_high: float | None = 4e-4,
    weights: torch.Tensor | None = None,
    denom: torch.Tensor | None = None,
    clip_ratio_c: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO: one ratio per sequence, s = exp(mean_t (logp_t - old_logp_t)), clipped per sequence.

    logp, old_logp: (B, T); advantages: (B,); mask: (B, T). Per sample: -min(s A, clip(s) A),
    capped at -c A where A < 0 under dual clip c; mean over samples that have tokens (`denom`:
    their global count). `weights` (B, T) are reduced to one weight per sample by their mean.
    """
    high = clip_eps if clip_eps_high is None else clip_eps_high
    m = mask.to(logp.dtype)
    n = m.sum(-1).clamp_min(1.0)  # (B,)
    s = torch.exp(((logp - old_logp) * m).sum(-1) / n)  # (B,)
    unclipped = s * advantages  # (B,)
    clipped = s.clamp(1.0 - clip_eps, 1.0 + high) * advantages  # (B,)
    per_seq = -torch.minimum(unclipped, clipped)  # (B,)
    per_seq, dual = _dual_clip(per_seq, advantages, clip_ratio_c)
    if weights is not None:
        per_seq = per_seq * (weights * m).sum(-1) / n
    has_tokens = (m.sum(-1) > 0).to(logp.dtype)
    loss = (per_seq * has_tokens).sum() / (has_tokens.sum().clamp_min(1.0) if denom is None else denom)
    token_ratio = torch.exp(logp - old_logp)
    stats = _ratio_stats(
        token_ratio, (clipped < unclipped).unsqueeze(-1).expand_as(mask), mask, dual.unsqueeze(-1).expand_as(mask)
    )
    return loss, stats


def kl_penalty(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    estimator: KLEstimator = "k3",
    clamp: float | None = None,
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi: (B, T) -> (B, T).

    With d = log pi - log ref: k1 = d; k2 = d^2 / 2; k3 = exp(-d) + d - 1 (>= 0).
    The k3 gradient, 1 - exp(-d), is unbounded (and exp(-d) overflows) when log pi << log ref.
    `clamp` = c bounds the log-ratio, d -> clamp(d, -c, c), before the estimator: the value is
    then at most exp(c) + c - 1 (k3), the gradient at most exp(c) - 1 in magnitude, exp never
    overflows, and a token beyond the bound contributes a constant with no gradient.
    """
    d = logp - ref_logp
    if clamp is not None:
        d = d.clamp(-clamp, clamp)
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    return torch.exp(-d) + d - 1.0


def _dual_clip(loss: torch.Tensor, adv: torch.Tensor, c: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """loss, adv: same shape. Where A < 0: min(loss, -c A); returns it and where the cap bit."""
    if c is None:
        return loss, torch.zeros_like(loss, dtype=torch.bool)
    cap = -c * adv
    capped = (adv < 0) & (loss > cap)
    return torch.where(capped, cap, loss), capped


def _ratio_stats(
    ratio: torch.Tensor,
    was_clipped: torch.Tensor,
    mask: torch.Tensor,
    dual_capped: torch.Tensor,
) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        sel = mask.bool()
        if not sel.any():
            one, zero = torch.tensor(1.0), torch.tensor(0.0)
            return {"ratio_mean": one, "ratio_min": one, "ratio_max": one, "clip_frac": zero, "dual_clip_frac": zero}
        r = ratio[sel]
        return {
            "ratio_mean": r.mean(),
            "ratio_min": r.min(),
            "ratio_max": r.max(),
            "clip_frac": was_clipped[sel].float().mean(),
            "dual_clip_frac": dual_capped[sel].float().mean(),
        }
