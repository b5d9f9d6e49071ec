"""Micro-batches: a step's batch cut into parts whose forward fits a token budget (trainer.micro_batch_tokens).

The trainer keeps every activation of a forward until its backward, so its memory grows with
the tokens the forward sees. `split(groups, budget, layout)` cuts a batch into micro-batches the
trainer runs forward + backward one after the other, accumulating gradients (trainer/core.py):

- a micro-batch is a run of whole groups, in batch order, as long as its tokens stay within the
  budget; a group over the budget on its own is cut into runs of whole samples, each a
  micro-batch of its own (its prompt is then computed once per run instead of once), and a
  single sample over the budget is a micro-batch of its own: a sample is never cut;
- tokens are counted as the forward sees them (`forward_tokens`): with the shared-prompt forward
  (trainer/forward.py) each distinct prompt once, padded to the part's longest prompt, plus every
  completion padded to the part's longest; with the packed forward (trainer/packed.py) the real
  tokens ("packed-prefix": the distinct prompts' shared head once, `shared_prefix_len`); otherwise
  prompt + completion per row, padded to the part's longest row.

A part names its groups by index and its runs of samples (`Part`); `part_rows` gives the batch
rows it covers, so its (b, T_part) forward lands in the batch's (B, T) tensors, and the loss of the
whole batch is the sum of the parts' losses, each divided by the whole batch's denominators.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from nonstop.types import Group, shared_prefix_len

Layout = Literal["shared", "packed", "packed-prefix", "plain"]


def forward_tokens(groups: list[Group], layout: Layout) -> int:
    """Tokens the trainer's forward of `groups` runs through its layers (see the module docstring)."""
    samples = [s for g in groups for s in g.samples]
    if not samples:
        return 0
    if layout == "plain":
        return len(samples) * max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    prompts = {tuple(s.prompt_ids) for s in samples}
    if layout in ("packed", "packed-prefix"):
        shared = shared_prefix_len(list(prompts)) if layout == "packed-prefix" else 0
        return sum(len(p) - shared for p in prompts) + shared + sum(len(s.completion_ids) for s in samples)
    longest_prompt = max(len(p) for p in prompts)
    return len(prompts) * longest_prompt + len(samples) * max(len(s.completion_ids) for s in samples)


Part = list[tuple[int, int, int]]
"""A micro-batch: (group index, first sample, end sample) of each group, or run of a group's samples, in it."""


def split(groups: list[Group], budget: int, layout: Layout) -> list[Part]:
    """`groups` as micro-batches of at most `budget` forward tokens each (but a lone sample over it)."""
    parts: list[Part] = []
    current: Part = []
    for i, g in enumerate(groups):
        n = len(g.samples)
        if forward_tokens(part_groups(groups, [*current, (i, 0, n)]), layout) <= budget:
            current.append((i, 0, n))
            continue
        if current:
            parts.append(current)
        current = [(i, 0, n)]
        if forward_tokens(part_groups(groups, current), layout) <= budget:
            continue
        lo = 0  # over the budget alone: runs of whole samples, each a part of its own
        for hi in range(2, n + 1):
            if forward_tokens(part_groups(groups, [(i, lo, hi)]), layout) > budget:
                parts.append([(i, lo, hi - 1)])
                lo = hi - 1
        parts.append([(i, lo, n)])
        current = []
    if current:
        parts.append(current)
    return parts


def part_groups(groups: list[Group], part: Part) -> list[Group]:
    """The groups of a micro-batch: each whole group itself, a run of its samples a copy holding them."""
    return [
        g if (lo, hi) == (0, len(g.samples)) else dataclasses.replace(g, samples=g.samples[lo:hi])
        for g, lo, hi in ((groups[i], lo, hi) for i, lo, hi in part)
    ]


def part_rows(part: Part, first_row: list[int]) -> torch.Tensor:
    """(b,) the batch rows of a micro-batch; `first_row[i]`: the batch row of group i's first sample."""
    return torch.cat([torch.arange(first_row[i] + lo, first_row[i] + hi) for i, lo, hi in part])
