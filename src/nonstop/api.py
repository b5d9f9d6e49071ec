"""The Python API: `nonstop.train(config, dataset=..., reward=...)` runs what `nonstop train` runs.

Contract:
- `config`: a `Config`, a YAML path, or None (the defaults); `overrides` are `--set` strings
  ("trainer.lr=3e-4") applied on top; `progress` sets run.progress ("auto", "rich", "plain", "off").
- `dataset`: the train rows, a `datasets.Dataset` or a list of dicts. `columns` maps the
  fields nonstop needs to the dataset's own column names ({"prompt": "question", "answer":
  "solution"}; unmapped fields keep their names, and a mapped column is kept under its own name
  too, for reward functions that read it). A mapped column the dataset does not have is
  a DatasetError naming it and the mapping; a row whose prompt or answer is missing or not a
  string is reported, counted and skipped, or stops the run with task.on_bad_row=error, through
  the same checks as a JSONL file (tasks/data.py). Held-out rows come from `eval_dataset`, or are
  split off the train rows (`eval_size` rows, or `eval_fraction` of them; default task.eval_size;
  at most half), shuffled with task.split_seed. Without `dataset`, the config's task is used.
- `reward`: a callable (completion, answer) -> float, a TRL reward function (one with a parameter
  named `completions`: called per group as TRL's GRPOTrainer calls it, scoring/calls.py), a
  built-in name or 'package.module:function', or a list of these, whose values are summed, each
  times its entry of `reward_weights` (default 1.0); a function that returns None for a sample
  does not count for it, and a sample every function leaves None is left out of training. With
  scoring.pool 'thread' (the default), 'auto' or 'loop', scoring runs in this process on either
  backend, so lambdas and closures work and are never pickled ('auto' moves a module-level
  function slower than 2 ms per sample to worker processes); 'process' needs a callable that
  pickles (a module-level function). Rewards that raise or return a non-finite value are counted
  like task.reward's.
  Without `reward`, task.reward is used. config.yaml records a callable as 'module:qualname'
  when importable, else as 'python:<qualname>' (such a run cannot be resumed from the CLI).
- The base policy: with model.path set, that model (no warm-up, as in the CLI). With the built-in
  tiny model and warmup.enabled, the supervised warm-up runs on the train rows given here; its
  cache lives in warmup.cache_dir/data-<hash of the rows>, so another dataset never reuses it.
- Actor processes start with multiprocessing's 'spawn', which imports the calling script again:
  a script calls `train()` under `if __name__ == "__main__":`.
- Returns the `RunSummary` (also written to the run folder's summary.json); errors are raised
  (ConfigError, DatasetError, RewardError, or the run's own failure).
"""

from __future__ import annotations

import hashlib
import inspect
import multiprocessing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from rich.console import Console

from nonstop.config import Config, ConfigError, load_config
from nonstop.orchestrator.launch import run_training
from nonstop.scoring.calls import WeightedRewards, takes_batch
from nonstop.scoring.rewards import RewardError, RewardFn, resolve_reward
from nonstop.tasks.data import (
    DatasetError,
    DatasetReport,
    Row,
    TaskData,
    check_row,
    collect_rows,
    joined_splits,
    refuse_bad_rows,
    split_examples,
)

if TYPE_CHECKING:
    from nonstop.orchestrator.records import RunSummary

FIELDS = ("prompt", "answer")
RewardSpec = RewardFn | str


def _mapping(columns: Mapping[str, str] | None) -> dict[str, str]:
    mapping = {f: f for f in FIELDS}
    for key, col in (columns or {}).items():
        if key not in FIELDS:
            raise DatasetError(f"columns: unknown field {key!r}; map 'prompt' and/or 'answer' to your column names")
        if not isinstance(col, str):
            raise DatasetError(f"columns[{key!r}]: expected a column name (str), got {type(col).__name__}")
        mapping[key] = col
    return mapping


def _mapping_text(mapping: dict[str, str]) -> str:
    return ", ".join(f"{f} <- {c!r}" for f, c in mapping.items())


