"""The optimizer updates of one batch: at once, or micro-batch by micro-batch.

`whole_updates` runs a batch whose forward fits trainer.micro_batch_tokens as one graph over every
row; `micro_updates` runs a larger one micro-batch by micro-batch (the parts of trainer/micro.py):
forward + backward of each, gradients accumulated, each loss divided by the whole batch's
denominators, then one clip and optimizer step, so the update and every statistic equal the
unsplit step's up to float rounding (tests/trainer/test_micro_batch.py). Both make
trainer.updates_per_batch updates (GRPO's mu) against the same behaviour logprobs, advantages and
weights, and return what `Trainer.step` records (`Updates`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch

from nonstop.trainer.batch import Batch
from nonstop.trainer.correction import is_weights
from nonstop.trainer.micro import part_groups, part_rows, split
from nonstop.trainer.objective import batch_denominators, policy_objective
from nonstop.types import Group

if TYPE_CHECKING:  # the trainer calls these functions with itself
    from nonstop.trainer.core import Trainer


@dataclass
class Micro:
    """One micro-batch of a step: its batch rows (b,), its groups, and the (b, T) logprobs [and
    entropy] `forward_ahead` computed for it (graph kept), if it did."""

    rows: torch.Tensor
    groups: list[Group]
    logp: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


@dataclass
class Updates:
    """What the optimizer updates of one batch leave for the step's record."""

    loss: torch.Tensor  # the first update's loss
    stats: dict
    is_stats: dict
    extra: dict
    prox: torch.Tensor  # (B, T) the policy's logprobs at the batch's start, detached
    applied: int
    grad_norm: torch.Tensor
    update_s: float
    last_loss: torch.Tensor
    last_clip: torch.Tensor | None
    routing: dict[str, float]
    ahead: int  # groups whose forward ran ahead of the step


def fit(x: torch.Tensor, T: int) -> torch.Tensor:
    """(b, T_part) -> (b, T): a part's forward right-padded with zeros (outside the loss mask) to the batch's T."""
    return torch.nn.functional.pad(x[:, :T], (0, T - min(x.shape[1], T)))


def whole_updates(t: Trainer, groups: list[Group], batch: Batch, mask: torch.Tensor) -> Updates:
    """The updates of a batch whose forward runs at once: one graph over every row."""
    cfg = t.cfg
    routing: dict[str, float] = {}
    ahead = 0  # groups whose forward ran ahead of the step
    replay = t.routing is not None and "routes" in batch
    if replay:
        logp, entropy, routing = t.routed_forward(batch, cfg.entropy_coef > 0)
    else:
        logp, entropy, ahead = t.policy_logprobs(groups, batch, cfg.entropy_coef > 0)
    prox = logp.detach()  # proximal policy: the policy at the batch's start, for every update of it
    weights, is_stats = is_weights(prox, batch["behaviour"], mask, cfg.correction, cfg.is_cap, cfg.is_lo, cfg.is_hi)
    old = batch["behaviour"] if cfg.correction == "none" else prox
    advantages, token_stats = t.token_advantages(batch, prox)
    den = t.denominators(mask)
    ref = None
    if t.reference is not None:
        with torch.no_grad():
            ref = t.logprobs(batch, t.reference)
    objective = partial(policy_objective, cfg, t.max_new_tokens, mask, old, advantages, weights, den, ref)
    loss, stats, extra = objective(logp, entropy)
    extra.update(token_stats)
    applied, grad_norm, update_s = t.update(loss)
    last_loss, last_clip = loss, stats.get("clip_frac")
    for _ in range(cfg.updates_per_batch - 1):
        if not applied:
            break
        if replay:
            logp, entropy, _ = t.routed_forward(batch, cfg.entropy_coef > 0)
        else:
            logp, entropy = t.forward_batch(batch, cfg.entropy_coef > 0)
        last_loss, last_stats, _ = objective(logp, entropy)
        last_clip = last_stats.get("clip_frac")
        ok, grad_norm, more_s = t.update(last_loss)
        applied, update_s = applied + ok, update_s + more_s
    return Updates(
        loss, stats, is_stats, extra, prox, applied, grad_norm, update_s, last_loss, last_clip, routing, ahead
    )


