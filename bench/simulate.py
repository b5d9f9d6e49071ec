"""Capacity planner check: calibrate on one measured run, predict others, measure them for real.

Runs the built-in job (step-bound, the same steps for every configuration) once to calibrate
the planner from its span log, then predicts and runs each other configuration: buffer depth
0/1/2/unbounded, 1 or 2 engines, two batch sizes. Every figure, predicted and measured, is
taken over the same window (RL start to the last publish) from the span log. Printed: a table
of predicted vs measured samples/s, trainer and engine idle fractions, mean token lag, and how
much of the machine each run had: the processor time the trainer's steps got per second of wall
time (`step cpu/wall`), the processors the planner fits to that run's own span log (`procs`: the
calibration's figure is the one every prediction uses), the processor time the engine passes and
trainer steps took per unit of the calibrated work of the same passes and steps (`work e/t`: 1 is
the calibration run's pace), the processor time the other processes on the machine took while
it ran (`others`, of the machine's total; fresh runs only) and the time stolen by the hypervisor
(`steal`). Two lines before the result repeat the predictions with each run's own fitted
processors, then with its own processor time per unit of work, instead of the calibration's:
the model's error with the machine's share, or its pace, taken as known (diagnostics; the
result is the prediction from the calibration run alone). Last line:

    RESULT max_rel_error=<largest |pred/meas - 1| of samples/s> median_rel_error=<...>
           idle_abs_error=<largest |pred - meas| of the trainer idle fraction>

    python bench/simulate.py --quick          # 40 steps per run, 7 runs
    python bench/simulate.py --steps 80 --out runs/planner   # keep the run folders
    python bench/simulate.py --quick --out runs/planner --reuse   # predict again, measure nothing
    python bench/simulate.py --quick --reverse   # the other configurations measured last first
    python bench/simulate.py --config examples/long_rollout.yaml --steps 20   # the long-rollout arms

`--config` runs every configuration on that file (the long-rollout workload of issue 29: one
engine and the trainer pinned to a core each, so the cells vary the buffer and the batch, not the
engines): calibrated at depth 1, predicted at depth 0 (sync), 2 and unbounded, and at depth 1 with
half and twice the prompts per step.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from rich.console import Console

from nonstop.cli import run_training
from nonstop.config import load_config
from nonstop.observe.timeline import Timeline
from nonstop.planner.calibrate import calibrate
from nonstop.planner.model import simulate
from nonstop.planner.params import PlanParams, Shape

# configuration overrides (key=value) of one run
Cell = dict[str, int | str]

CALIBRATE: Cell = {"buffer.depth": 1, "runtime.num_engines": 1, "rollout.prompts_per_step": 32}
PREDICT: list[Cell] = [
    {"buffer.depth": 0, "runtime.num_engines": 1, "rollout.prompts_per_step": 32},
    {"buffer.depth": 2, "runtime.num_engines": 1, "rollout.prompts_per_step": 32},
    {
        "buffer.depth": "null",
        "buffer.max_lag": 4,
        "buffer.max_queued_groups": 96,
        "runtime.num_engines": 1,
        "rollout.prompts_per_step": 32,
    },
    {"buffer.depth": 1, "runtime.num_engines": 2, "rollout.prompts_per_step": 32},
    {"buffer.depth": 1, "runtime.num_engines": 1, "rollout.prompts_per_step": 16},
    {"buffer.depth": 0, "runtime.num_engines": 2, "rollout.prompts_per_step": 16},
]


# --config: one pinned engine, so only the buffer and the batch vary (examples/long_rollout.yaml)
CONFIG_CALIBRATE: Cell = {"buffer.depth": 1, "buffer.max_lag": 2}


def config_predict(prompts_per_step: int) -> list[Cell]:
    """The --config cells, for a config of `prompts_per_step` prompts a step."""
    return [
        {"buffer.depth": 0, "buffer.max_lag": 0},
        {"buffer.depth": 2, "buffer.max_lag": 3},
        # (max_lag + 1) steps queued, as bench/long_rollout.py's unbounded arm: past that, groups are dropped for lag
        {"buffer.depth": "null", "buffer.max_lag": 4, "buffer.max_queued_groups": 5 * prompts_per_step},
        {"buffer.depth": 1, "buffer.max_lag": 2, "rollout.prompts_per_step": max(1, prompts_per_step // 2)},
        {"buffer.depth": 1, "buffer.max_lag": 2, "rollout.prompts_per_step": 2 * prompts_per_step},
    ]


def overrides(cell: Cell, steps: int, out: str, name: str) -> list[str]:
    return [
        *(f"{k}={v}" for k, v in cell.items()),
        f"run.max_steps={steps}",
        "run.max_time_s=null",
        "run.eval_every=100000",
        "task.eval_size=50",
        "checkpoint.every_steps=null",
        f"run.out_dir={out}",
        f"run.name={name}",
        "run.progress=off",
    ]


def host_times() -> list[int]:
    """The machine's processor time counters (/proc/stat: user nice system idle iowait irq softirq
    steal), summed over its processors; [] where there is no /proc."""
    try:
        return [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except OSError:
        return []


def own_cpu_s() -> float:
    """Processor time of this process and its children that have ended (the run's actors, once
    the run has joined them)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def measure(cell: Cell, steps: int, out: str, name: str, reuse: bool, config: str | None = None):
    """Run one configuration (or, with `reuse`, take the run already there, with its own config).
    The shares of the machine's processor time stolen by its hypervisor (`steal.txt`) and used by
    other processes (`others.txt`: busy time less this run's own) while the run ran are kept
    beside it: another load slows a run without a trace in its span log."""
    folder = Path(out) / name
    if not (reuse and (folder / "summary.json").exists()):
        cfg = load_config(config, overrides=overrides(cell, steps, out, name))
        before, cpu0 = host_times(), own_cpu_s()
        run_training(cfg, Console(quiet=True))
        after, cpu1 = host_times(), own_cpu_s()
        if before and after:
            d = [y - x for x, y in zip(before, after)]
            total = max(sum(d), 1)
            (folder / "steal.txt").write_text(f"{d[7] / total:.3f}\n")
            busy = total - d[3] - d[4] - d[7]  # less idle, iowait and steal
            tick = os.sysconf("SC_CLK_TCK")
            (folder / "others.txt").write_text(f"{max(busy - (cpu1 - cpu0) * tick, 0) / total:.3f}\n")
    return (
        load_config(folder / "config.yaml"),
        Timeline.load(folder),
        _read(folder / "steal.txt"),
        _read(folder / "others.txt"),
    )


