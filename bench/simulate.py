"""Capacity planner check: calibrate on one measured run, predict others, measure them for real.

Runs the built-in job (step-bound, the same steps for every configuration) once to calibrate
the planner from its span log, then predicts and runs each other configuration: buffer depth
0/1/2/unbounded, 1 or 2 engines, two batch sizes. Every figure, predicted and measured, is
taken over the same window (RL start to the last publish) from the span log. Printed: a table
of predicted vs measured samples/s, trainer and engine idle fractions, mean token lag, and the
processor time the trainer's steps got per second of wall time (a run that shared the machine
with another load shows it there) and the machine's stolen processor time (a virtual machine's
neighbours); last line:

    RESULT max_rel_error=<largest |pred/meas - 1| of samples/s> median_rel_error=<...>
           idle_abs_error=<largest |pred - meas| of the trainer idle fraction>

    python bench/simulate.py --quick          # 40 steps per run, 7 runs
    python bench/simulate.py --steps 80 --out runs/planner   # keep the run folders
    python bench/simulate.py --quick --out runs/planner --reuse   # predict again, measure nothing
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console

from nonstop.cli import run_training
from nonstop.config import load_config
from nonstop.planner.model import simulate
from nonstop.planner.calibrate import calibrate
from nonstop.planner.params import Shape
from nonstop.timeline import Timeline

CALIBRATE = {"buffer.depth": 1, "runtime.num_engines": 1, "rollout.prompts_per_step": 32}
PREDICT = [
    {"buffer.depth": 0, "runtime.num_engines": 1, "rollout.prompts_per_step": 32},
    {"buffer.depth": 2, "runtime.num_engines": 1, "rollout.prompts_per_step": 32},
    {"buffer.depth": "null", "buffer.max_lag": 4, "buffer.max_queued_groups": 96, "runtime.num_engines": 1,
     "rollout.prompts_per_step": 32},
    {"buffer.depth": 1, "runtime.num_engines": 2, "rollout.prompts_per_step": 32},
    {"buffer.depth": 1, "runtime.num_engines": 1, "rollout.prompts_per_step": 16},
    {"buffer.depth": 0, "runtime.num_engines": 2, "rollout.prompts_per_step": 16},
]


def overrides(cell: dict, steps: int, out: str, name: str) -> list[str]:
    return [*(f"{k}={v}" for k, v in cell.items()), f"run.max_steps={steps}", "run.max_time_s=null",
            "run.eval_every=100000", "task.eval_size=50", "checkpoint.every_steps=null", f"run.out_dir={out}",
            f"run.name={name}", "run.progress=off"]


def host_times() -> list[int]:
    """The machine's processor time counters (/proc/stat: user nice system idle iowait irq softirq
    steal), summed over its processors; [] where there is no /proc."""
    try:
        return [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except OSError:
        return []


def measure(cell: dict, steps: int, out: str, name: str, reuse: bool):
    """Run one configuration (or, with `reuse`, take the run already there, with its own config).
    The share of the machine's processor time stolen by its hypervisor while the run ran is kept
    beside it (`steal.txt`): a virtual machine's neighbours slow a run without a trace in it."""
    folder = Path(out) / name
    if not (reuse and (folder / "summary.json").exists()):
        cfg = load_config(overrides=overrides(cell, steps, out, name))
        before = host_times()
        run_training(cfg, Console(quiet=True))
        after = host_times()
        if before and after:
            d = [y - x for x, y in zip(before, after)]
            (folder / "steal.txt").write_text(f"{d[7] / max(sum(d), 1):.3f}\n")
    steal = folder / "steal.txt"
    return (load_config(folder / "config.yaml"), Timeline.load(folder),
            steal.read_text().strip() if steal.exists() else "-")


def cpu_share(tl: Timeline) -> str:
    """Processor time / wall time of the trainer's steps: below 1 when the step shared a
    processor (with the run's own actors, or with another load on the machine)."""
    steps = [e for e in tl.events.get("trainer-0", []) if e["ev"] == "step"]
    if not steps or not all("cpu_s" in e for e in steps):
        return "-"
    return f"{sum(e['cpu_s'] for e in steps) / sum(e['t1'] - e['t0'] for e in steps):.2f}"


def mean_lag(hist: dict[int, int]) -> float:
    total = sum(hist.values())
    return sum(k * v for k, v in hist.items()) / total if total else 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true",
                    help="40 steps per run: a run of the tiny job is seconds long, and one orchestrator pause "
                         "(~0.25 s every ~450 groups) is a few percent of it")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--seeds", type=int, default=3, help="simulation seeds averaged per prediction")
    ap.add_argument("--out", default=None, help="keep the run folders here (default: a temporary folder)")
    ap.add_argument("--reuse", action="store_true", help="with --out: take runs already there instead of running them")
    ns = ap.parse_args()
    steps = 40 if ns.quick else ns.steps
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = ns.out or tmp
        cfg, tl, steal = measure(CALIBRATE, steps, out, "calibrate", ns.reuse)
        params = calibrate(tl, cfg)
        print(f"calibrated on {Shape.of(cfg).label()}: {params.describe()}", flush=True)
        print(f"{'configuration':<44} {'samples/s pred':>14} {'meas':>7} {'err':>6} | {'trainer idle pred':>17} "
              f"{'meas':>5} | {'engine idle pred':>16} {'meas':>5} | {'lag pred':>8} {'meas':>5} | {'step cpu/wall':>13} "
              f"{'steal':>5}")
        rel, idle = [], []
        for i, cell in enumerate([CALIBRATE, *PREDICT]):
            if i == 0:
                cfg_i, tl_i, steal_i = cfg, tl, steal
            else:
                cfg_i, tl_i, steal_i = measure(cell, steps, out, f"cell{i}", ns.reuse)
            shape = Shape.of(cfg_i)
            preds = [simulate(params, shape, seed) for seed in range(ns.seeds)]
            sps = statistics.fmean(p.samples_per_s for p in preds)
            t_idle = statistics.fmean(p.trainer_idle for p in preds)
            e_idle = statistics.fmean(p.engine_idle for p in preds)
            lag = statistics.fmean(p.mean_lag for p in preds)
            m_sps, m_t, m_e = tl_i.samples_per_s(), tl_i.idle_fraction("trainer"), tl_i.idle_fraction("engine")
            err = sps / m_sps - 1
            if i > 0:
                rel.append(abs(err))
                idle.append(abs(t_idle - m_t))
            label = shape.label() + (" (calibration)" if i == 0 else "")
            print(f"{label:<44} {sps:14.1f} {m_sps:7.1f} {err:+6.1%} | {t_idle:17.2f} {m_t:5.2f} | "
                  f"{e_idle:16.2f} {m_e:5.2f} | {lag:8.2f} {mean_lag(tl_i.lag_hist()):5.2f} | {cpu_share(tl_i):>13} {steal_i:>5}", flush=True)
    print(f"wall {time.perf_counter() - t_start:.0f} s")
    print(f"RESULT max_rel_error={max(rel):.3f} median_rel_error={statistics.median(rel):.3f} "
          f"idle_abs_error={max(idle):.3f} configs={len(rel)} steps={cfg.run.max_steps}")


if __name__ == "__main__":
    main()
