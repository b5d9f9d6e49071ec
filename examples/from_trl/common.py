"""What the TRL script and its nonstop version share, unchanged: the data, the reward functions and
the GRPOConfig (docs/from_trl.md).

The data is in TRL's conversational format (`prompt` is a list of chat messages) with the extra
columns a TRL script keeps for its rewards. The rewards have TRL's signature. Setting
FROM_TRL_REWARD_LOG to a file records every call of the rewards there, one JSON line per call
(which rows, which columns, which completions, which values): the example's test compares what
TRL and nonstop called them with.
"""

from __future__ import annotations

import json
import os
import re
import threading
from typing import Any

import datasets
from trl import GRPOConfig

NUMBER = re.compile(r"-?\d+")
TRAINER_OBJECTS = ("trainer_state", "log_extra", "log_metric", "environments")
"""What GRPOTrainer passes a reward besides the dataset's columns (nonstop passes none of them)."""
_lock = threading.Lock()


def make_dataset(n: int, start: int = 0) -> datasets.Dataset:
    """Questions on small sums; every fourth row is 'open' (no checkable answer)."""
    rows = []
    for i in range(start, start + n):
        a, b = i % 7, (3 * i) % 5
        open_ended = i % 4 == 3
        content = "Tell me about the number {a}." if open_ended else "What is {a} + {b}?"
        rows.append(
            {
                "prompt": [{"role": "user", "content": content.format(a=a, b=b)}],
                "answer": str(a if open_ended else a + b),
                "task": "open" if open_ended else "sum",
                "row_id": i,
            }
        )
    return datasets.Dataset.from_list(rows)


def _text(completion: Any) -> str:
    return completion[-1]["content"] if isinstance(completion, list) else completion


def _record(reward: str, completions: list, values: list, kwargs: dict[str, Any]) -> None:
    path = os.environ.get("FROM_TRL_REWARD_LOG")
    if not path:
        return
    line = {
        "reward": reward,
        "row_ids": kwargs["row_id"],
        "columns": sorted(k for k in kwargs if k not in TRAINER_OBJECTS),
        "chat": all(isinstance(c, list) for c in completions),
        "completions": [_text(c) for c in completions],
        "answers": kwargs["answer"],
        "values": values,
    }
    with _lock, open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


def correct(prompts: list, completions: list, answer: list[str], task: list[str], **kwargs: Any) -> list[float | None]:
    """1.0 when the completion's last number is the answer; None for open questions (no answer to check)."""
    values: list[float | None] = []
    for completion, want, kind in zip(completions, answer, task):
        found = NUMBER.findall(_text(completion))
        values.append(None if kind == "open" else float(bool(found) and found[-1] == want))
    _record("correct", completions, values, {"answer": answer, "task": task, **kwargs})
    return values


def brief(completions: list, completion_ids: list[list[int]], **kwargs: Any) -> list[float | None]:
    """Shorter is better: 1 - tokens / 16, at least 0."""
    values: list[float | None] = [max(0.0, 1.0 - len(ids) / 16) for ids in completion_ids]
    _record("brief", completions, values, kwargs)
    return values


def grpo_config(output_dir: str) -> GRPOConfig:
    """The run: 2 prompts x 4 completions a step, one pass over the rows, on the CPU."""
    return GRPOConfig(
        output_dir=output_dir,
        num_generations=4,
        per_device_train_batch_size=8,
        max_completion_length=16,
        learning_rate=1e-5,
        beta=0.0,
        loss_type="dapo",
        num_train_epochs=1,
        reward_weights=[1.0, 0.2],
        seed=0,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        save_strategy="no",
        report_to="none",
        logging_steps=1,
    )
