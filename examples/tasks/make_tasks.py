"""Write the example tasks as JSONL files: one {"prompt": ..., "answer": ...} object per line.

    python examples/tasks/make_tasks.py      # writes subtraction.jsonl, reverse.jsonl, multiply.jsonl here

- subtraction: "73-28=" -> "45", zero-padded operands 00..99 with a >= b (5,050 prompts);
- reverse: "rev:cab=" -> "bac", three letters from a-p (4,096 prompts);
- multiply: "47*6=" -> "282", a two-digit number times one digit 2..9 (720 prompts).
"""

import itertools
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def write(name: str, rows: list[tuple[str, str]]) -> None:
    (HERE / f"{name}.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in rows))


def main() -> None:
    write("subtraction", [(f"{a:02d}-{b:02d}=", str(a - b)) for a in range(100) for b in range(a + 1)])
    write("reverse", [(f"rev:{''.join(w)}=", "".join(reversed(w))) for w in itertools.product("abcdefghijklmnop", repeat=3)])
    write("multiply", [(f"{a}*{d}=", str(a * d)) for a in range(10, 100) for d in range(2, 10)])


if __name__ == "__main__":
    main()
