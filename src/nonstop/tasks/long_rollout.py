"""The long-rollout task: modular running sums whose worked solutions have heavy-tailed lengths.

A prompt names a start, a step and a number of steps; the worked solution writes one line per step
and ends with the final answer after GSM8K's marker:

    Add 7 each step and keep the last three digits. Steps: 03. Start: 385
    03: 385 + 7 = 392
    02: 392 + 7 = 399
    01: 399 + 7 = 406
    #### 406

Every line depends only on the line before it (count the steps left down by one, copy the previous
result, add a one-digit step with its carries, keep three digits; after the line of step 01 comes
the answer). The prompt ends with the start value, right before its newline, where a line ends
with its result: the first line copies its value from the same distance as every other line, and
no decision needs the far context. A small model learns the skill quickly, but a
solution is right only if every line is: accuracy falls with the number of steps, and RL has
something to sharpen. The number of steps k is drawn from P(k) proportional to 1/k^2 on
K_MIN..K_MAX, a discrete power law whose tail makes completions long and uneven: 16 BPE tokens per
line, median k 5, 99th percentile about 55 (docs/long_rollout.md has the measured token
distribution).

Generation is pure Python: `random.Random(seed)` and integer weights (no floating point), so the
rows are the same on every machine. The reward is exact match on the final answer (the text after
the last '#### ', scoring/rewards.py): `Example.answer` holds the whole worked solution, which the
supervised warm-up (bench/make_long_base.py) trains on, while scoring compares final answers only.
"""

from __future__ import annotations

import bisect
import itertools
import random
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:  # data.py builds its long-rollout task from this module's rows
    from nonstop.tasks.data import Row

NAME: Final = "long_rollout"
K_MIN, K_MAX = 3, 60
"""Fewest and most steps of a problem: K_MAX keeps the longest solution (965 tokens) under the
1,024 new tokens of examples/long_rollout.yaml."""
MODULUS = 1000
"""Results keep their last three digits, so every running value in a solution has three digits."""
MAX_ADD = 9
"""The step added each line is 1..MAX_ADD: one digit, so a line is a one-digit addition with carries."""
ROWS = 20_000
"""Distinct prompts of the task (train + held-out)."""
ROWS_SEED = 29
"""Seeds the draw of the rows; task.split_seed then splits them, as for the addition task."""
MARKER = "#### "


def prompt_text(start: int, add: int, steps: int) -> str:
    return f"Add {add} each step and keep the last three digits. Steps: {steps:02d}. Start: {start:03d}\n"


def worked_solution(start: int, add: int, steps: int) -> str:
    """One line per step ('i: x + d = y' where i counts the steps left, from `steps` down to 1; the
    counter zero-padded to two digits and values to three, so every line has the same 16 tokens and
    a value sits at a fixed distance from its copy in the line before), then '#### y'."""
    lines, x = [], start
    for i in range(steps, 0, -1):
        y = (x + add) % MODULUS
        lines.append(f"{i:02d}: {x:03d} + {add} = {y:03d}\n")
        x = y
    return "".join(lines) + f"{MARKER}{x:03d}"


def step_weights() -> list[int]:
    """Integer weights of k = K_MIN..K_MAX, proportional to 1/k^2 (exact: no float in the draw)."""
    return [10**12 // (k * k) for k in range(K_MIN, K_MAX + 1)]


_CUMULATIVE = list(itertools.accumulate(step_weights()))


def draw_steps(rng: random.Random) -> int:
    """One number of steps from the power law, using only integer draws of `rng`."""
    return K_MIN + bisect.bisect_right(_CUMULATIVE, rng.randrange(_CUMULATIVE[-1]))


def long_rollout_rows(n: int = ROWS, seed: int = ROWS_SEED) -> list[Row]:
    """`n` distinct (prompt, worked solution) pairs, in draw order; the same on every machine."""
    rng = random.Random(seed)
    seen: set[tuple[int, int, int]] = set()
    rows: list[Row] = []
    while len(rows) < n:
        start, add, steps = rng.randrange(MODULUS), rng.randrange(1, MAX_ADD + 1), draw_steps(rng)
        if (start, add, steps) in seen:  # short problems repeat; every prompt appears once
            continue
        seen.add((start, add, steps))
        rows.append((prompt_text(start, add, steps), worked_solution(start, add, steps)))
    return rows


def corpus(rows: list[Row]) -> list[str]:
    """Prompt + solution texts, what the BPE tokenizer is trained on."""
    return [str(r[0]) + r[1] for r in rows]  # the task's prompts are strings
