"""An example verifiers.v1 taskset for nonstop's tiny model: two-operand addition ('07+45=').

A real `vf.Taskset` of `vf.Task`s whose reward is the task's own `@vf.reward` method (exact
match of the last reply), the task the shipped tiny base half knows, so a run on it has the
"weak, not blank" base RL needs. `env.name: verifiers/nonstop.envs.verifiers_tasks:addition`
plays it (envs/verifiers_env.py); any taskset written against verifiers.v1 plugs in the same way.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import verifiers.v1 as vf

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