def read_rows(rows: Any, mapping: dict[str, str], arg: str) -> tuple[list[Row], DatasetReport]:
    """(prompt, answer) pairs of a datasets.Dataset or a list of dicts, checked like JSONL rows."""
    names = getattr(rows, "column_names", None)
    if isinstance(names, dict):  # a DatasetDict: one list of columns per split
        raise DatasetError(
            f"{arg}: got a DatasetDict with splits {sorted(names)}; pass one split, e.g. {arg}=ds['train']"
        )
    if isinstance(rows, (str, bytes, Mapping)) or not isinstance(rows, Iterable):
        raise DatasetError(f"{arg}: expected a datasets.Dataset or a list of dicts, got {type(rows).__name__}")
    rows = list(rows) if names is None else rows
    if names is None:  # a list: a column is missing when no row has it
        names = sorted({k for row in rows if isinstance(row, Mapping) for k in row})
    missing = [c for c in mapping.values() if c not in names]
    if "prompt" not in names and "messages" in names and mapping["prompt"] == "prompt":
        missing = [c for c in missing if c != "prompt"]  # chat rows: `messages` stands in for the prompt
    if missing:
        raise DatasetError(
            f"{arg}: column(s) {', '.join(map(repr, missing))} not found (columns: "
            f"{_mapping_text(mapping)}); the dataset has {names}"
        )

    def renamed(row: object) -> object:
        """The row under nonstop's field names, every column also kept under its own name: reward
        functions read them (a TRL reward written for a `solution` column still gets `solution`)."""
        if not isinstance(row, Mapping):
            return row
        return {**row, **{f: row[c] for f, c in mapping.items() if c in row}}

    return collect_rows(
        ((f"{arg} row {i}", check_row(renamed(row))) for i, row in enumerate(rows)),
        arg,
        hint=f" (columns: {_mapping_text(mapping)})",
    )


def task_data(
    cfg: Config,
    dataset: Any,
    eval_dataset: Any,
    columns: Mapping[str, str] | None,
    eval_size: int | None,
    eval_fraction: float | None,
) -> TaskData:
    """The train and held-out Examples of rows given in Python."""
    mapping = _mapping(columns)
    pairs, report = read_rows(dataset, mapping, "dataset")
    refuse_bad_rows(report, "dataset", cfg.task.on_bad_row)
    if eval_dataset is None:
        if eval_fraction is not None:
            eval_size = max(1, round(eval_fraction * len(pairs)))
        return split_examples(
            pairs, cfg.task.eval_size if eval_size is None else eval_size, cfg.task.split_seed, report
        )
    if eval_size is not None or eval_fraction is not None:
        raise DatasetError("eval_dataset: give held-out rows, or eval_size / eval_fraction to split them off, not both")
    held, held_report = read_rows(eval_dataset, mapping, "eval_dataset")
    refuse_bad_rows(held_report, "eval_dataset", cfg.task.on_bad_row)
    return joined_splits(pairs, report, held, held_report, "eval_dataset")


def _callable_reward(fn: Any, arg: str) -> RewardFn:
    if isinstance(fn, str):
        return resolve_reward(fn, arg)
    if not callable(fn):
        raise RewardError(
            f"{arg}: expected a callable (completion, answer) -> float, a TRL reward function "
            f"(prompts, completions, completion_ids, **kwargs) -> list, a built-in name or "
            f"'package.module:function', got {type(fn).__name__}"
        )
    if takes_batch(fn):  # TRL's contract: called by keyword with the group's lists (scoring/calls.py)
        return fn
    try:
        inspect.signature(fn).bind("completion", "answer")
    except TypeError as e:
        raise RewardError(f"{arg}: {fn!r} cannot be called as fn(completion, answer): {e}") from None
    except ValueError:  # some builtins have no signature: calling them is the only check
        pass
    return fn


def reward_name(fn: Any) -> str:
    """What config.yaml records for a reward: its spec, else 'module:qualname' when importable."""
    if isinstance(fn, str):
        return fn
    qualname = getattr(fn, "__qualname__", type(fn).__qualname__)
    module = getattr(fn, "__module__", None)
    if module and module != "__main__" and "<" not in qualname:
        return f"{module}:{qualname}"
    return f"python:{qualname}"


