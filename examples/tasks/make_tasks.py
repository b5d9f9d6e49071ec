"""Write the example tasks as JSONL files: one {"prompt": ..., "answer": ...} object per line.

    python examples/tasks/make_tasks.py  # writes subtraction.jsonl, reverse.jsonl, multiply.jsonl, cipher.jsonl here

- subtraction: "73-28=" -> "45", zero-padded operands 00..99 with a >= b (5,050 prompts);
- reverse: "rev:cab=" -> "bac", three letters from a-p (4,096 prompts);
- multiply: "47*6=" -> "282", a two-digit number times one digit 2..9 (720 prompts);
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


def main() -> None:
    write("subtraction", [(f"{a:02d}-{b:02d}=", str(a - b)) for a in range(100) for b in range(a + 1)])
    write(
        "reverse",
        [(f"rev:{''.join(w)}=", "".join(reversed(w))) for w in itertools.product("abcdefghijklmnop", repeat=3)],
    )
    write("cipher", cipher_rows())
    write("multiply", [(f"{a}*{d}=", str(a * d)) for a in range(10, 100) for d in range(2, 10)])


if __name__ == "__main__":
    main()
