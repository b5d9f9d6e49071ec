"""A two-role environment for tests of separate policies (env.policies): roles 'a' and 'b' each
write `TURNS` turns, alternately, whatever they write, so both roles always produce model tokens.
A turn scores +1 when its first character has an even code point, else -1 (an empty turn -1):
random for a random tiny model, so groups carry signal for both roles."""

from __future__ import annotations

from nonstop.envs.base import Tool, Turn
from nonstop.tasks.data import Example

TURNS = 2


class Duel:
    roles = ("a", "b")
    tools: dict[str, Tool] = {}

    def __init__(self) -> None:
        self.turns = 0

    async def reset(self, row: Example) -> Turn:
        self.turns = 0
        return Turn({"a": "a?", "b": "b?"}, "a")

    async def step(self, role: str, action: str) -> Turn:
        self.turns += 1
        reward = 1.0 if action and ord(action[0]) % 2 == 0 else -1.0
        other = "b" if role == "a" else "a"
        if self.turns >= 2 * TURNS:
            return Turn({}, None, {role: reward}, {"success": reward > 0})
        return Turn({other: ":"}, other, {role: reward})
