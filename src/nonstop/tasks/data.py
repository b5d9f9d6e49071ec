"""Prompt sources: the built-in addition task and JSONL datasets.

A task yields `Example(index, prompt, answer)` rows split into train and held-out (eval) sets.
A row's prompt is a string, or chat messages (a `messages` list of role/content objects, or TRL's
conversational `prompt` list): those are kept as `Example.messages` and rendered through the
model's chat template once its tokenizer is known (tasks/chat.py), before any prompt is encoded.
The addition task enumerates every pair (a, b) in 0..max_operand, zero-pads operands so that
all prompts share one length ("07+45=" -> "52"; with `pad_answer` answers share one length too:
"052"), shuffles with `task.split_seed` (not the run's seed: every run measures the same
held-out prompts) and holds out the first
`eval_size` pairs. A JSONL dataset is validated row by row: a row that is not an object, lacks
`prompt` or `answer`, or holds non-string values is reported with its line number and skipped;
the skips are counted in `DatasetReport`, never silent. Rows handed over in Python (nonstop.api)
go through the same `check_row` and `split_examples`, so they become the same `Example`s.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nonstop.config import TaskConfig
from nonstop.errors import NonstopError
from nonstop.tasks.long_rollout import long_rollout_rows


class DatasetError(NonstopError, ValueError):
    """The dataset cannot be used at all (missing file, or no valid row)."""


@dataclass(frozen=True, slots=True)
class Example:
    index: int
    prompt: str
    answer: str
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    """The row's other fields (a JSONL object's keys besides prompt and answer), for reward functions."""
    messages: Messages | None = field(default=None, compare=False, hash=False)
    """The row's chat messages, when it gave them instead of a prompt string: `prompt` is then their
    JSON until tasks/chat.py renders them through the model's chat template."""


Messages = tuple[dict[str, str], ...]
"""Chat messages, each {"role": ..., "content": ...} (strings), in order."""

Prompt = str | Messages
Row = tuple[Prompt, str] | tuple[Prompt, str, dict[str, Any]]  # (prompt, answer[, extra fields])


def make_example(index: int, row: Row) -> Example:
    """The Example of a checked row: chat messages kept apart, their JSON standing in as the prompt."""
    prompt, answer = row[0], row[1]
    extra: dict[str, Any] = row[2] if len(row) > 2 else {}
    if isinstance(prompt, tuple):
        return Example(index, json.dumps(prompt), answer, extra, messages=prompt)
    return Example(index, prompt, answer, extra)


def check_messages(value: object) -> Messages | str:
    """Chat messages as a tuple of {"role", "content"} dicts, or what is wrong with them in words."""
    if not isinstance(value, (list, tuple)) or not value:
        return "chat messages must be a non-empty list of {'role': ..., 'content': ...} objects"
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return f"message {i} must be an object with string 'role' and 'content', got {str(m)[:80]!r}"
        out.append({"role": m["role"], "content": m["content"]})
    return tuple(out)


@dataclass
class DatasetReport:
    rows_read: int = 0
    rows_skipped: int = 0
    held_out: str = ""
    """How the held-out split was taken, in words (logged at the start of a run)."""
    problems: list[str] = field(default_factory=list)


@dataclass
class TaskData:
    train: list[Example]
    eval: list[Example]
    report: DatasetReport


def addition_examples(max_operand: int, pad_answer: bool = False) -> list[Row]:
    width, out_width = len(str(max_operand)), len(str(2 * max_operand))
    return [
        (f"{a:0{width}d}+{b:0{width}d}=", f"{a + b:0{out_width if pad_answer else 1}d}")
        for a in range(max_operand + 1)
        for b in range(max_operand + 1)
    ]