def _read(path: Path) -> str:
    return path.read_text().strip() if path.exists() else "-"


def cpu_share(tl: Timeline) -> str:
    """Processor time / wall time of the trainer's steps: below 1 when the step shared a
    processor (with the run's own actors, or with another load on the machine)."""
    steps = [e for e in tl.events.get("trainer-0", []) if e["ev"] == "step"]
    if not steps or not all("cpu_s" in e for e in steps):
        return "-"
    return f"{sum(e['cpu_s'] for e in steps) / sum(e['t1'] - e['t0'] for e in steps):.2f}"


def work_ratio(tl: Timeline, params: PlanParams) -> tuple[float, float]:
    """Processor time the run's engine passes and trainer steps took per unit of the calibrated
    work of the same passes and steps (a + b rows + k reads per pass, c + d tokens per step): above 1 when
    this run's processes needed more processor time for the same work than the calibration
    run's (another tenant of the host sharing its caches and memory, a slower clock); (nan, nan)
    for span logs without processor time."""
    chunks = [e for a in tl.actors("engine") for e in tl.events[a] if e["ev"] == "busy" and e["passes"]]
    steps = [e for e in tl.events.get("trainer-0", []) if e["ev"] == "step"]
    if not all("cpu_s" in e for e in chunks + steps) or not chunks or not steps:
        return math.nan, math.nan
    engine = sum(
        e["passes"] * params.pass_s + e["rows"] * params.pass_row_s + e.get("reads", 0) * params.pass_read_s
        for e in chunks
    )
    trainer = sum(params.step_s + params.step_token_s * e["tokens"] for e in steps)
    return sum(e["cpu_s"] for e in chunks) / engine, sum(e["cpu_s"] for e in steps) / trainer


def at_speed(params: PlanParams, ratio: tuple[float, float]) -> PlanParams:
    """The costs scaled to another run's processor time per unit of work (work_ratio)."""
    e, t = ratio
    if math.isnan(e):
        return params
    return replace(
        params,
        pass_s=params.pass_s * e,
        pass_row_s=params.pass_row_s * e,
        pass_read_s=params.pass_read_s * e,
        step_s=params.step_s * t,
        step_token_s=params.step_token_s * t,
    )


def predict(params: PlanParams, shape: Shape, seeds: int) -> tuple[float, float, float, float]:
    """samples/s, trainer idle, engine idle and mean lag, averaged over `seeds` simulations."""
    preds = [simulate(params, shape, seed) for seed in range(seeds)]
    return (
        statistics.fmean(p.samples_per_s for p in preds),
        statistics.fmean(p.trainer_idle for p in preds),
        statistics.fmean(p.engine_idle for p in preds),
        statistics.fmean(p.mean_lag for p in preds),
    )


