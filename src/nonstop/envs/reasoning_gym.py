"""reasoning-gym as a task source: its procedural generators give the rows, its scorers the reward.

`env.name: reasoning_gym/<dataset>` (any name of `reasoning_gym.factory.DATASETS`, e.g.
`basic_arithmetic`, `chain_sum`, `letter_counting`) makes the train rows with
`create_dataset(<dataset>, size=env.train_rows, seed=1, **env.task_options)` and the held-out rows
with seed 2: procedural, no downloads. Each episode asks the row's question; the model's turn is its answer,
scored by the dataset's own `score_answer(answer, entry)` (the reward, in [0, 1]). With
`env.max_turns` above 1, a wrong answer is answered 'Wrong, try again.' and the model answers
again: a multi-turn episode whose reward is the best score.

`demo` is the weak player of the environment warm-up (models/env_warmup.py): it answers right with
probability `DEMO_RIGHT`, else with another row's answer, so the warmed base writes answers in
the dataset's format and is right by chance; RL has to learn which answer each question has.

Optional extra: `pip install 'nonstop[reasoning-gym]'` (reasoning-gym 0.1.25 pulls no torch).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Mapping
from typing import Any

from nonstop.config import ConfigError
from nonstop.envs.base import Step, Tool
from nonstop.tasks.data import Example

PREFIX = "reasoning_gym/"
RETRY = " Wrong, try again. "
DEMO_RIGHT = 0.3
"""How often the warm-up's weak player answers right (else: another row's answer)."""


@functools.cache
def _dataset(name: str, size: int, seed: int, options: tuple[tuple[str, Any], ...] = ()) -> Any:
    try:  # optional: the reasoning-gym extra
        import reasoning_gym
    except ImportError:
        raise ConfigError(
            f"env.name: {PREFIX}{name} needs reasoning-gym: pip install 'nonstop[reasoning-gym]'"
        ) from None
    if name not in reasoning_gym.factory.DATASETS:
        raise ConfigError(f"env.name: reasoning-gym has no dataset {name!r}")
    try:
        return reasoning_gym.create_dataset(name, size=size, seed=seed, **dict(options))
    except TypeError as e:  # an option the dataset's config does not have
        raise ConfigError(f"env.task_options: reasoning-gym dataset {name!r}: {e}") from None


class ReasoningGymTask:
    """The rows of one reasoning-gym dataset and the entries behind them (for scoring)."""

    def __init__(self, name: str, train_rows: int, eval_rows: int, options: Mapping[str, Any] | None = None) -> None:
        self.name = name
        # hashable, for the dataset cache: a YAML list (e.g. basic_arithmetic's operators) as a tuple
        kw = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in (options or {}).items()))
        self.splits = [_dataset(name, train_rows, 1, kw), _dataset(name, eval_rows, 2, kw)]
        self.entries: dict[str, tuple[Any, dict]] = {}
        for ds in self.splits:
            for entry in ds:
                self.entries.setdefault(entry["question"], (ds, entry))

    def rows(self, split: int) -> list[Example]:
        return [Example(i, e["question"], str(e["answer"])) for i, e in enumerate(self.splits[split])]


class ReasoningGymEnv:
    tools: dict[str, Tool] = {}

    def __init__(self, task: ReasoningGymTask) -> None:
        self.task = task
        self.best = 0.0
        self.entry: tuple[Any, dict] | None = None

    async def reset(self, row: Example) -> str:
        self.entry, self.best = self.task.entries[row.prompt], 0.0
        return row.prompt

    async def step(self, action: str) -> Step:
        assert self.entry is not None, "step before reset"
        ds, entry = self.entry
        score = float(ds.score_answer(action.strip(), entry))
        gain, self.best = max(0.0, score - self.best), max(self.best, score)
        if score >= 1.0:
            return Step("", reward=gain, done=True, metadata={"success": True, "score": score})
        return Step(RETRY, reward=gain, metadata={"success": False, "score": self.best})


def demo(row: Example, rng: random.Random, max_turns: int, answers: list[str]) -> list[tuple[str, bool]]:
    """A weak player's episode (the warm-up's transcripts): right by chance, in the answers' format."""
    said = row.answer if rng.random() < DEMO_RIGHT else rng.choice(answers)
    return [(row.prompt, False), (said, True)]
