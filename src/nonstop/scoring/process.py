"""Process rewards: per-step scores placed on the token that ends each step.

The completion text is cut into steps after each `delimiter` (the delimiter stays with the
step it ends; an empty last step is dropped; a completion without delimiter is one step). The
process-reward function (scoring/calls.py, kind 'steps') scores every step of a sample. Step
k's score times `coef` is put on the completion token at which the decoded text first reaches
the end of step k; every other token gets 0. The trainer turns these per-token rewards into
token-level advantages (returns to go, centred per group: trainer/token_advantages.py), added
to the outcome advantage of task.reward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nonstop.config.scoring import ProcessRewardConfig
from nonstop.scoring.base import Contribution
from nonstop.scoring.pool import CallFailed
from nonstop.scoring.runners import Runner
from nonstop.scoring.stage import TRANSIENT, rows_of
from nonstop.types import Group, RewardRow


def split_steps(text: str, delimiter: str) -> list[str]:
    """'a\\nb\\nc' -> ['a\\n', 'b\\n', 'c']; the pieces concatenate back to `text`."""
    parts = text.split(delimiter)
    steps = [p + delimiter for p in parts[:-1]] + [parts[-1]]
    return [s for s in steps if s] or [text]


def step_end_tokens(ids: list[int], steps: list[str], decode: Callable[[list[int]], str]) -> list[int]:
    """Index of the completion token that ends each step (the first whose decoded prefix covers it)."""
    lengths = [len(decode(ids[: t + 1])) for t in range(len(ids))]
    ends, at, t = [], 0, 0
    for step in steps:
        at += len(step)
        while t < len(ids) - 1 and lengths[t] < at:
            t += 1
        ends.append(t)
    return ends


def token_rewards(
    ids: list[int], steps: list[str], scores: list[float], coef: float, decode: Callable[[list[int]], str]
) -> list[float]:
    out = [0.0] * len(ids)
    if ids:
        for t, score in zip(step_end_tokens(ids, steps, decode), scores):
            out[t] += coef * score
    return out


class ProcessRewardComponent:
    name = "process_reward"
    retryable = TRANSIENT

    def __init__(
        self,
        cfg: ProcessRewardConfig,
        fn: Callable[..., Any],
        runner: Runner,
        timeout_s: float,
        decode: Callable[[list[int]], str],
    ) -> None:
        self.cfg, self.fn, self.runner, self.timeout_s, self.decode = cfg, fn, runner, timeout_s, decode

    async def start(self) -> None:
        pass

    async def contribute(self, group: Group) -> Contribution:
        rows = [
            RewardRow(r.prompt, r.completion, r.answer, r.extra, split_steps(r.completion, self.cfg.delimiter))
            for r in rows_of(group)
        ]
        outcomes = await self.runner.run("steps", self.cfg.fn, self.fn, rows, self.timeout_s)
        per_token = []
        for s, row, out in zip(group.samples, rows, outcomes):
            if not isinstance(out, list):
                reason = getattr(out, "reason", "bad_output")
                raise CallFailed(reason, f"on prompt {group.prompt!r}: {getattr(out, 'message', out)}")
            assert row.steps is not None
            per_token.append(token_rewards(s.completion_ids, row.steps, out, self.cfg.coef, self.decode))
        return Contribution(token_rewards=per_token)

    async def close(self) -> None:
        pass
