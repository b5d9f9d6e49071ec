"""Sweeps and a recommendation: the planner's answer to "which pool split, depth and batch?".

`sweep(params, base, axes)` predicts every combination of the `axes` (config fields, each with
a list of values; a key `a+b` with values `x:y` sets two fields together, applied as `--set`
overrides over the `base` config so every value is
validated like a real run's) and returns one `Row` per combination. `recommend(rows,
max_mean_lag)` picks the highest predicted samples/s among the rows whose predicted mean token
lag stays within the bound (the staleness the user accepts), preferring fewer engines and
trainer ranks on a tie within 2%.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass

from nonstop.config import Config, load_config
from nonstop.planner.model import simulate
from nonstop.planner.params import PlanParams, Prediction, Shape


@dataclass
class Row:
    overrides: tuple[str, ...]
    shape: Shape
    samples_per_s: float
    engine_idle: float
    trainer_idle: float
    mean_lag: float
    lag_hist: dict[int, int]


def predict(params: PlanParams, shape: Shape, seeds: int = 3) -> Row:
    preds: list[Prediction] = [simulate(params, shape, seed) for seed in range(seeds)]
    hist: dict[int, int] = {}
    for p in preds:
        for k, v in p.lag_hist.items():
            hist[k] = hist.get(k, 0) + v
    return Row(
        (),
        shape,
        statistics.fmean(p.samples_per_s for p in preds),
        statistics.fmean(p.engine_idle for p in preds),
        statistics.fmean(p.trainer_idle for p in preds),
        statistics.fmean(p.mean_lag for p in preds),
        dict(sorted(hist.items())),
    )


def sweep(params: PlanParams, base: Config, axes: dict[str, list[str]], seeds: int = 3) -> list[Row]:
    """Every combination of `axes` over `base`; a combination the config rejects raises ConfigError."""
    names = list(axes)
    rows = []
    for values in itertools.product(*(axes[n] for n in names)):
        sets = tuple(f"{k}={x}" for n, v in zip(names, values) for k, x in zip(n.split("+"), v.split(":")))
        row = predict(params, Shape.of(load_config(base, sets)), seeds)
        row.overrides = sets
        rows.append(row)
    return rows


def recommend(rows: list[Row], max_mean_lag: float | None = None) -> Row | None:
    ok = [r for r in rows if max_mean_lag is None or r.mean_lag <= max_mean_lag]
    if not ok:
        return None
    best = max(r.samples_per_s for r in ok)
    close = [r for r in ok if r.samples_per_s >= 0.98 * best]
    return min(close, key=lambda r: (r.shape.engines + r.shape.trainer_ranks, r.mean_lag, -r.samples_per_s))
