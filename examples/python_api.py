"""Train from Python: a dataset made in code, a lambda reward, a few steps of asynchronous GRPO.

    python examples/python_api.py                       # the built-in tiny model, warmed up on these rows
    python examples/python_api.py model.path=my/model   # any extra KEY=VALUE is a config override

See docs/python_api.md. The call sits under `if __name__ == "__main__":` because the engine and
trainer processes are started with multiprocessing's 'spawn', which imports this script again.
"""

from __future__ import annotations

import sys

import nonstop


def make_rows() -> list[dict[str, str]]:
    """Sums of two digits, in columns named the way a dataset of your own might name them."""
    return [{"question": f"{a}+{b}=", "solution": str(a + b)} for a in range(10) for b in range(10)]


def main(overrides: list[str]) -> nonstop.RunSummary:
    summary = nonstop.train(
        # the tiny model's warm-up on these rows: a short one teaches the answer format, so the
        # exact-match reward below varies within groups (a blank model would score 0 everywhere)
        overrides=[
            "warmup.max_steps=200",
            "run.max_steps=30",
            "run.eval_every=10",
            "rollout.prompts_per_step=8",
            "rollout.max_new_tokens=3",
            "checkpoint.every_steps=null",
            *overrides,
        ],
        dataset=make_rows(),
        columns={"prompt": "question", "answer": "solution"},
        eval_size=20,
        reward=lambda completion, answer: 1.0 if completion.strip() == answer else 0.0,
        progress="plain",
    )
    final = summary.final_accuracy if summary.final_accuracy is not None else summary.base_accuracy
    print(
        f"{summary.steps} steps: held-out accuracy {summary.base_accuracy:.0%} -> {final:.0%}; "
        f"weights in {summary.final_dir}"
    )
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
