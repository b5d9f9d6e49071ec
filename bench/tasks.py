"""Do the default settings learn on tasks other than the built-in one? The task matrix, over seeds.

Runs each task of examples/tasks/ as a user would: the real CLI with the task's YAML
(task.name=jsonl, a JSONL dataset, task.reward naming a function of examples/tasks/task_rewards.py),
the supervised warm-up on the task (the shipped base is for addition only; seeded by run.seed),
then RL with every other setting at its default, `--total` seconds of wall time for the whole
command (run.max_total_s: RL gets what the warm-up and the start-up left; run.max_steps is lifted,
so time alone ends a run). Prints per task and seed the
base and final held-out accuracy, the gain, the warm-up and RL time and the run doctor's findings,
then per task the smallest and the median gain, and ends with

    RESULT min_gain=... median_gain=... tasks=... runs=...

(gains as fractions: 0.2 is +20 points; min and median over every task and seed). Held-out accuracy
is exact match in every task (task.eval_reward=exact_match), as the matrix has always measured it:
held-out evaluation scores with the task's own reward by default, and the partial credits of
multiply and opsum (digit_credit) would count half-right answers. Issue 33's bar:
every task gains at least +20 points within 300 s, over seeds 0-2. Warm-ups are cached in the
folder given by --cache (default: a temporary one, so each invocation warms up afresh, and the
warm-up's time counts).

    python bench/tasks.py [--tasks compare,...] [--seeds 0,1,2] [--quick] [--total 300] [--cache DIR]
                          [--keep DIR] [--set KEY=VALUE ...]

--quick: seed 0 only. --set applies to every run (e.g. --set trainer.lr=3e-4).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from cli_run import ROOT, train

TASKS = ROOT / "examples" / "tasks"
MATRIX = "compare,subtraction,multiply,reverse,sort,repeat,opsum,sumdiff"


def run_task(task: str, seed: int, total_s: float, folder: Path, cache: Path, overrides: list[str]) -> dict:
    t0 = time.perf_counter()
    s = train(
        f"{task}-{seed}",
        folder,
        [
            f"task.dataset_path={TASKS / task}.jsonl",
            f"run.seed={seed}",
            f"run.max_total_s={total_s}",
            "run.max_time_s=null",
            "run.max_steps=100000",  # the bar is wall time: the default 1,000 steps cut short runs of fast steps
            f"warmup.cache_dir={cache}",
            "task.eval_reward=exact_match",  # what the matrix measured before evaluation took the task's reward
            *overrides,
        ],
        config=TASKS / f"{task}.yaml",
        pythonpath=(TASKS,),
    )
    doctor = (s.get("doctor") or {}).get("findings", [])
    final = s["final_accuracy"] if s["final_accuracy"] is not None else s["base_accuracy"]  # no RL step ran
    return {
        "task": task,
        "seed": seed,
        "base": s["base_accuracy"],
        "final": final,
        "gain": final - s["base_accuracy"],
        "warmup_s": s["warmup_s"],
        "rl_s": s["rl_wall_s"],
        "steps": s["steps"],
        "wall_s": time.perf_counter() - t0,
        "doctor": ",".join(f["code"] + (" (cleared)" if f.get("cleared") else "") for f in doctor) or "-",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default=MATRIX)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--quick", action="store_true", help="seed 0 only")
    ap.add_argument("--total", type=float, default=300.0, help="wall seconds per run, warm-up included")
    ap.add_argument("--cache", type=Path, default=None, help="warm-up cache folder (default: a fresh temporary one)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--keep", type=Path, default=None, help="keep the run folders here (default: deleted)")
    ns = ap.parse_args()
    seeds = [0] if ns.quick else [int(x) for x in ns.seeds.split(",")]
    tasks = ns.tasks.split(",")
    rows: list[dict] = []
    print(
        f"{'task':>12} {'seed':>4} {'base':>7} {'final':>7} {'gain':>8} {'warm-up s':>9} {'RL s':>6} "
        f"{'steps':>6} {'wall s':>7}  doctor"
    )
    with tempfile.TemporaryDirectory(prefix="nonstop-tasks-") as tmp:
        cache = (ns.cache or Path(tmp) / "cache").resolve()
        folder = (ns.keep or Path(tmp)).resolve()
        folder.mkdir(parents=True, exist_ok=True)
        for task in tasks:
            for seed in seeds:
                r = run_task(task, seed, ns.total, folder, cache, ns.overrides)
                rows.append(r)
                print(
                    f"{task:>12} {seed:>4} {r['base']:>7.1%} {r['final']:>7.1%} {100 * r['gain']:>+7.1f}p "
                    f"{r['warmup_s']:>9.1f} {r['rl_s']:>6.1f} {r['steps']:>6} {r['wall_s']:>7.1f}  {r['doctor']}",
                    flush=True,
                )
    for task in tasks:
        gains = [r["gain"] for r in rows if r["task"] == task]
        print(f"{task:>12} min {100 * min(gains):+.1f}p median {100 * statistics.median(gains):+.1f}p")
    gains = [r["gain"] for r in rows]
    print(
        f"RESULT min_gain={min(gains):.3f} median_gain={statistics.median(gains):.3f} "
        f"tasks={len(tasks)} runs={len(rows)} max_wall_s={max(r['wall_s'] for r in rows):.0f}"
    )


if __name__ == "__main__":
    main()
