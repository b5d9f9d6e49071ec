"""Guess-the-number: a multi-turn game with feedback.

The environment hides a number in 1..`high` (the task row's answer). Each model turn is one
guess; the environment answers '<' (the number is lower), '>' (higher) or '=' (found: done).
Reward when found: 1 - 0.1 x (guesses - 1), so fewer guesses score higher; an episode that runs
out of turns scores 0. A turn that is not a number in range is answered '!' and costs a turn.

Text format (character tokens): prompt '?'; turns like '4' + EOS; observations one character.
With `high` = 7 and 3 turns, binary search always wins; a policy that ignores the feedback
wins about 1 - (6/7)^3 = 37% of episodes: that is the weak base the warm-up imitates.
"""

from __future__ import annotations

import random

from nonstop.envs.base import Step, Tool
from nonstop.tasks.data import Example

PROMPT = "?"


class GuessNumber:
    tools: dict[str, Tool] = {}

    def __init__(self, high: int = 7) -> None:
        if not 1 <= high <= 9:
            raise ValueError(f"env: guess_number needs 1 <= high <= 9 (one character a guess), got {high}")
        self.high = high
        self.hidden = 0
        self.guesses = 0

    async def reset(self, row: Example) -> str:
        self.hidden, self.guesses = int(row.answer), 0
        return PROMPT

    async def step(self, action: str) -> Step:
        self.guesses += 1
        text = action.strip()
        if not (text.isdigit() and 1 <= int(text) <= self.high):
            return Step("!", metadata={"invalid": True})
        guess = int(text)
        if guess == self.hidden:
            return Step(
                "=",
                reward=1.0 - 0.1 * (self.guesses - 1),
                done=True,
                metadata={"success": True, "guesses": self.guesses},
            )
        return Step("<" if self.hidden < guess else ">")


def rows(count: int, seed: int, high: int = 7) -> list[Example]:
    rng = random.Random(seed)
    return [Example(i, PROMPT, str(rng.randint(1, high))) for i in range(count)]


def demo(row: Example, rng: random.Random, max_turns: int, high: int = 7) -> list[tuple[str, bool]]:
    """A transcript of a player that guesses at random, ignoring the feedback: (text, by_model) pieces."""
    out: list[tuple[str, bool]] = [(PROMPT, False)]
    hidden = int(row.answer)
    for _ in range(max_turns):
        guess = rng.randint(1, high)
        out.append((str(guess), True))
        if guess == hidden:
            out.append(("=", False))
            break
        out.append(("<" if hidden < guess else ">", False))
    return out
