"""`nonstop simulate`: calibrate (or load) the cost model, predict one pipeline or a sweep, recommend.

Prints a table (one row per pipeline: predicted samples/s, engine and trainer idle, mean lag and
the lag histogram) and, for a sweep, the recommended pipeline as `--set` overrides.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from nonstop.config import Config, ConfigError
from nonstop.observe.timeline import Timeline
from nonstop.planner.calibrate import calibrate
from nonstop.planner.params import PlanParams, Shape
from nonstop.planner.sweep import Row, predict, recommend, sweep


def parse_axes(axes: tuple[str, ...]) -> dict[str, list[str]]:
    """`KEY=V1,V2` -> {KEY: [V1, V2]}; `K1+K2=A1:A2,B1:B2` varies two fields together (a fixed
    pool split: `runtime.num_engines+trainer.ranks=8:32,12:16`)."""
    out: dict[str, list[str]] = {}
    for a in axes:
        key, sep, values = a.partition("=")
        if not sep or not key.strip() or not values.strip():
            raise ConfigError(f"--sweep {a!r}: expected KEY=V1,V2,..., e.g. buffer.depth=0,1,2,null")
        vals = [v.strip() for v in values.split(",")]
        keys = key.strip().split("+")
        if any(len(v.split(":")) != len(keys) for v in vals):
            raise ConfigError(f"--sweep {a!r}: each value needs {len(keys)} parts joined by ':'")
        out[key.strip()] = vals
    return out


def _lag_text(hist: dict[int, int]) -> str:
    total = sum(hist.values()) or 1
    return " ".join(f"{k}:{v / total:.0%}" for k, v in hist.items() if v / total >= 0.005)


def _short(overrides: tuple[str, ...]) -> str:
    """`runtime.num_engines=2` -> `num_engines=2`: the sweep's columns without their sections."""
    return " ".join(o.split("=", 1)[0].rsplit(".", 1)[-1] + "=" + o.split("=", 1)[1] for o in overrides)


def table(rows: list[Row]) -> Table:
    t = Table(title="nonstop simulate: predicted", header_style="bold", expand=False)
    for col in ("pipeline", "samples/s", "engine idle", "trainer idle", "mean lag", "lag histogram"):
        t.add_column(col)
    for r in sorted(rows, key=lambda r: -r.samples_per_s):
        t.add_row(
            _short(r.overrides) or r.shape.label(),
            f"{r.samples_per_s:.1f}",
            f"{r.engine_idle:.0%}",
            f"{r.trainer_idle:.0%}",
            f"{r.mean_lag:.2f}",
            _lag_text(r.lag_hist),
        )
    return t


def run_planner(
    console: Console,
    cfg: Config,
    run_dir: Path | None,
    params_path: Path | None,
    axes: tuple[str, ...],
    max_mean_lag: float | None,
    seeds: int,
    write_params: Path | None,
) -> None:
    if run_dir is not None:
        params = calibrate(Timeline.load(run_dir), cfg)
    else:
        assert params_path is not None  # the command asks for one of the two
        params = PlanParams.load(params_path)
    if write_params is not None:
        write_params.write_text(params.to_json())
        console.print(f"costs written to {write_params}")
    console.print(f"costs: {params.describe()}", highlight=False)
    if not axes:
        console.print(table([predict(params, Shape.of(cfg), seeds)]))
        return
    rows = sweep(params, cfg, parse_axes(axes), seeds)
    console.print(table(rows))
    best = recommend(rows, max_mean_lag)
    if best is None:
        console.print(f"no pipeline keeps the mean lag within {max_mean_lag}")
    else:
        console.print(
            f"recommended: {' '.join(f'--set {o}' for o in best.overrides)} "
            f"({best.samples_per_s:.1f} samples/s, trainer idle {best.trainer_idle:.0%}, "
            f"mean lag {best.mean_lag:.2f})",
            highlight=False,
        )
