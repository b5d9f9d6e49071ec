"""The objective one optimizer update minimises: the policy loss, the reference KL and the entropy bonus.

`policy_objective` is a pure function of (B, T) tensors and the trainer's settings, so every update
of a batch (trainer.updates_per_batch) computes its loss the same way from a fresh forward, against
the same `old` logprobs, advantages, importance weights and reference logprobs.
"""

from __future__ import annotations

import torch

from nonstop.config import TrainerConfig
from nonstop.trainer.losses import clipped_policy_loss, gspo_loss, kl_penalty, masked_mean


def policy_objective(
    cfg: TrainerConfig,
    max_new_tokens: int | None,
    mask: torch.Tensor,  # (B, T) tokens in the loss
    old: torch.Tensor,  # (B, T) logprobs the ratio is taken against
    advantages: torch.Tensor,  # (B,) or (B, T)
    weights: torch.Tensor | None,  # (B, T) importance weights of the off-policy correction, or None
    den: dict[str, torch.Tensor] | None,  # global divisors by norm (trainer.denominators), None: this batch
    ref: torch.Tensor | None,  # (B, T) the reference's logprobs when trainer.kl_coef > 0
    logp: torch.Tensor,  # (B, T) the policy's logprobs, with grad
    entropy: torch.Tensor | None,  # (B, T) the policy's entropy when trainer.entropy_coef > 0
) -> tuple[torch.Tensor, dict, dict]:
    """(loss, the policy loss's stats, extra stats: kl_ref, kl_clamped_frac, entropy as configured)."""
    norm_den = den[cfg.norm] if den else None
    if cfg.loss == "gspo":
        loss, stats = gspo_loss(
            logp,
            old,
            advantages,
            mask,
            cfg.clip_low,
            cfg.clip_high,
            weights,
            den["gspo"] if den else None,
            cfg.clip_ratio_c,
        )
    else:
        loss, stats = clipped_policy_loss(
            logp,
            old,
            advantages,
            mask,
            cfg.clip_low,
            cfg.clip_high,
            cfg.norm,
            weights,
            norm_den,
            cfg.clip_ratio_c,
            max_new_tokens,
        )
    extra: dict = {}
    if ref is not None:
        kl = masked_mean(
            kl_penalty(logp, ref, cfg.kl_estimator, cfg.kl_clamp), mask, cfg.norm, norm_den, max_new_tokens
        )
        loss = loss + cfg.kl_coef * kl
        extra["kl_ref"] = float(kl.detach())
        if cfg.kl_clamp is not None:
            far = ((logp.detach() - ref).abs() > cfg.kl_clamp)[mask]
            extra["kl_clamped_frac"] = float(far.float().mean()) if far.numel() else 0.0
    if entropy is not None:
        ent = masked_mean(entropy, mask, cfg.norm, norm_den, max_new_tokens)
        loss = loss - cfg.entropy_coef * ent
        extra["entropy"] = float(ent.detach())
    return loss, stats, extra


def batch_denominators(mask: torch.Tensor, max_new_tokens: int | None) -> dict[str, torch.Tensor]:
    """The divisors every reduction of `policy_objective` takes for this whole batch by default
    (losses.masked_mean, gspo_loss): 'sequence' and 'gspo' the samples with loss tokens, 'token'
    the loss tokens, 'constant' samples x max_new_tokens. Passed as `den` to the objective of a
    part of the batch (a micro-batch), the part's loss is its share of the whole batch's loss."""
    rows = mask.any(-1).sum().clamp_min(1).float()
    den = {"sequence": rows, "gspo": rows, "token": mask.sum().clamp_min(1).float()}
    if max_new_tokens is not None:
        den["constant"] = torch.tensor(float(mask.shape[0] * max_new_tokens))
    return den