def check_row(row: object) -> Row | str:
    """A row's (prompt, answer[, extra]), or what is wrong with it in words. The prompt is a string,
    or chat messages given as `messages` or as a list in `prompt` (TRL's conversational format)."""
    if not isinstance(row, dict):
        return "not a JSON object"
    chat = "messages" in row and "prompt" not in row
    missing = [k for k in ("messages" if chat else "prompt", "answer") if k not in row]
    if missing:
        return f"missing field(s) {', '.join(missing)}"
    if not isinstance(row["answer"], str):
        return "'prompt' and 'answer' must be strings" + (" (or 'prompt' a list of chat messages)" if not chat else "")
    prompt: Prompt
    if chat or isinstance(row["prompt"], list):
        messages = check_messages(row["messages"] if chat else row["prompt"])
        if isinstance(messages, str):
            return f"'{'messages' if chat else 'prompt'}': {messages}"
        prompt = messages
    elif isinstance(row["prompt"], str):
        prompt = row["prompt"]
    else:
        return "'prompt' and 'answer' must be strings (or 'prompt' a list of chat messages)"
    extra = {k: v for k, v in row.items() if k not in ("prompt", "answer", "messages" if chat else "prompt")}
    return (prompt, row["answer"], extra) if extra else (prompt, row["answer"])


def read_jsonl(path: str | Path) -> tuple[list[Row], DatasetReport]:
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"dataset file not found: {path}")

    def checked_lines() -> Iterator[tuple[str, Row | str]]:
        for lineno, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{lineno}", check_row(json.loads(line))
            except json.JSONDecodeError as e:
                yield f"{path}:{lineno}", f"not valid JSON ({e.msg})"

    return collect_rows(checked_lines(), f"dataset {path}")


def collect_rows(
    checked: Iterable[tuple[str, Row | str]], source: str, hint: str = ""
) -> tuple[list[Row], DatasetReport]:
    """Keep the valid (prompt, answer) pairs of `check_row` results labelled by where each row came
    from; every bad row is counted and reported with its label (`hint` appended), never dropped
    silently. A source with no valid row at all is a DatasetError."""
    pairs: list[Row] = []
    report = DatasetReport()
    for where, result in checked:
        report.rows_read += 1
        if isinstance(result, str):
            report.rows_skipped += 1
            report.problems.append(f"{where}: {result}{hint}")
            continue
        pairs.append(result)
    if not pairs:
        raise DatasetError(f"{source} has no valid row ({report.rows_skipped} skipped)")
    return pairs, report


