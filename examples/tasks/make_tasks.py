"""Write the example tasks as JSONL files: one {"prompt": ..., "answer": ...} object per line.

    python examples/tasks/make_tasks.py  # writes every <task>.jsonl of the list below here

The task matrix (bench/tasks.py, docs/recipe.md), each a kind of task a user brings:
- compare: "07?45=" -> "<", two zero-padded operands 00..99, answer one of < = > (10,000 prompts);
- subtraction: "73-28=" -> "45", zero-padded operands 00..99 with a >= b (5,050 prompts): borrows;
- multiply: "347*6=" -> "2082", a two- or three-digit number times one digit 2..9 (7,920 prompts):
  carries, answers of two to four digits (720 two-digit rows alone were memorised: docs/recipe.md),
  scored with partial credit (task_rewards.digit_credit);
- reverse: "rev:cab=" -> "bac", three letters from a-p (4,096 prompts);
- sort: "sort:dbad=" -> "abdd", four letters from a-h sorted (4,096 prompts);
- repeat: "ab*3=" -> "ababab", one to three letters from a-h, one to four times: answers of 1 to
  12 letters (2,336 prompts);
- opsum: "07#45=" -> "59", an operator the model has never seen (a#b = 2a + b, operands 00..99,
  10,000 prompts), scored with partial credit (task_rewards.digit_credit);
- sumdiff: "73,28=" -> "101\\n45", sum and difference of two zero-padded operands a >= b on two
  lines (5,050 prompts): an answer of more than one line.
And beside the matrix:
- cipher: "enc:ggaehgehfdce=" -> "ccebfcbfdhab", twelve letters from a-h, each replaced by its
  letter in a fixed key (CIPHER_KEY); 10,000 distinct words drawn with a seeded generator, so the
  file is the same on every machine. A long answer with an exact-match reward: the task of
  bench/distill.py, where a weak student's samples almost never earn the reward.
"""

import itertools
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
CIPHER_LETTERS, CIPHER_KEY = "abcdefgh", "egahbdcf"  # letter i of the word becomes its letter in the key


def write(name: str, rows: list[tuple[str, str]]) -> None:
    (HERE / f"{name}.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in rows))


def cipher_rows(words: int = 10_000, length: int = 12, seed: int = 0) -> list[tuple[str, str]]:
    code = dict(zip(CIPHER_LETTERS, CIPHER_KEY))
    rng, seen, rows = random.Random(seed), set(), []
    while len(rows) < words:
        word = "".join(rng.choice(CIPHER_LETTERS) for _ in range(length))
        if word not in seen:
            seen.add(word)
            rows.append((f"enc:{word}=", "".join(code[c] for c in word)))
    return rows


def compare(a: int, b: int) -> str:
    return "<" if a < b else ">" if a > b else "="


def main() -> None:
    pairs = [(a, b) for a in range(100) for b in range(100)]
    below = [(a, b) for a in range(100) for b in range(a + 1)]
    write("compare", [(f"{a:02d}?{b:02d}=", compare(a, b)) for a, b in pairs])
    write("subtraction", [(f"{a:02d}-{b:02d}=", str(a - b)) for a, b in below])
    write(
        "reverse",
        [(f"rev:{''.join(w)}=", "".join(reversed(w))) for w in itertools.product("abcdefghijklmnop", repeat=3)],
    )
    write("cipher", cipher_rows())
    write("multiply", [(f"{a}*{d}=", str(a * d)) for a in range(10, 1000) for d in range(2, 10)])
    write("sort", [(f"sort:{''.join(w)}=", "".join(sorted(w))) for w in itertools.product("abcdefgh", repeat=4)])
    words = ["".join(w) for n in (1, 2, 3) for w in itertools.product("abcdefgh", repeat=n)]
    write("repeat", [(f"{w}*{k}=", w * k) for w in words for k in (1, 2, 3, 4)])
    write("opsum", [(f"{a:02d}#{b:02d}=", str(2 * a + b)) for a, b in pairs])
    write("sumdiff", [(f"{a:02d},{b:02d}=", f"{a + b}\n{a - b}") for a, b in below])


if __name__ == "__main__":
    main()
