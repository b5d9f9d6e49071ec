"""Writes train.jsonl and heldout.jsonl of examples/smollm2: one-digit sums and products as chat rows.

Every question "a op b" (a, b in 0..9, op + or *) is phrased several ways. The held-out rows are
whole questions (a, b, op) that never appear in training in any phrasing, chosen by a fixed seed,
and each is asked in a phrasing of its own. The files are committed: this script documents how
they were made (python examples/smollm2/make_data.py rewrites the same bytes).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).parent
PHRASINGS = [
    "What is {a} {sym} {b}?",
    "Compute {a} {sym} {b}.",
    "{a} {sym} {b} = ?",
    "Calculate {a} {sym} {b}.",
    "What do you get when you {verb} {a} and {b}?",
    "Please work out {a} {sym} {b}.",
]
OPS = {"+": ("add", lambda a, b: a + b), "*": ("multiply", lambda a, b: a * b)}
HELD_OUT_QUESTIONS = 60


def row(a: int, b: int, sym: str, phrasing: str) -> dict:
    verb, fn = OPS[sym]
    text = phrasing.format(a=a, b=b, sym=sym, verb=verb)
    return {"messages": [{"role": "user", "content": text}], "answer": str(fn(a, b)), "op": sym}


def main() -> None:
    rng = random.Random(0)
    questions = [(a, b, sym) for sym in OPS for a in range(10) for b in range(10)]
    rng.shuffle(questions)
    held, train = questions[:HELD_OUT_QUESTIONS], questions[HELD_OUT_QUESTIONS:]
    train_rows = [row(a, b, sym, p) for a, b, sym in train for p in PHRASINGS]
    held_rows = [row(a, b, sym, rng.choice(PHRASINGS)) for a, b, sym in held]
    for name, rows in (("train.jsonl", train_rows), ("heldout.jsonl", held_rows)):
        (HERE / name).write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
