"""Rewards of bench/scoring.py that worker processes can import by name ('slow_reward:slow_exact_match').

`slow_exact_match` is exact_match after waiting NONSTOP_BENCH_REWARD_DELAY_MS milliseconds (20 by
default), like a remote verifier or an API call: the wait costs no processor time.
`slow_exact_match_async` is the same as an `async def` function.
"""

from __future__ import annotations

import asyncio
import os
import time

from nonstop.scoring.rewards import exact_match

DELAY_S = float(os.environ.get("NONSTOP_BENCH_REWARD_DELAY_MS", "20")) / 1000


def slow_exact_match(completion: str, answer: str) -> float:
    time.sleep(DELAY_S)
    return exact_match(completion, answer)


async def slow_exact_match_async(completion: str, answer: str) -> float:
    """The same wait as an `async def` reward: awaited on the orchestrator's loop, no thread."""
    await asyncio.sleep(DELAY_S)
    return exact_match(completion, answer)
