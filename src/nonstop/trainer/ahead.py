"""Forwards run ahead of their step: the trainer's store of some groups' logprobs, graph kept.

While the trainer waits for the last groups of a batch (scored late, or generated late), it can
already run the forward pass of the groups that are there (`Trainer.forward_ahead`). This module
holds those forwards until the step and puts a batch's logprobs together from them and from the
forward of the groups that came later. Contract:

- a held forward serves only a step at the same policy_version (the same weights) and only the
  group it was computed for (same prompt key and the same completion tokens);
- `take` empties the store: a forward serves one step, after which the weights move on;
- the assembled (B, T) tensors hold each group's rows in the batch's order, right-padded with
  zeros to the batch's T (a group's own tokens all lie within T; positions past them are out of
  the loss mask), so the loss and every statistic are computed over the whole batch as without it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from nonstop.types import Group


@dataclass
class Held:
    """One group's forward: (n, T_part) logprobs [and entropy], with the graph."""

    version: int  # the policy_version it was computed with
    group: Group
    tokens: tuple[tuple[int, ...], ...]  # the group's completions
    logp: torch.Tensor  # (n, T_part)
    entropy: torch.Tensor | None  # (n, T_part)


def completions(group: Group) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(s.completion_ids) for s in group.samples)


def by_group(
    groups: list[Group], logp: torch.Tensor, entropy: torch.Tensor | None
) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
    """Each group's rows of a (B, T) forward of `groups`, in order."""
    row = 0
    for g in groups:
        n = len(g.samples)
        yield logp[row : row + n], entropy[row : row + n] if entropy is not None else None
        row += n


class AheadForwards:
    def __init__(self) -> None:
        self.held: dict[tuple[int, int], Held] = {}  # (epoch, prompt_index) -> its forward

    def hold(self, groups: list[Group], version: int, logp: torch.Tensor, entropy: torch.Tensor | None) -> None:
        """Keep the forward (B, T) of `groups`, computed with the weights of `version`."""
        for g, (lp, ent) in zip(groups, by_group(groups, logp, entropy)):
            self.held[(g.epoch, g.prompt_index)] = Held(version, g, completions(g), lp, ent)

    def groups(self) -> list[Group]:
        """The groups whose forward is held now."""
        return [h.group for h in self.held.values()]

    def take(self, groups: list[Group], version: int) -> list[Held | None]:
        """The held forward of each group of a step at `version` (None: compute it now); empties the store."""
        held, self.held = self.held, {}
        found = [held.get((g.epoch, g.prompt_index)) for g in groups]
        return [
            h if h is not None and h.version == version and h.tokens == completions(g) else None
            for h, g in zip(found, groups)
        ]


def assemble(
    found: list[Held | None], fresh: Iterator[tuple[torch.Tensor, torch.Tensor | None]], T: int, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, T) logprobs [and entropy] of a batch from its groups' held rows, and from `fresh` (the
    rows of the groups without one, in order)."""
    rows = [(h.logp, h.entropy) if h is not None else next(fresh) for h in found]

    def fit(x: torch.Tensor) -> torch.Tensor:  # (n, T_part) -> (n, T)
        return torch.nn.functional.pad(x[:, :T], (0, T - min(x.shape[1], T)))

    logp = torch.cat([fit(lp) for lp, _ in rows])  # (B, T)
    if not with_entropy:
        return logp, None
    return logp, torch.cat([fit(e) for _, e in rows if e is not None])  # (B, T)
