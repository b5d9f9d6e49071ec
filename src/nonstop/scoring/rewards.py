"""Reward functions by name: the built-ins and 'package.module:function'.

A reward function maps (completion_text, answer) to a float (it may also take the prompt and
the row's extra fields by keyword, or follow TRL's batch contract: calls.py). Built-ins: `exact_match` (1.0 when the
completion, stripped of whitespace, equals the answer; when the answer is a worked solution ending
in GSM8K's '#### <final answer>', when the completion has the marker and the same final answer)
`partial_credit` (exact match scores 1.0; otherwise 0.5 x the fraction of answer characters
right in place) and `last_number` (1.0 when the last number in the completion equals the
answer's number: how chat models' rambling answers are scored, "7 + 5 = 12." scores 1 for
"12"). Users name their own as 'package.module:function'. The scoring stage that calls them,
concurrently with generation and training, is stage.py; `resolve_reward` is the one place a name
becomes a function (the config check, the stage, the process pool's workers, the reference loop).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any

from nonstop.config import ConfigError
from nonstop.config.specs import import_callable
from nonstop.errors import ScoringError

RewardFn = Callable[..., Any]
"""A reward function in any form scoring/calls.py calls: (completion, answer) -> float, by keyword,
or TRL's (prompts, completions, completion_ids, **kwargs) -> list[float | None]."""


class RewardError(ScoringError, ValueError):
    """The reward specification cannot be resolved, or (with fail-fast) a reward failed."""


FINAL_ANSWER_MARKER = "####"


def final_answer(text: str) -> str | None:
    """The text after the last '####', stripped; None when `text` has no marker."""
    _, marker, tail = text.rpartition(FINAL_ANSWER_MARKER)
    return tail.strip() if marker else None


def exact_match(completion: str, answer: str) -> float:
    want = final_answer(answer)
    if want is not None:  # a worked solution: only the final answer counts, and it must be marked
        return 1.0 if final_answer(completion) == want else 0.0
    return 1.0 if completion.strip() == answer.strip() else 0.0


def partial_credit(completion: str, answer: str) -> float:
    got, want = completion.strip(), answer.strip()
    if got == want:
        return 1.0
    right = sum(1 for a, b in zip(got, want) if a == b)
    return 0.5 * right / max(len(want), 1)


NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_number_text(text: str) -> str | None:
    """The last number written in `text`, thousands separators dropped ("1,024" -> "1024"); None if none."""
    found = NUMBER.findall(text)
    return found[-1].replace(",", "").rstrip(".") if found else None


def _as_number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def last_number(completion: str, answer: str) -> float:
    want = last_number_text(final_answer(answer) or answer)
    got = last_number_text(completion)
    if want is None or got is None:
        return 0.0
    a, b = _as_number(got), _as_number(want)
    return 1.0 if a is not None and a == b else 0.0


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "partial_credit": partial_credit,
    "last_number": last_number,
}


OPTIONAL_REWARDS = {"math_verify": "nonstop.scoring.math"}  # built-ins whose package is an optional extra


MOVED_FROM = "nonstop.orchestrator.score:"
"""Where the built-ins lived before they moved here: a run's config.yaml may name one that way
(nonstop.train() records an importable callable as 'module:qualname'), and it still resumes."""


def resolve_reward(spec: str, field: str = "task.reward", folder: str | None = None) -> RewardFn:
    """A built-in name or 'package.module:function' as a function; errors name `field`. A module
    not on the Python path is looked for in `folder`, the user's folder (default: the current one),
    as `python -m` would find it (config/specs.py)."""
    if spec.startswith(MOVED_FROM) and spec.removeprefix(MOVED_FROM) in BUILTIN_REWARDS:
        spec = spec.removeprefix(MOVED_FROM)
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if spec in OPTIONAL_REWARDS:
        module = importlib.import_module(OPTIONAL_REWARDS[spec])
        module.require_extra()  # a clear RewardError when the extra is not installed
        return getattr(module, spec)
    return import_callable(spec, field, RewardError, "reward", [*BUILTIN_REWARDS, *OPTIONAL_REWARDS], folder)


def check_reward(spec: str, field: str = "task.reward") -> None:
    """ConfigError naming `field` when `spec` does not resolve to a reward function (checked before
    a run folder is made)."""
    try:
        resolve_reward(spec, field)
    except RewardError as e:
        raise ConfigError(str(e)) from None
