"""Off-policy importance-sampling corrections: pure functions of logprobs.

Shapes: B samples, T completion positions. `logp_prox` is the trainer's logprob of each token
at the start of the step (detached: the proximal policy), `behaviour_logp` the engine's
(behaviour) logprob of the same token under the processed distribution it sampled from.
The per-token rate r_t = exp(logp_prox_t - behaviour_logp_t).

Kinds (config `trainer.correction`):
- none      : no weight (w = 1); the loss's own ratio against the behaviour logprobs does all;
- tis       : token truncate, w_t = min(r_t, cap);
- mis       : token mask (icepop), w_t = r_t if lo <= r_t <= hi else 0;
- seq_tis   : sequence truncate, w = min(prod_t r_t, cap) for every token of the sample;
- seq_mis   : sequence mask, w = prod_t r_t if lo <= prod_t r_t <= hi else 0;
- geo_tis / geo_mis : as the sequence variants with the geometric mean exp(mean_t log r_t);
- decoupled : decoupled PPO, w_t = r_t (pi_prox / mu) while the trust region clips
              pi_theta / pi_prox (see `losses.policy_loss`).
Weights carry no gradient. With on-policy data (r = 1) every kind gives w = 1.
"""

from __future__ import annotations

from typing import Literal

import torch

Correction = Literal["none", "tis", "mis", "seq_tis", "seq_mis", "geo_tis", "geo_mis", "decoupled"]
CORRECTIONS: tuple[str, ...] = ("none", "tis", "mis", "seq_tis", "seq_mis", "geo_tis", "geo_mis", "decoupled")


def is_weights(
    logp_prox: torch.Tensor,
    behaviour_logp: torch.Tensor,
    mask: torch.Tensor,
    kind: Correction,
    cap: float = 2.0,
    lo: float = 0.5,
    hi: float = 2.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token importance weights (B, T) and the fractions truncated / masked."""
    m = mask.to(logp_prox.dtype)  # (B, T)
    log_r = ((logp_prox - behaviour_logp) * m).detach()  # (B, T), 0 on padding
    zero = torch.tensor(0.0)
    if kind == "none":
        return torch.ones_like(log_r), {"is_truncated_frac": zero, "is_masked_frac": zero}
    if kind in ("tis", "mis", "decoupled"):
        r = log_r.exp()  # (B, T)
    else:
        n = m.sum(-1).clamp_min(1.0)  # (B,)
        seq_log = log_r.sum(-1) if kind.startswith("seq") else log_r.sum(-1) / n  # (B,)
        r = seq_log.exp().unsqueeze(-1).expand_as(log_r)  # (B, T): one rate per sample
    sel = mask.bool()
    if kind in ("tis", "seq_tis", "geo_tis"):
        w = r.clamp(max=cap)
        return w, {"is_truncated_frac": (r > cap)[sel].float().mean() if sel.any() else zero, "is_masked_frac": zero}
    if kind == "decoupled":
        return r, {"is_truncated_frac": zero, "is_masked_frac": zero}
    keep = (r >= lo) & (r <= hi)  # (B, T)
    w = torch.where(keep, r, torch.zeros_like(r))
    return w, {"is_truncated_frac": zero, "is_masked_frac": (~keep)[sel].float().mean() if sel.any() else zero}
