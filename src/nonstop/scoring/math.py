"""`math_verify`: a reward that checks a completion's final answer with the math-verify package.

The reference answer and the completion are parsed (LaTeX, \\boxed{...}, plain expressions) and
compared symbolically: 1.0 when math-verify finds them equal, else 0.0. math-verify is an
optional extra (`pip install 'nonstop[math]'`); naming the reward without it is a RewardError
with that command. Its own signal-based timeouts work only on a main thread, so they are off
here: the scoring stage's `scoring.timeout_s` bounds every call instead (with
`scoring.pool: process` a hung call kills its worker).
"""

from __future__ import annotations

import logging
from typing import Any

from nonstop.scoring.rewards import RewardError


def require_extra() -> Any:
    """The math-verify package; a RewardError naming the extra to install when it is missing (resolve_reward
    calls it when the reward is named, so the error comes before the run starts)."""
    try:  # optional: the math extra
        import math_verify
    except ImportError:
        raise RewardError(
            "task.reward: 'math_verify' needs the math-verify package: "
            "pip install 'nonstop[math]' (or pip install math-verify)"
        ) from None
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its warning that its own timeouts are off, per call
    return math_verify


def math_verify(completion: str, answer: str) -> float:
    mv = require_extra()
    gold = mv.parse(answer, parsing_timeout=None)
    pred = mv.parse(completion, parsing_timeout=None)
    return 1.0 if gold and pred and mv.verify(gold, pred, timeout_seconds=None) else 0.0
