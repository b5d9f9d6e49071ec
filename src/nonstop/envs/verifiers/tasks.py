"""Example verifiers.v1 tasksets for nonstop's tiny model: addition, and products through a tool.

- `addition`: two-operand addition ('07+45='), a real `vf.Taskset` of `vf.Task`s whose reward is
  the task's own `@vf.reward` method (exact match of the last reply), the task the shipped tiny
  base half knows, so a run on it has the "weak, not blank" base RL needs.
  `env.name: verifiers/nonstop.envs.verifiers.tasks:addition` plays it (envs/verifiers/env.py).
- `products`: products like '23*7=' that the tiny model cannot compute, with a tool: the taskset's
  `Calculator` toolset (a verifiers MCP tool server, one for the run, started by
  `python -m nonstop.envs.verifiers.tasks`) offers `calc(expression)`, whose result comes back
  zero-padded to three digits ('161', '042'), so copying it is the same move for every product.
  The reward is the task's `@vf.reward`: the last reply's number equals the product. Played by
  verifiers' own rollout (`env.verifiers_rollout: agent`, envs/verifiers/agent.py); with the
  plain-text tool syntax of envs/tool_calls.py an episode is '23*7=' `@calc 23*7` '[161]' '161'.
  `ProductTaskset.demo` is the weak player the base is warmed up on (models/env_warmup.py): it calls
  the tool in half of the episodes and copies the result, and otherwise guesses.

Any taskset written against verifiers.v1 plugs in the same way.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import verifiers.v1 as vf

from nonstop.envs.tool_calls import format_call
from nonstop.envs.verifiers.renderer import TOOL_CLOSE, TOOL_OPEN

MAX_OPERAND = 99
COUNT = 4096


class AdditionData(vf.TaskData):
    answer: str
    """The sum, as the task's reward compares it."""


class AdditionTask(vf.Task[AdditionData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def exact(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)


class AdditionTaskset(vf.Taskset[AdditionTask, vf.TasksetConfig]):
    def load(self) -> Iterator[AdditionTask]:
        rng = random.Random(0)
        for _ in range(COUNT):
            a, b = rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)
            yield AdditionTask(AdditionData(prompt=f"{a:02d}+{b:02d}=", answer=str(a + b)), self.config.task)


def addition() -> AdditionTaskset:
    return AdditionTaskset(vf.TasksetConfig(id="nonstop-addition"))


WIDTH = 3
"""Digits of a calculator result (the products here are 20..891)."""
TOOL_PROB = 0.5
"""How often the warm-up's weak player calls the tool."""


def multiply(expression: str) -> str:
    """'a*b' of whole numbers -> the product, zero-padded to WIDTH digits; anything else is refused."""
    parts = expression.strip().split("*")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"calc takes 'a*b' of whole numbers, got {expression!r}")
    return str(int(parts[0]) * int(parts[1])).zfill(WIDTH)


class Calculator(vf.Toolset[vf.ToolsetConfig, vf.State]):
    TOOL_PREFIX = None  # the model calls `calc`, not `calculator_calc`

    @vf.tool
    async def calc(self, expression: str) -> str:
        """Multiply two whole numbers: 'a*b' -> the product, zero-padded to three digits."""
        return multiply(expression)


class ProductData(vf.TaskData):
    answer: str
    """The product, as the task's reward compares it."""


class ProductTask(vf.Task[ProductData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def exact(self, trace: vf.Trace) -> float:
        reply = trace.last_reply.strip()
        return float(reply.isdigit() and int(reply) == int(self.data.answer))


class ProductTaskset(vf.Taskset[ProductTask, vf.TasksetConfig]):
    @classmethod
    def toolsets(cls, config: vf.TasksetConfig) -> list[vf.Toolset]:
        return [Calculator(vf.ToolsetConfig())]

    def load(self) -> Iterator[ProductTask]:
        rng = random.Random(0)
        for _ in range(COUNT):
            a, b = rng.randint(10, 99), rng.randint(2, 9)
            yield ProductTask(ProductData(prompt=f"{a}*{b}=", answer=str(a * b)), self.config.task)

    def demo(self, task: ProductTask, rng: random.Random, max_turns: int) -> list[tuple[str, bool]]:
        """A weak player's episode as (text, written by the model) pieces, as the renderer writes them."""
        prompt = str(task.data.prompt)
        if rng.random() < TOOL_PROB and max_turns >= 2:
            result = multiply(prompt.rstrip("="))
            call = format_call("calc", {"expression": prompt.rstrip("=")}, CALC_TOOLS)
            return [(prompt, False), (call, True), (f"{TOOL_OPEN}{result}{TOOL_CLOSE}", False), (result, True)]
        return [(prompt, False), (str(rng.randint(20, 891)), True)]


CALC_TOOLS = [{"name": "calc", "parameters": {"properties": {"expression": {"type": "string"}}}}]
"""`calc`'s schema as the warm-up writes its calls (one string parameter)."""


def products() -> ProductTaskset:
    return ProductTaskset(vf.TasksetConfig(id="nonstop-products"))


if __name__ == "__main__":  # the tool server verifiers starts: python -m nonstop.envs.verifiers.tasks
    Calculator.run()
