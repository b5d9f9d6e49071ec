"""Reward functions the tests name in configs (`support.rewards:length_reward`): the orchestrator
imports them by that name, so they live in an importable module."""

from __future__ import annotations


def raising_reward(completion: str, answer: str) -> float:
    """Raises for answers divisible by 3 (about a third of the prompts); completion length otherwise."""
    if int(answer) % 3 == 0:
        raise RuntimeError("reward server unavailable")
    return float(len(completion))


def zero_reward(completion: str, answer: str) -> float:
    """The same reward for every completion: no group ever has a learning signal."""
    return 0.0


def ones_reward(completion: str, answer: str) -> float:
    """Counts the '1' characters: rare under a random tiny model, quickly learnt by RL."""
    return float(completion.count("1"))


def always_raising_reward(completion: str, answer: str) -> float:
    raise RuntimeError("reward server is down")


def length_reward(completion: str, answer: str) -> float:
    """Rewards longer completions: varies even for a random model, so advantages are non-zero."""
    return float(len(completion))


def three_chars_reward(completion: str, answer: str) -> float:
    """1.0 for a completion of three characters, right or wrong: pays for a length the held-out exact
    match does not count (the run doctor's reward-without-held-out pattern). The shipped addition
    base writes three characters for about half the prompts (the sums over 99), so RL has signal."""
    return 1.0 if len(completion.strip()) == 3 else 0.0
