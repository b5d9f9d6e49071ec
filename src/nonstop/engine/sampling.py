"""Per-row sampling over one batch of logits, with behaviour logprobs and the Keep Sampling Mask.

Contract of `sample(logits, rows)`:
- every row has its own temperature, top_k, top_p, min_p (as (B,) tensors in `RowParams`);
  temperature 0 is greedy (argmax of the raw logits, logprob of the untempered distribution);
- truncation is applied to the tempered distribution in the order top-k, then top-p over the
  top-k renormalised, then min-p against the most likely token; the most likely token is always
  kept, so the kept set is never empty;
- the behaviour logprob of the chosen token is taken from the processed distribution (tempered,
  renormalised over the kept set): exactly the distribution the token was drawn from;
- sampling is a categorical draw by the inverse of the distribution's cumulative sum, one uniform
  draw per row (`categorical`); rows with their own torch.Generator draw it from theirs, so a
  seeded request produces the same tokens whatever else shares its batch;
- `kept` is a (B, V) bool tensor when any row truncates, else None.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RowParams:
    """Sampling settings of the B rows of a step, as tensors built once per batch composition."""

    temperature: torch.Tensor  # (B,) float, 0 = greedy
    top_k: torch.Tensor  # (B,) long, 0 = off
    top_p: torch.Tensor  # (B,) float, 1 = off
    min_p: torch.Tensor  # (B,) float, 0 = off
    generators: list[torch.Generator | None]
    any_sampled: bool
    any_greedy: bool
    any_truncates: bool
    unit_temperature: bool = False  # every row samples at temperature 1: the logits need no scaling
    seeded: tuple[tuple[int, torch.Generator], ...] = field(init=False)  # (row, generator) of the rows with their own

    def __post_init__(self) -> None:
        self.seeded = tuple((i, g) for i, g in enumerate(self.generators) if g is not None)


def row_params(settings: list[tuple[float, int, float, float]], generators: list[torch.Generator | None]) -> RowParams:
    """The rows' settings as one (B, 4) table whose columns are the per-row tensors, built from the
    distinct settings (a batch usually has one or a few: torch.tensor costs per element) and the
    flags read from those Python values (no tensor reductions)."""
    distinct = list(dict.fromkeys(settings))
    table = torch.tensor(distinct, dtype=torch.float32).view(-1, 4)  # ints and floats below 2**24 are exact
    if len(distinct) > 1:
        at = {x: i for i, x in enumerate(distinct)}
        table = table[torch.tensor([at[x] for x in settings])]
    else:
        table = table.expand(len(settings), 4)
    temps = [t for t, _, _, _ in distinct]
    return RowParams(
        table[:, 0],
        table[:, 1].long(),
        table[:, 2],
        table[:, 3],
        generators,
        any_sampled=any(t > 0 for t in temps),
        any_greedy=any(t == 0 for t in temps),
        any_truncates=any(tt > 0 and (kk > 0 or pp < 1.0 or mm > 0.0) for tt, kk, pp, mm in distinct),
        unit_temperature=all(t == 1.0 for t in temps),
    )


BLOCK = 128  # tokens per block of the two-level cumulative sum in `categorical`
ONE_LEVEL_MAX_V = 1024
"""Up to this vocabulary `categorical` takes one float64 cumulative sum over the whole row: at a
64-row batch it costs 19 us at V = 128 and 62 us at V = 1024, against the two levels' 86 us,
most of which is their fixed cost of some thirty small operations (one thread, 2026-12-06)."""


def categorical(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token ids (B,) drawn from the unnormalised probabilities p (B, V), u (B,) float64 uniform in [0, 1).

    The token is the first whose cumulative probability passes u x the row's total. Up to
    ONE_LEVEL_MAX_V tokens the cumulative sum is taken in float64 over the row; above, in two
    levels (`_two_levels`). A token of probability 0 is never drawn: its cumulative sum equals
    its predecessor's, which already passes u x total whenever it does. Which path runs depends
    on V alone, so a seeded row draws the same token whatever shares its batch."""
    if p.shape[1] > ONE_LEVEL_MAX_V:
        return _two_levels(p, u)
    cum = p.double().cumsum(-1)  # (B, V)
    total = cum[:, -1:]
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))  # (B, 1) < total
    return torch.searchsorted(cum, target, right=True).squeeze(-1)


