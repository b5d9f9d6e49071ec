"""Nim, a two-player zero-sum game: self-play with one shared policy, and a scripted opponent.

One pile of stones (the task row's answer: 'pile'); players take 1 or 2 in turn; whoever takes
the last stone wins (+1), the other loses (-1); taking 2 from a pile of 1 takes the last one. A
turn that is not '1' or '2' loses at once. The winning strategy leaves the opponent a multiple of 3.

Text format, the same for both roles: a role's prompt is 'n' (and, for the player who moves
first, the pile it faces, '7:'); before each of its turns a role observes the pile it faces,
'5:'; a turn is '1' or '2' + EOS. So one role's sequence reads 'n7:' '1' '4:' '1' '1:' '1'.

- `Nim` is the multi-agent environment of self-play: roles 'first' and 'second', both played by
  the policy; each role's sequence holds its own turns and, as observations, the piles the other
  role left it.
- `NimVsScripted` is the single-agent environment of evaluation: the policy plays one side
  (the row says which) against a fixed opponent that takes 1 or 2 at random (seeded per row).
"""

from __future__ import annotations

import random

from nonstop.envs.base import Step, Tool, Turn
from nonstop.tasks.data import Example

ROLES = ("first", "second")
START = "n"


def _move(action: str, pile: int) -> int | None:
    """Stones taken: '1' or '2' (a 2 from a pile of 1 takes the last one); None for anything else."""
    text = action.strip()
    return min(int(text), pile) if text in ("1", "2") else None


def _other(role: str) -> str:
    return ROLES[1 - ROLES.index(role)]


class Nim:
    roles = ROLES
    tools: dict[str, Tool] = {}

    def __init__(self) -> None:
        self.pile = 0

    async def reset(self, row: Example) -> Turn:
        self.pile = int(row.answer.split(",")[0])
        return Turn({"first": f"{START}{self.pile}:", "second": START}, "first")

    async def step(self, role: str, action: str) -> Turn:
        take = _move(action, self.pile)
        if take is None:
            return Turn({}, None, {role: -1.0, _other(role): 1.0}, {"winner": _other(role), "invalid": True})
        self.pile -= take
        if self.pile == 0:
            return Turn({}, None, {role: 1.0, _other(role): -1.0}, {"winner": role})
        return Turn({_other(role): f"{self.pile}:"}, _other(role))


class NimVsScripted:
    """The policy against a random mover. Row answer: 'pile,side' (side 'first' or 'second')."""

    tools: dict[str, Tool] = {}

    def __init__(self) -> None:
        self.pile, self.rng = 0, random.Random(0)

    def _opponent(self) -> None:
        self.pile -= min(self.pile, self.rng.choice((1, 2)))

    async def reset(self, row: Example) -> str:
        pile, side = row.answer.split(",")
        self.pile, self.rng = int(pile), random.Random(row.index)
        if side == "second":
            self._opponent()  # piles start at >= 3, so the opponent's first move never empties one
        return f"{START}{self.pile}:"

    async def step(self, action: str) -> Step:
        take = _move(action, self.pile)
        if take is None:
            return Step(reward=-1.0, done=True, metadata={"success": False, "invalid": True})
        self.pile -= take
        if self.pile == 0:
            return Step(reward=1.0, done=True, metadata={"success": True})
        self._opponent()
        if self.pile == 0:
            return Step(reward=-1.0, done=True, metadata={"success": False})
        return Step(f"{self.pile}:")


def rows(count: int, seed: int, low: int = 4, high: int = 9) -> list[Example]:
    """Rows 'pile,side': self-play uses the pile; the scripted match also the policy's side."""
    rng = random.Random(seed)
    return [Example(i, START, f"{rng.randint(low, high)},{ROLES[i % 2]}") for i in range(count)]


def demo(row: Example, rng: random.Random, max_turns: int) -> list[tuple[str, bool]]:
    """One side's view of a game between two random movers, until that side's turns run out."""
    pile = int(row.answer.split(",")[0])
    side = row.answer.split(",")[1]
    out: list[tuple[str, bool]] = [(START, False)]
    mover, turns = "first", 0
    while pile > 0 and turns < max_turns:
        take = min(pile, rng.choice((1, 2)))
        if mover == side:
            out += [(f"{pile}:", False), (str(take), True)]
            turns += 1
        pile -= take
        mover = _other(mover)
    return out