def mean_lag(hist: dict[int, int]) -> float:
    total = sum(hist.values())
    return sum(k * v for k, v in hist.items()) / total if total else 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--quick",
        action="store_true",
        help="40 steps per run: a run of the tiny job is seconds long, and one orchestrator pause "
        "(~0.25 s every ~450 groups) is a few percent of it",
    )
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--seeds", type=int, default=3, help="simulation seeds averaged per prediction")
    ap.add_argument("--out", default=None, help="keep the run folders here (default: a temporary folder)")
    ap.add_argument("--reuse", action="store_true", help="with --out: take runs already there instead of running them")
    ap.add_argument(
        "--reverse",
        action="store_true",
        help="run the other configurations last first (the table keeps its order): whether a cell is slow "
        "for its position in the sequence or for its configuration",
    )
    ap.add_argument("--config", default=None, help="a run config every configuration starts from (see above)")
    ns = ap.parse_args()
    steps = 40 if ns.quick else ns.steps
    if ns.config:
        pps = load_config(ns.config).rollout.prompts_per_step
        calibrate_cell, predict_cells = CONFIG_CALIBRATE, config_predict(pps)
    else:
        calibrate_cell, predict_cells = CALIBRATE, PREDICT
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = ns.out or tmp
        cfg, tl, steal, others = measure(calibrate_cell, steps, out, "calibrate", ns.reuse, ns.config)
        params = calibrate(tl, cfg)
        print(f"calibrated on {Shape.of(cfg).label()}: {params.describe()}", flush=True)
        if ns.reverse:
            for i in range(len(predict_cells), 0, -1):
                measure(predict_cells[i - 1], steps, out, f"cell{i}", ns.reuse, ns.config)
        print(
            f"{'configuration':<44} {'samples/s pred':>14} {'meas':>7} {'err':>6} | {'trainer idle pred':>17} "
            f"{'meas':>5} | {'engine idle pred':>16} {'meas':>5} | {'lag pred':>8} {'meas':>5} | {'step cpu/wall':>13} "
            f"{'procs':>5} {'work e/t':>9} {'others':>6} {'steal':>5}"
        )
        rel, idle, own_rel, own_idle, fast_rel = [], [], [], [], []
        for i, cell in enumerate([calibrate_cell, *predict_cells]):
            if i == 0:
                cfg_i, tl_i, steal_i, others_i = cfg, tl, steal, others
            else:
                cfg_i, tl_i, steal_i, others_i = measure(
                    cell, steps, out, f"cell{i}", ns.reuse or ns.reverse, ns.config
                )
            shape = Shape.of(cfg_i)
            sps, t_idle, e_idle, lag = predict(params, shape, ns.seeds)
            m_sps, m_t, m_e = tl_i.samples_per_s(), tl_i.idle_fraction("trainer"), tl_i.idle_fraction("engine")
            err = sps / m_sps - 1
            own = calibrate(tl_i, cfg_i).cores  # the processors this run had, from its own span log
            ratio = work_ratio(tl_i, params)
            if i > 0:
                rel.append(abs(err))
                idle.append(abs(t_idle - m_t))
                own_sps, own_t, _, _ = predict(replace(params, cores=own), shape, ns.seeds)
                own_rel.append(abs(own_sps / m_sps - 1))
                own_idle.append(abs(own_t - m_t))
                fast_rel.append(abs(predict(at_speed(params, ratio), shape, ns.seeds)[0] / m_sps - 1))
            label = shape.label() + (" (calibration)" if i == 0 else "")
            procs = "-" if own is None else f"{own:.2f}"
            print(
                f"{label:<44} {sps:14.1f} {m_sps:7.1f} {err:+6.1%} | {t_idle:17.2f} {m_t:5.2f} | "
                f"{e_idle:16.2f} {m_e:5.2f} | {lag:8.2f} {mean_lag(tl_i.lag_hist()):5.2f} | {cpu_share(tl_i):>13} "
                f"{procs:>5} {ratio[0]:4.2f}/{ratio[1]:4.2f} {others_i:>6} {steal_i:>5}",
                flush=True,
            )
    print(
        f"with each run's own fitted processors (diagnostic): max_rel_error={max(own_rel):.3f} "
        f"median_rel_error={statistics.median(own_rel):.3f} idle_abs_error={max(own_idle):.3f}"
    )
    print(
        f"with each run's own processor time per unit of work (diagnostic): max_rel_error={max(fast_rel):.3f} "
        f"median_rel_error={statistics.median(fast_rel):.3f}"
    )
    print(f"wall {time.perf_counter() - t_start:.0f} s")
    print(
        f"RESULT max_rel_error={max(rel):.3f} median_rel_error={statistics.median(rel):.3f} "
        f"idle_abs_error={max(idle):.3f} configs={len(rel)} steps={cfg.run.max_steps}"
    )


if __name__ == "__main__":
    main()