def _two_levels(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`categorical` for a large vocabulary: the sums of blocks of BLOCK tokens, cumulated in
    float64, pick the block; the chosen block's own cumulative sum picks the token. It reads p
    about twice, against the V random numbers, logarithms and divisions per row of an
    exponential race (a whole 16-row sampling step at a 151,936-token vocabulary: about 12 ms
    against 40)."""
    B, V = p.shape
    pad = (-V) % BLOCK
    q = torch.nn.functional.pad(p, (0, pad)).view(B, -1, BLOCK) if pad else p.view(B, -1, BLOCK)  # (B, nb, BLOCK)
    cum = q.sum(-1).double().cumsum(-1)  # (B, nb)
    total = cum[:, -1:]
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))  # (B, 1) < total
    b = torch.searchsorted(cum, target, right=True).clamp_(max=cum.shape[1] - 1)  # (B, 1): cum[b] > target
    before = torch.where(b > 0, cum.gather(-1, (b - 1).clamp(min=0)), torch.zeros_like(target))  # (B, 1)
    block = q.gather(1, b[:, :, None].expand(B, 1, BLOCK)).squeeze(1)  # (B, BLOCK)
    inner = block.double().cumsum(-1)  # (B, BLOCK)
    j = torch.searchsorted(inner, target - before, right=True).squeeze(-1)  # (B,)
    # rounding between the block's float32 sum and its float64 cumulative sum may overshoot: the
    # last token of positive probability in the block is then the draw
    last = BLOCK - 1 - (block > 0).flip(-1).int().argmax(-1)  # (B,)
    return b.squeeze(-1) * BLOCK + torch.minimum(j, last)


def keep_mask(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Tokens kept by top-k, top-p and min-p together: (B, V) tempered logits -> (B, V) bool."""
    B, V = scaled.shape
    sorted_s, order = scaled.sort(dim=-1, descending=True)  # (B, V)
    k = torch.where(top_k > 0, top_k.clamp(max=V), V)
    kth = sorted_s.gather(-1, (k - 1)[:, None])  # (B, 1)
    keep_sorted = sorted_s >= kth
    probs = torch.softmax(sorted_s.masked_fill(~keep_sorted, float("-inf")), dim=-1)  # top-p sees top-k renormalised
    before = probs.cumsum(-1) - probs  # probability mass strictly ahead of each token
    keep_sorted &= (before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    keep_sorted &= probs >= min_p[:, None] * probs[:, :1]
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def sample(
    logits: torch.Tensor, rows: RowParams, consume: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(B, V) float logits -> tokens (B,), behaviour logprobs (B,), kept (B, V) bool or None.
    `consume`: the caller gives `logits` up, and their memory holds the probabilities (a fresh
    B x V buffer costs its page faults on every step: 4x the exponential's own time at 151,936 ids)."""
    greedy = rows.temperature == 0
    if rows.any_sampled and not rows.unit_temperature:  # x / 1.0 == x: unit temperatures skip the division
        scaled = logits / torch.where(greedy, 1.0, rows.temperature)[:, None]
    else:
        scaled = logits
    kept = None
    if rows.any_truncates:
        truncating = ~greedy & ((rows.top_k > 0) | (rows.top_p < 1.0) | (rows.min_p > 0.0))
        kept = keep_mask(scaled, rows.top_k, rows.top_p, rows.min_p) | ~truncating[:, None]
        scaled = scaled.masked_fill(~kept, float("-inf"))
    logp = torch.log_softmax(scaled, dim=-1)  # (B, V)
    if rows.any_sampled:
        # rows without a generator of their own draw from torch's; request generators live on the host
        B = logp.shape[0]
        u = torch.rand(B, dtype=torch.float64) if len(rows.seeded) < B else torch.empty(B, dtype=torch.float64)
        for i, g in rows.seeded:
            u[i : i + 1].uniform_(generator=g)
        argmax = logits.argmax(-1) if rows.any_greedy else None
        if consume and logits.dtype == logp.dtype:
            with torch.inference_mode(logits.is_inference()):  # the runner's logits are inference tensors
                probs = torch.exp(logp, out=logits)
        else:
            probs = logp.exp()
        tokens = categorical(probs, u.to(logp.device))
        if argmax is not None:
            tokens = torch.where(greedy, argmax, tokens)
    else:
        tokens = logits.argmax(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1), kept
