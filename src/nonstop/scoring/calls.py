"""How reward functions are called, wherever they run (the event loop, a thread, a worker process).

A reward function may be sync or async. Its parameters decide what it gets:
- a function with a parameter named `completions` is a TRL reward (trl_calls.py): called once per
  group, by keyword, with the lists `prompts`, `completions`, `completion_ids` and every other
  column of the rows, and returns one float or None per sample;
- a function with a parameter named `completion` (or taking **kwargs) is called by keyword with
  those of `prompt`, `completion`, `answer`, `extra` (the row's other fields as one dict) and each
  extra field by its own name that it declares (all of them with **kwargs);
- any other function is called as `fn(completion, answer)` (the original contract).
A per-sample or TRL reward may return None for a sample: no reward of that function applies to it
(`WeightedRewards` sums the others; a sample every function leaves None is left out of training by
the stage). Process-reward functions get `steps` (the completion cut at the delimiter) first: one
with a parameter named `steps` (or **kwargs) is called by keyword like the above plus `steps`, any
other as `fn(steps, answer)`; they return one float per step; group functions get the lists
`prompts`, `completions`, `answers`, `extras` and return one float per sample.
`evaluate(kind, fn, rows)` runs one group's rows and returns one `Outcome` per sample (for a group
function: one for the group): a value, None (not applicable), or a `Failure` saying why (raised,
not_finite, bad_output) in words. It never raises for a fault of the function.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import time
import traceback
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from nonstop.types import Failure, Outcome, RewardKind, RewardRow

if TYPE_CHECKING:
    from nonstop.scoring.threads import DaemonThreads


class WeightedRewards:
    """Several reward functions as one: per sample, the sum of weight x value over the functions that
    returned a value (None: that function does not apply to the sample, as TRL's nansum); None when
    every function returned None. A failure of any function is the failure of the sample (counted by
    the scorer), never a partial sum. Picklable when its functions are (scoring.pool 'process')."""

    def __init__(self, fns: list[Callable[..., Any]], weights: list[float], name: str = "") -> None:
        self.fns, self.weights = list(fns), [float(w) for w in weights]
        self.name = name or " + ".join(f"{w:g}*{getattr(f, '__qualname__', f)}" for w, f in zip(self.weights, fns))

    def __repr__(self) -> str:  # stable across pickling: a reward worker caches functions by it
        return f"WeightedRewards({self.name})"

    def __call__(self, completion: str, answer: str = "", **columns: Any) -> float | None:
        """One sample's combined reward (a string prompt, its other columns by name); the scoring
        stage never calls this: it evaluates the functions over whole groups (`evaluate`)."""
        row = RewardRow(columns.pop("prompt", ""), completion, answer, columns)
        value = _sync_group("sample", self, [row])[0]
        if isinstance(value, Failure):
            raise ValueError(f"{value.reason}: {value.message}")
        return value  # type: ignore[return-value]

    def combine(self, per_fn: list[list[Outcome]]) -> list[Outcome]:
        out: list[Outcome] = []
        for values in zip(*per_fn):
            failed = next((v for v in values if isinstance(v, Failure)), None)
            given = [(w, v) for w, v in zip(self.weights, values) if v is not None]
            if failed is not None:
                out.append(failed)
            else:
                out.append(sum(w * float(v) for w, v in given) if given else None)
        return out


@functools.lru_cache(maxsize=256)
def _signature(fn: Callable[..., Any]) -> tuple[frozenset[str], bool] | None:
    """A function's parameter names and whether it takes **kwargs; None when it has no signature.
    Cached: inspecting a signature costs about ten times what a cheap reward does, at every call."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # some builtins have no signature
        return None
    return frozenset(params), any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _parameters(fn: Callable[..., Any]) -> tuple[frozenset[str], bool] | None:
    try:
        return _signature(fn)
    except TypeError:  # a callable object that does not hash: inspected at each call
        return _signature.__wrapped__(fn)


def _arguments(
    fn: Callable[..., Any], named: dict[str, Any], extra: dict[str, Any], legacy: tuple[Any, ...]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    sig = _parameters(fn)
    if sig is None:  # the original contract
        return legacy, {}
    params, var_kw = sig
    first = next(iter(named))
    if first not in params and not var_kw:
        return legacy, {}
    offered = {**extra, **named, "extra": extra} if "extras" not in named else named
    return (), {k: v for k, v in offered.items() if var_kw or k in params}


def sample_call(fn: Callable[..., Any], row: RewardRow) -> Any:
    named: dict[str, Any] = {"completion": row.completion, "prompt": row.prompt, "answer": row.answer}
    if row.steps is not None:  # a process reward: keyed by `steps`, else called as fn(steps, answer)
        named = {"steps": row.steps, **named}
        args, kwargs = _arguments(fn, named, row.extra, (row.steps, row.answer))
    else:
        args, kwargs = _arguments(fn, named, row.extra, (row.completion, row.answer))
    return fn(*args, **kwargs)


def group_call(fn: Callable[..., Any], rows: list[RewardRow]) -> Any:
    named = {
        "completions": [r.completion for r in rows],
        "prompts": [r.prompt for r in rows],
        "answers": [r.answer for r in rows],
        "extras": [r.extra for r in rows],
    }
    args, kwargs = _arguments(fn, named, {}, (named["completions"], named["answers"]))
    return fn(*args, **kwargs)


TRL_NAMED = ("prompts", "completions", "completion_ids")
"""What TRL's GRPOTrainer passes a reward function by name besides the dataset's columns."""


def takes_batch(fn: Callable[..., Any]) -> bool:
    """Whether a reward function follows TRL's contract: it has a parameter named `completions`
    (`reward_func(prompts, completions, completion_ids, **kwargs) -> list[float | None]`)."""
    if isinstance(fn, WeightedRewards):
        return any(takes_batch(f) for f in fn.fns)
    sig = _parameters(fn)
    return sig is not None and "completions" in sig[0]


def batch_call(fn: Callable[..., Any], rows: list[RewardRow]) -> Any:
    """A TRL reward called on one group's rows as TRL's GRPOTrainer calls it: `prompts` the rows'
    prompt strings, or their chat messages (conversational rows, whose completions are then
    `[{"role": "assistant", "content": text}]`), `completion_ids` the token ids, and every other
    column as a list by its own name (`answer` included); a function without **kwargs gets only
    the columns it declares."""
    named: dict[str, Any] = {
        "prompts": [[dict(m) for m in r.messages] if r.messages is not None else r.prompt for r in rows],
        "completions": [
            [{"role": "assistant", "content": r.completion}] if r.messages is not None else r.completion for r in rows
        ],
        "completion_ids": [list(r.completion_ids or ()) for r in rows],
    }
    columns: dict[str, list[Any]] = {"answer": [r.answer for r in rows]}
    for key in rows[0].extra if rows else ():
        if key not in TRL_NAMED:
            columns[key] = [r.extra.get(key) for r in rows]
    params, var_kw = _parameters(fn) or (frozenset(), True)
    return fn(**{k: v for k, v in {**columns, **named}.items() if var_kw or k in params})


def check_batch(value: Any, n: int) -> list[Outcome]:
    """A TRL reward's returned list as one Outcome per sample: a finite float, None, or a Failure."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        return [Failure("bad_output", f"returned {value!r}, not a list of numbers or None")] * n
    if len(value) != n:
        return [Failure("bad_output", f"returned {len(value)} values for {n} samples")] * n
    return [check("sample", v, [], None) for v in value]


def check(kind: RewardKind, value: Any, rows: list[RewardRow], row: RewardRow | None) -> Outcome:
    """A returned value as an Outcome: finite floats of the expected count, else a Failure."""
    if kind == "sample":
        if value is None:
            return None
        try:
            x = float(value)
        except (TypeError, ValueError):
            return Failure("bad_output", f"returned {value!r}, not a number")
        return x if math.isfinite(x) else Failure("not_finite", f"returned {x}")
    want = len(rows) if kind == "group" else len(row.steps or []) if row is not None else 0
    try:
        xs = [float(v) for v in value]
    except (TypeError, ValueError):
        return Failure("bad_output", f"returned {value!r}, not a list of numbers")
    if len(xs) != want:
        what = "samples" if kind == "group" else "steps"
        return Failure("bad_output", f"returned {len(xs)} values for {want} {what}")
    bad = [x for x in xs if not math.isfinite(x)]
    return xs if not bad else Failure("not_finite", f"returned {bad[0]}")


def _raised(e: BaseException) -> Failure:
    tb = traceback.extract_tb(e.__traceback__)
    where = f" at {tb[-1].filename}:{tb[-1].lineno}" if tb else ""
    return Failure("raised", f"{type(e).__name__}: {e}{where}")


def _is_async(fn: Callable[..., Any]) -> bool:
    if isinstance(fn, WeightedRewards):
        return any(_is_async(f) for f in fn.fns)
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def _batch_sync(fn: Callable[..., Any], rows: list[RewardRow]) -> list[Outcome]:
    try:
        value = batch_call(fn, rows)
    except Exception as e:  # a user's reward function may raise anything
        return [_raised(e)] * len(rows)
    return check_batch(value, len(rows))


async def _batch_async(fn: Callable[..., Any], rows: list[RewardRow]) -> list[Outcome]:
    try:
        value = await batch_call(fn, rows)
    except Exception as e:  # a user's reward function may raise anything
        return [_raised(e)] * len(rows)
    return check_batch(value, len(rows))


def _call_sync(kind: RewardKind, fn: Callable[..., Any], rows: list[RewardRow], row: RewardRow | None) -> Outcome:
    try:
        value = group_call(fn, rows) if row is None else sample_call(fn, row)
    except Exception as e:  # a user's reward function may raise anything
        return _raised(e)
    return check(kind, value, rows, row)


async def _call_async(
    kind: RewardKind, fn: Callable[..., Any], rows: list[RewardRow], row: RewardRow | None
) -> Outcome:
    try:
        value = await (group_call(fn, rows) if row is None else sample_call(fn, row))
    except Exception as e:  # a user's reward function may raise anything
        return _raised(e)
    return check(kind, value, rows, row)


def _sync_group(kind: RewardKind, fn: Callable[..., Any], rows: list[RewardRow]) -> list[Outcome]:
    if isinstance(fn, WeightedRewards):
        return fn.combine([_sync_group(kind, f, rows) for f in fn.fns])
    if kind == "group":
        return [_call_sync(kind, fn, rows, None)]
    if kind == "sample" and takes_batch(fn):
        return _batch_sync(fn, rows)
    return [_call_sync(kind, fn, rows, row) for row in rows]


def _timed_group(kind: RewardKind, fn: Callable[..., Any], rows: list[RewardRow]) -> tuple[list[Outcome], float]:
    t0 = time.perf_counter()
    return _sync_group(kind, fn, rows), time.perf_counter() - t0


async def evaluate(kind: RewardKind, fn: Callable[..., Any], rows: list[RewardRow]) -> list[Outcome]:
    """Outcomes of one group, here on the loop: one per row, or one for the whole group (kind
    'group'). An async function's calls run concurrently; a sync function's one after another,
    blocking the loop (`PooledCalls` runs them in a pool of threads instead). A TRL reward is one
    call for all rows; `WeightedRewards` evaluates each of its functions so and combines them."""
    if isinstance(fn, WeightedRewards):
        return fn.combine(list(await asyncio.gather(*(evaluate(kind, f, rows) for f in fn.fns))))
    if _is_async(fn):
        if kind == "sample" and takes_batch(fn):
            return await _batch_async(fn, rows)
        if kind == "group":
            return [await _call_async(kind, fn, rows, None)]
        return list(await asyncio.gather(*(_call_async(kind, fn, rows, row) for row in rows)))
    return _sync_group(kind, fn, rows)


SPLIT_ROW_S = 0.002
"""A sync reward function that takes longer than this per row has a group's rows run as separate
pool jobs, side by side, so the group's latency is one row's rather than their sum (a 20 ms
verifier: 20 ms, not 8 x 20 ms). That latency matters: the staleness bound lets only a few steps
of groups be in flight, so a group scored late makes the trainer wait. A cheaper function keeps one
job per group, because a hand-off between the loop and a thread costs tens of microseconds, more
than such a function spends on a whole group."""


class PooledCalls:
    """`evaluate` over a pool of daemon threads (scoring/threads.py) that picks, per sync function,
    one job per group or one
    job per row, from the function's measured seconds per row: a moving average timed inside the
    jobs, so time spent waiting in the pool's queue does not count. A function starts with one job
    per group and moves over (and back) as its measured cost crosses SPLIT_ROW_S."""

    def __init__(self, threads: DaemonThreads) -> None:
        self.threads = threads
        self.row_s: dict[int, float] = {}  # id(fn) -> seconds per row; the functions live for the run

    def seconds_per_row(self, fn: Callable[..., Any]) -> float:
        """The function's measured cost per row (0.0 before its first call)."""
        return self.row_s.get(id(fn), 0.0)

    def splits(self, fn: Callable[..., Any]) -> bool:
        return self.seconds_per_row(fn) > SPLIT_ROW_S

    async def __call__(self, kind: RewardKind, fn: Callable[..., Any], rows: list[RewardRow]) -> list[Outcome]:
        if _is_async(fn):
            return await evaluate(kind, fn, rows)
        # a group function and a TRL reward take all rows at once
        split = kind != "group" and len(rows) > 1 and self.splits(fn) and not takes_batch(fn)
        parts = [[row] for row in rows] if split else [rows]
        done = await self.threads.run_all([partial(_timed_group, kind, fn, part) for part in parts])
        if kind != "group" and rows:
            row_s = sum(seconds for _, seconds in done) / len(rows)
            old = self.row_s.get(id(fn))
            self.row_s[id(fn)] = row_s if old is None else 0.8 * old + 0.2 * row_s
        return [outcome for outcomes, _ in done for outcome in outcomes]