def resolve(reward: RewardSpec | Sequence[RewardSpec], weights: Sequence[float] | None) -> tuple[RewardFn, str]:
    """The reward function of `reward` and its recorded name; errors name the argument."""
    if isinstance(reward, (str, bytes)) or not isinstance(reward, Sequence):
        if weights is not None:
            raise RewardError("reward_weights: only with a list of rewards")
        return _callable_reward(reward, "reward"), reward_name(reward)
    if not reward:
        raise RewardError("reward: an empty list; give at least one reward function")
    fns = [_callable_reward(r, f"reward[{i}]") for i, r in enumerate(reward)]
    if weights is not None and len(weights) != len(fns):
        raise RewardError(f"reward_weights: {len(weights)} weights for {len(fns)} rewards")
    ws = [1.0] * len(fns) if weights is None else list(weights)
    name = " + ".join(f"{w:g}*{reward_name(r)}" for w, r in zip(ws, reward))
    return WeightedRewards(fns, ws, name), name


def rows_hash(data: TaskData) -> str:
    """A short hash of every prompt and answer of both splits: the warm-up cache key of rows given here."""
    h = hashlib.sha256()
    for split in (data.train, data.eval):
        for ex in split:
            h.update(f"{len(ex.prompt)}:{ex.prompt}{len(ex.answer)}:{ex.answer}".encode())
        h.update(b"|")
    return h.hexdigest()[:16]


def train(
    config: Config | str | Path | None = None,
    *,
    overrides: Sequence[str] = (),
    dataset: Any = None,
    eval_dataset: Any = None,
    columns: Mapping[str, str] | None = None,
    eval_size: int | None = None,
    eval_fraction: float | None = None,
    reward: RewardSpec | Sequence[RewardSpec] | None = None,
    reward_weights: Sequence[float] | None = None,
    progress: Literal["auto", "rich", "plain", "off"] | None = None,
) -> RunSummary:
    """Run asynchronous GRPO from Python and return its RunSummary (see the module docstring)."""
    if multiprocessing.parent_process() is not None:
        # actor processes are started with 'spawn', which imports the caller's script again
        raise RuntimeError(
            "nonstop.train() was called in a worker process importing your script: "
            'call it under `if __name__ == "__main__":`'
        )
    if isinstance(overrides, str):
        raise ConfigError("overrides: expected a list of 'key=value' strings, got one string")
    extra = [f"run.progress={progress}"] if progress is not None else []
    cfg = load_config(config, [*overrides, *extra])
    fn: RewardFn | None = None
    if reward is not None:
        fn, name = resolve(reward, reward_weights)
        cfg = cfg.model_copy(update={"task": cfg.task.model_copy(update={"reward": name})})
    elif reward_weights is not None:
        raise RewardError("reward_weights: only with a list of rewards")
    data = None
    if dataset is not None:
        if eval_fraction is not None and not 0.0 < eval_fraction < 1.0:
            raise DatasetError(f"eval_fraction: must be between 0 and 1 (got {eval_fraction})")
        if eval_size is not None and eval_size < 1:
            raise DatasetError(f"eval_size: must be at least 1 (got {eval_size})")
        data = task_data(cfg, dataset, eval_dataset, columns, eval_size, eval_fraction)
        if cfg.model.path is None:  # the tiny model's warm-up cache is keyed by these rows
            cache = str(Path(cfg.warmup.cache_dir) / f"data-{rows_hash(data)}")
            cfg = cfg.model_copy(update={"warmup": cfg.warmup.model_copy(update={"cache_dir": cache})})
            if cfg.model.base == "auto" and cfg.warmup.enabled is not False:
                # the shipped bases know only the built-in addition task, not these rows
                cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"base": "warmup"})})
    elif eval_dataset is not None or columns is not None or eval_size is not None or eval_fraction is not None:
        raise DatasetError("dataset: eval_dataset, columns, eval_size and eval_fraction need dataset=")
    return run_training(cfg, Console(), data=data, reward=fn)
