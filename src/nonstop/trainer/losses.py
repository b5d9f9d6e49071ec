"""Pure tensor functions of the policy-gradient objective. No model, no state.

Shapes: B samples, T completion positions (padded), V vocabulary, G groups of n samples.
`mask` is True on completion tokens that the loss counts (padding and environment-written
tokens are False).
"""

from __future__ import annotations

from typing import Literal

import torch


def group_advantages(rewards: torch.Tensor, scale: Literal["std", "none"] = "std", eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages: reward minus its group mean, divided by the group std when `scale` is 'std'.

    rewards: (G, n) -> (G, n). A group whose rewards are all equal gets zero advantages.
    """
    centred = rewards - rewards.mean(dim=-1, keepdim=True)  # (G, n)
    if scale == "none":
        return centred
    return centred / (rewards.std(dim=-1, keepdim=True, unbiased=False) + eps)


def token_logprobs(
    hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor, temperature: float = 1.0, chunk_rows: int = 64
) -> torch.Tensor:
    """log softmax(head(hidden) / temperature) at `targets`, computed `chunk_rows` rows at a time.

    hidden: (B, T, H); targets: (B, T) -> (B, T). Only one chunk's (rows, T, V) logits exist at
    once, so peak memory does not grow with B x T x V.
    """
    out = []
    for h, t in zip(hidden.split(chunk_rows), targets.split(chunk_rows)):
        logits = head(h).float() / temperature  # (b, T, V)
        out.append(torch.log_softmax(logits, dim=-1).gather(-1, t.unsqueeze(-1)).squeeze(-1))  # (b, T)
    return torch.cat(out)


def clipped_policy_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    norm: Literal["sequence", "token"] = "sequence",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO's clipped surrogate with the per-token ratio against the behaviour logprobs.

    logp, behaviour_logp: (B, T); advantages: (B,); mask: (B, T) bool.
    ratio_t = exp(logp_t - behaviour_logp_t); per token: -min(ratio_t A, clip(ratio_t, 1-eps, 1+eps_high) A).
    norm 'sequence': mean over each sample's tokens, then over samples; 'token': mean over all tokens.
    Returns the scalar loss and detached statistics over masked tokens.
    """
    high = clip_eps if clip_eps_high is None else clip_eps_high
    m = mask.to(logp.dtype)  # (B, T)
    ratio = torch.exp(logp - behaviour_logp)  # (B, T)
    adv = advantages.unsqueeze(-1)  # (B, 1)
    unclipped = ratio * adv  # (B, T)
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + high) * adv  # (B, T)
    per_token = -torch.minimum(unclipped, clipped)  # (B, T)
    if norm == "sequence":
        loss = ((per_token * m).sum(-1) / m.sum(-1).clamp_min(1.0)).mean()
    else:
        loss = (per_token * m).sum() / m.sum().clamp_min(1.0)
    with torch.no_grad():
        sel = mask.bool()
        r = ratio[sel]
        was_clipped = (clipped < unclipped)[sel]
        stats = {
            "ratio_mean": r.mean() if r.numel() else torch.tensor(1.0),
            "ratio_min": r.min() if r.numel() else torch.tensor(1.0),
            "ratio_max": r.max() if r.numel() else torch.tensor(1.0),
            "clip_frac": was_clipped.float().mean() if r.numel() else torch.tensor(0.0),
            "mismatch_kl": (behaviour_logp - logp)[sel].mean() if r.numel() else torch.tensor(0.0),
        }
    return loss, stats
