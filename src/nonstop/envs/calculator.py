"""A tool task the model cannot solve without its tool: multiplication through a calculator.

The task row's prompt is a product such as '23*7='; the tiny model cannot multiply. A turn that
starts with 'c' calls the environment's `calc` tool (on the text after 'c', or on the prompt's
expression when there is none); the result comes back as the observation '[161]', zero-padded to
three digits ('[042]'), so that copying it is the same move whatever the product: each answer
character sits a fixed distance after the one it copies. Any other turn is the final answer:
reward 1 when its number equals the product ('42' and '042' both do), else 0, and the episode ends.

Text format: prompt '23*7='; tool turn 'c' + EOS, observation '[161]'; answer '161' + EOS.
The warm-up imitates a player who calls the tool in half of the episodes (and then copies its
result) and otherwise answers with a guess: a weak base that RL turns into "always call it".
"""

from __future__ import annotations

import random

from nonstop.envs.base import Step, ToolStats, call_tool
from nonstop.tasks.data import Example

TOOL_PROB = 0.5
WIDTH = 3
"""Digits of a tool result (products of the rows are 20..891)."""


def calc(expression: str) -> str:
    """Products of non-negative integers only ('23*7'), so no expression is ever evaluated."""
    parts = expression.strip().rstrip("=").split("*")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"calc takes 'a*b', got {expression!r}")
    return str(int(parts[0]) * int(parts[1]))


class Calculator:
    def __init__(self, tool_timeout_s: float = 1.0) -> None:
        self.tools = {"calc": calc}
        self.tool_timeout_s = tool_timeout_s
        self.stats = ToolStats()
        self.expression = ""
        self.tool_calls = 0

    async def reset(self, row: Example) -> str:
        self.expression, self.tool_calls = row.prompt.rstrip("="), 0
        return row.prompt

    async def step(self, action: str) -> Step:
        text = action.strip()
        if text.startswith("c"):
            self.tool_calls += 1
            result = await call_tool(self.tools, "calc", text[1:] or self.expression, self.tool_timeout_s, self.stats)
            return Step(f"[{result.zfill(WIDTH) if result.isdigit() else result}]", metadata={"tool": "calc"})
        right = text.isdigit() and int(text) == int(calc(self.expression))
        return Step("", reward=float(right), done=True, metadata={"success": right, "tool_calls": self.tool_calls})


def rows(count: int, seed: int) -> list[Example]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        a, b = rng.randint(10, 99), rng.randint(2, 9)
        out.append(Example(i, f"{a}*{b}=", str(a * b)))
    return out


def demo(row: Example, rng: random.Random, max_turns: int) -> list[tuple[str, bool]]:
    out: list[tuple[str, bool]] = [(row.prompt, False)]
    if rng.random() < TOOL_PROB and max_turns >= 2:
        shown = row.answer.zfill(WIDTH)  # the tool's result as the environment shows it, copied as it is
        out += [("c", True), (f"[{shown}]", False), (shown, True)]
    else:
        out.append((str(rng.randint(20, 891)), True))
    return out