def micro_updates(t: Trainer, groups: list[Group], batch: Batch, mask: torch.Tensor, budget: int) -> Updates:
    """The updates of a batch over `budget` forward tokens, micro-batch by micro-batch (trainer/micro.py).

    Every update runs forward + backward of one micro-batch at a time, gradients accumulated,
    each micro-batch's loss divided by the whole batch's denominators, so their sum is the
    whole batch's loss; then one clip and optimizer step. The first update's proximal
    logprobs, importance weights and reference logprobs are per row, so each micro-batch takes
    its own from its forward; a distillation teacher's advantages are standardised over the
    batch, so with a teacher a no-grad forward of every micro-batch gives the proximal
    logprobs first. The statistics are computed over the whole batch from the micro-batches'
    detached (B, T) logprobs, as the unsplit step computes them. Groups `forward_ahead` held
    are one micro-batch, run first."""
    cfg = t.cfg
    B, T = batch["targets"].shape
    with_entropy = cfg.entropy_coef > 0
    layout = t.layout()
    found = t.ahead.take(groups, t.policy_version)
    first_row = [0]
    for g in groups:
        first_row.append(first_row[-1] + len(g.samples))
    held = [i for i, h in enumerate(found) if h is not None]
    rest = [i for i, h in enumerate(found) if h is None]
    parts = [[(rest[i], lo, hi) for i, lo, hi in part] for part in split([groups[i] for i in rest], budget, layout)]
    micro = [Micro(part_rows(p, first_row), part_groups(groups, p)) for p in parts]
    if held:
        given = [found[i] for i in held]
        micro.insert(
            0,
            Micro(
                part_rows([(i, 0, len(groups[i].samples)) for i in held], first_row),
                [groups[i] for i in held],
                torch.cat([fit(h.logp, T) for h in given if h is not None]),
                torch.cat([fit(h.entropy, T) for h in given if h is not None and h.entropy is not None])
                if with_entropy
                else None,
            ),
        )
    behaviour = batch["behaviour"]
    den = batch_denominators(mask, t.max_new_tokens)
    prox: torch.Tensor | None = None
    if "teacher" in batch:
        with torch.no_grad():
            prox, _, _, _ = accumulate(t, micro, T, False, None)
    advantages, token_stats = t.token_advantages(batch, prox)
    reference = t.reference
    ref = torch.zeros((B, T)) if reference is not None else None

    def first_loss(m: Micro, mb: Batch | None, logp: torch.Tensor, entropy: torch.Tensor | None) -> torch.Tensor:
        rows = m.rows
        prox_m = prox[rows] if prox is not None else logp.detach()
        w, _ = is_weights(prox_m, behaviour[rows], mask[rows], cfg.correction, cfg.is_cap, cfg.is_lo, cfg.is_hi)
        old_m = behaviour[rows] if cfg.correction == "none" else prox_m
        ref_m = None
        if ref is not None and reference is not None:
            assert mb is not None
            with torch.no_grad():
                ref_m = fit(t.logprobs(mb, reference), T)
            ref[rows] = ref_m
        args = (cfg, t.max_new_tokens, mask[rows], old_m, advantages[rows], w, den, ref_m)
        return policy_objective(*args, logp, entropy)[0]

    t.optimizer.zero_grad(set_to_none=True)
    logp, entropy, ok, routing = accumulate(t, micro, T, with_entropy, first_loss)
    prox = prox if prox is not None else logp
    weights, is_stats = is_weights(prox, behaviour, mask, cfg.correction, cfg.is_cap, cfg.is_lo, cfg.is_hi)
    old = behaviour if cfg.correction == "none" else prox
    objective = partial(policy_objective, cfg, t.max_new_tokens, mask, old, advantages, weights, den, ref)
    loss, stats, extra = objective(logp, entropy)  # detached: the values the unsplit step reports
    extra.update(token_stats)
    extra["micro_batches"] = len(micro)
    applied, grad_norm, update_s = t.apply_update(ok)
    last_loss, last_clip = loss, stats.get("clip_frac")
    micro = [Micro(m.rows, m.groups) for m in micro]  # later updates run every forward afresh

    def later_loss(m: Micro, mb: Batch | None, logp: torch.Tensor, entropy: torch.Tensor | None) -> torch.Tensor:
        rows = m.rows
        ref_m = ref[rows] if ref is not None else None
        args = (cfg, t.max_new_tokens, mask[rows], old[rows], advantages[rows], weights[rows], den, ref_m)
        return policy_objective(*args, logp, entropy)[0]

    for _ in range(cfg.updates_per_batch - 1):
        if not applied:
            break
        t.optimizer.zero_grad(set_to_none=True)
        logp, entropy, ok, _ = accumulate(t, micro, T, with_entropy, later_loss)
        last_loss, last_stats, _ = objective(logp, entropy)
        last_clip = last_stats.get("clip_frac")
        done, grad_norm, more_s = t.apply_update(ok)
        applied, update_s = applied + done, update_s + more_s
    return Updates(
        loss, stats, is_stats, extra, prox, applied, grad_norm, update_s, last_loss, last_clip, routing, len(held)
    )


def accumulate(
    t: Trainer,
    micro: list[Micro],
    T: int,
    with_entropy: bool,
    loss_of: Callable[[Micro, Batch | None, torch.Tensor, torch.Tensor | None], torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor | None, bool, dict[str, float]]:
    """Forward each micro-batch and, with `loss_of(micro, its batch, logp, entropy)`, backward its
    loss into the gradients (a non-finite loss, and every one after it, is not backpropagated).
    Returns the batch's detached (B, T) logprobs [and entropy], whether every loss was finite,
    and the routing fractions over all micro-batches' routed tokens (MoE replay)."""
    B = sum(len(m.rows) for m in micro)
    logp, entropy = torch.zeros((B, T)), torch.zeros((B, T)) if with_entropy else None
    ok = True
    routed: dict[str, float] = {}
    routed_tokens = 0
    for m in micro:
        needs_batch = m.logp is None or (loss_of is not None and t.reference is not None)
        mb = t.batch_of(m.groups) if needs_batch else None
        if m.logp is not None:
            lp, ent = m.logp, m.entropy
        else:
            assert mb is not None
            if t.routing is not None and "routes" in mb:
                lp, ent, fractions = t.routed_forward(mb, with_entropy)
                n = int((mb["routes"][..., 0, 0] >= 0).sum())  # the tokens `fractions` are over
                for k, v in fractions.items():
                    routed[k] = routed.get(k, 0.0) + v * n
                routed_tokens += n if fractions else 0
            else:
                lp, ent = t.forward_batch(mb, with_entropy)
        lp, ent = fit(lp, T), fit(ent, T) if ent is not None else None
        if loss_of is not None:
            loss = loss_of(m, mb, lp, ent)
            ok = ok and t.backward(loss)
        logp[m.rows] = lp.detach()
        if entropy is not None and ent is not None:
            entropy[m.rows] = ent.detach()
    return logp, entropy, ok, {k: v / routed_tokens for k, v in routed.items()} if routed_tokens else {}
