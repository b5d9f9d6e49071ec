"""Scoring: the stage between generation and the buffer turns completions into rewards.

A reward function maps (completion_text, answer) to a float. Built-ins: `exact_match` (1.0 when
the completion, stripped of whitespace, equals the answer) and `partial_credit` (exact match
scores 1.0; otherwise 0.5 x the fraction of answer characters right in place). Users name their
own as 'package.module:function'. `Scorer.score_group` never lets a faulty reward function take
the run down: an exception or a non-finite value is counted per sample and the whole group is
skipped (a group with a missing reward has no defined advantage), and the caller counts the skip.
"""

from __future__ import annotations

import importlib
import math
from collections import Counter
from collections.abc import Callable
from typing import Protocol

from nonstop.types import Group

RewardFn = Callable[[str, str], float]


class RewardError(ValueError):
    """The reward specification cannot be resolved, or (with fail-fast) a reward failed."""


def exact_match(completion: str, answer: str) -> float:
    return 1.0 if completion.strip() == answer.strip() else 0.0


def partial_credit(completion: str, answer: str) -> float:
    got, want = completion.strip(), answer.strip()
    if got == want:
        return 1.0
    right = sum(1 for a, b in zip(got, want) if a == b)
    return 0.5 * right / max(len(want), 1)


BUILTIN_REWARDS: dict[str, RewardFn] = {"exact_match": exact_match, "partial_credit": partial_credit}


def resolve_reward(spec: str, field: str = "task.reward") -> RewardFn:
    """A built-in name or 'package.module:function' as a function; errors name `field`."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep:
        raise RewardError(
            f"{field}: unknown reward {spec!r}; use one of {sorted(BUILTIN_REWARDS)} or 'package.module:function'"
        )
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise RewardError(f"{field}: cannot import {spec!r}: {e}") from None
    if not callable(fn):
        raise RewardError(f"{field}: {spec!r} is not callable")
    return fn


class Scorer(Protocol):
    errors: Counter[str]
    """Failing samples by kind (e.g. reward_raised); reported per step and in the summary."""
    last_error: str | None
    """The newest failure, in words, for the message that ends a run without learning signal."""

    def score_group(self, group: Group) -> bool:
        """Fill `sample.reward` for every sample; return False if the group must be skipped."""
        ...


class FunctionScorer:
    """Scores each sample with a reward function; faults are counted per sample, and raised as
    RewardError only when `fail_fast` is set."""

    def __init__(self, fn: RewardFn, fail_fast: bool = False) -> None:
        self.fn = fn
        self.fail_fast = fail_fast
        # errors counts failing samples; a group with any failing sample is skipped by the caller
        self.errors: Counter[str] = Counter()
        self.last_error: str | None = None

    def score_group(self, group: Group) -> bool:
        ok = True
        for sample in group.samples:
            try:
                value = float(self.fn(sample.text, group.answer))
            except Exception as e:  # a user's reward function may raise anything
                self.errors["reward_raised"] += 1
                self.last_error = f"reward function raised on prompt {group.prompt!r}: {type(e).__name__}: {e}"
                ok = False
                continue
            if not math.isfinite(value):
                self.errors["reward_not_finite"] += 1
                self.last_error = f"reward function returned {value} on prompt {group.prompt!r}"
                ok = False
                continue
            sample.reward = value
        if not ok and self.fail_fast:
            raise RewardError(f"{self.last_error} (task.reward_fail_fast is set)")
        return ok