def split_examples(
    pairs: list[Row], eval_size: int, seed: int, report: DatasetReport, eval_fraction: float | None = None
) -> TaskData:
    """Shuffle with `seed` and hold out the first `eval_size` (at most half), or `eval_fraction`
    of the rows, as the eval split; `report.held_out` says what was taken and why."""
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    if eval_fraction is not None:
        n_eval = min(max(1, round(eval_fraction * len(pairs))), len(pairs) - 1)
        how = f"task.eval_fraction={eval_fraction:g}"
    else:
        n_eval = min(eval_size, len(pairs) // 2)
        how = f"task.eval_size={eval_size}" + (", capped at half the rows" if n_eval < eval_size else "")
    report.held_out = (
        f"held out {n_eval} of {len(pairs)} rows ({how}; task.eval_size, task.eval_fraction "
        "or task.eval_path choose the split)"
    )
    examples = [make_example(i, pairs[i]) for i in order]
    return TaskData(train=examples[n_eval:], eval=examples[:n_eval], report=report)


def refuse_bad_rows(report: DatasetReport, source: str, on_bad_row: str) -> None:
    """With task.on_bad_row=error, any skipped row stops the run before training, listing them all."""
    if on_bad_row == "error" and report.rows_skipped:
        raise DatasetError(
            f"{report.rows_skipped} bad row(s) in {source} (task.on_bad_row=error):\n  " + "\n  ".join(report.problems)
        )


def load_task(cfg: TaskConfig, seed: int | None = None) -> TaskData:
    """The task's train and held-out splits, shuffled with `seed` (None: cfg.split_seed)."""
    if cfg.name == "addition":
        pairs, report = addition_examples(cfg.max_operand, cfg.pad_answer), DatasetReport()
        report.rows_read = len(pairs)
    elif cfg.name == "long_rollout":
        pairs, report = long_rollout_rows(), DatasetReport()
        report.rows_read = len(pairs)
    else:
        assert cfg.dataset_path is not None  # guaranteed by TaskConfig validation
        pairs, report = read_jsonl(cfg.dataset_path)
        refuse_bad_rows(report, cfg.dataset_path, cfg.on_bad_row)
        if cfg.eval_path is not None:
            held, held_report = read_jsonl(cfg.eval_path)
            refuse_bad_rows(held_report, cfg.eval_path, cfg.on_bad_row)
            return joined_splits(pairs, report, held, held_report, f"task.eval_path={cfg.eval_path}")
    return split_examples(pairs, cfg.eval_size, cfg.split_seed if seed is None else seed, report, cfg.eval_fraction)


def joined_splits(
    pairs: list[Row], report: DatasetReport, held: list[Row], held_report: DatasetReport, source: str
) -> TaskData:
    """Train on every row of `pairs`, hold out every row of `held` (a separate file or dataset)."""
    report.rows_read += held_report.rows_read
    report.rows_skipped += held_report.rows_skipped
    report.problems += held_report.problems
    report.held_out = f"held out the {len(held)} rows of {source}; all {len(pairs)} dataset rows train"
    return TaskData(
        train=[make_example(i, p) for i, p in enumerate(pairs)],
        eval=[make_example(len(pairs) + j, p) for j, p in enumerate(held)],
        report=report,
    )


def screen_prompts(data: TaskData, encode, limit: int, on_bad_row: str) -> list[str]:
    """Drop examples whose prompt is longer than `limit` tokens, reporting each by its index.

    With on_bad_row='error' the first screening that finds any raises DatasetError listing them
    all; otherwise the problems are returned (and counted in data.report) and the run goes on.
    """
    problems: list[str] = []
    for split in (data.train, data.eval):
        kept = []
        for ex in split:
            n = len(encode(ex.prompt))
            if n > limit:
                problems.append(
                    f"prompt #{ex.index} has {n} tokens, over the limit of {limit} "
                    "(task.max_prompt_tokens, or the model's positions minus rollout.max_new_tokens)"
                )
            else:
                kept.append(ex)
        split[:] = kept
    if problems and on_bad_row == "error":
        raise DatasetError(f"{len(problems)} over-long prompt(s) (task.on_bad_row=error):\n  " + "\n  ".join(problems))
    if not data.train:
        raise DatasetError(f"no train prompt fits in {limit} tokens")
    data.report.rows_skipped += len(problems)
    data.report.problems.extend(problems)
    return problems


@dataclass(frozen=True, slots=True)
class Draw:
    """One prompt taken from the stream: which epoch it belongs to, and the example."""

    epoch: int
    example: Example


class PromptStream:
    """Epochs over the train split, reshuffled each epoch with a seeded RNG: the data cursor.

    `next()` returns prompts in a fixed order for a given seed, or None once `max_epochs` are
    exhausted. Prompts handed back with `requeue` (held by a crashed engine, or in flight at a
    checkpoint) come out first, in the order they were first drawn, keeping their epoch. The
    state (`state_dict`) is plain JSON: restoring it continues the same order exactly.
    """

    def __init__(self, examples: list[Example], seed: int, max_epochs: int | None = None) -> None:
        self._examples = list(examples)
        self._by_index = {ex.index: ex for ex in self._examples}
        self._rng = random.Random(seed)
        self._order: list[int] = []  # remaining positions of the current epoch, next one last
        self._requeued: list[tuple[int, int]] = []  # (epoch, example index), next one first
        self.max_epochs = max_epochs
        self.epoch = -1

    def next(self) -> Draw | None:
        if self._requeued:
            epoch, index = self._requeued.pop(0)
            return Draw(epoch, self._by_index[index])
        if not self._order:
            if self.max_epochs is not None and self.epoch + 1 >= self.max_epochs:
                return None
            self.epoch += 1
            self._order = list(range(len(self._examples)))
            self._rng.shuffle(self._order)
            self._order.reverse()
        return Draw(self.epoch, self._examples[self._order.pop()])

    def requeue(self, draws: list[Draw]) -> None:
        """Hand prompts back; they are drawn again before anything new, in the given order."""
        self._requeued[:0] = [(d.epoch, d.example.index) for d in draws]

    def state_dict(self) -> dict:
        version, internal, gauss = self._rng.getstate()
        return {
            "epoch": self.epoch,
            "order": list(self._order),
            "requeued": [list(r) for r in self._requeued],
            "rng": [version, list(internal), gauss],
        }

    def load_state_dict(self, state: dict) -> None:
        version, internal, gauss = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss))
        self.epoch = state["epoch"]
        self._order = list(state["order"])
        self._requeued = [(int(e), int(i)) for e, i in state["requeued"]]
