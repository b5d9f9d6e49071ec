"""Reward functions for the scoring-stage tests (importable by name from worker processes)."""

from __future__ import annotations

import asyncio
import os
import time


def sleepy(completion: str, answer: str) -> float:
    """Costs 50 ms, like a remote verifier."""
    time.sleep(0.05)
    return float(len(completion))


def kwargs_reward(completion: str, prompt: str, answer: str, difficulty: int, extra: dict) -> float:
    """Reads the prompt and an extra field of the dataset row by name."""
    return float(difficulty) + (0.5 if prompt.endswith("=") else 0.0) + 0.01 * len(extra)


async def async_reward(completion, answer):
    await asyncio.sleep(0.01)
    return 1.0 if completion == answer else 0.0


def faulty(completion: str, answer: str) -> float:
    """Raises on answers ending in 1, hangs (2 s) on answers ending in 2, sleeps 20 ms otherwise."""
    if answer.endswith("1"):
        raise RuntimeError("verifier unavailable")
    if answer.endswith("2"):
        time.sleep(2)
    time.sleep(0.02)
    return float(len(completion) % 3)


def fault_once(completion: str, answer: str) -> float:
    """The first call for answer '7' hangs (30 s), the first for '8' kills its own worker process;
    later calls answer 1.0 (flag files in $NONSTOP_TEST_FLAGS remember what happened)."""
    flag = os.path.join(os.environ["NONSTOP_TEST_FLAGS"], f"fault-{answer}")
    if answer in ("7", "8") and not os.path.exists(flag):
        open(flag, "w").close()
        if answer == "7":
            time.sleep(30)
        os._exit(7)
    return 1.0


def rank_reward(completions: list[str], answers: list[str]) -> list[float]:
    """A group reward: each completion's rank by length within its group (0 = shortest)."""
    order = sorted(range(len(completions)), key=lambda i: (len(completions[i]), i))
    ranks = [0.0] * len(completions)
    for r, i in enumerate(order):
        ranks[i] = float(r)
    return ranks


def wrong_count(completions, answers):
    return [1.0]


def step_scores(steps: list[str], answer: str) -> list[float]:
    """A process reward: 1.0 for a step that contains the answer's first digit, else -0.5."""
    return [1.0 if answer[0] in step else -0.5 for step in steps]


def kill_reward_model_once(completion: str, answer: str) -> float:
    """SIGKILLs the reward-model actor the first time it runs in a run folder (flag file in the cwd)."""
    import multiprocessing as mp
    import signal

    if not os.path.exists("reward-model-killed"):
        open("reward-model-killed", "w").close()
        for child in mp.active_children():
            if child.name.startswith("nonstop-reward-model"):
                os.kill(child.pid, signal.SIGKILL)
    return float(len(completion) % 2)


def slow_pid(completion: str, answer: str) -> float:
    """Costs 5 ms (over the 2 ms at which pool 'auto' moves a function to processes) and answers
    with the id of the process that ran it."""
    time.sleep(0.005)
    return float(os.getpid())
