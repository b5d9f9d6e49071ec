"""Scale-out on one machine: local-process vs Ray backend, 1 vs 2 engines, 1 vs 2 trainer ranks.

Every cell is the same run (built-in task and default tiny model, warm-up off so no cache is
involved, every group kept, seed 0, a fixed number of steps), side by side in one invocation; only the runtime
layout changes. Printed per cell: RL samples generated per second, its ratio to the first cell
(local backend, one engine, one trainer), and the idle fractions of generation and training
measured by the orchestrator (with several engines, generation counts as busy while any engine
part of a call is in flight). With --repeats R the cells run round-robin R times (so a slow
spell of a shared machine hits every cell alike) and each figure is the median.

    python bench/scaleout.py [--steps 20] [--repeats 2] [--cells local,ray,engines2,ddp2,fsdp2,ray_e2_t2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from rich.console import Console

from nonstop.cli import run_training
from nonstop.config import load_config

CELLS: dict[str, tuple[str, list[str]]] = {
    "local": ("local, 1 engine, 1 trainer", []),
    "ray": ("ray, 1 engine, 1 trainer", ["runtime.backend=ray"]),
    "engines2": ("local, 2 engines, 1 trainer", ["runtime.num_engines=2"]),
    "ddp2": ("local, 1 engine, 2 DDP ranks", ["trainer.ranks=2", "trainer.data_parallel=ddp"]),
    "fsdp2": (
        "local, 1 engine, 2 FSDP2 ranks",
        ["trainer.ranks=2", "trainer.data_parallel=fsdp2", "checkpoint.every_steps=null"],
    ),
    "ray_e2_t2": (
        "ray, 2 engines, 2 DDP ranks",
        [
            "runtime.backend=ray",
            "runtime.num_engines=2",
            "trainer.ranks=2",
            "runtime.ray_engine.num_cpus=0.5",
            "runtime.ray_trainer.num_cpus=0.5",
        ],
    ),
}


def run_cell(name: str, extra: list[str], steps: int, out: str) -> dict:
    cfg = load_config(
        overrides=[
            "warmup.enabled=false",
            "rollout.filter_uniform_reward=false",
            f"run.max_steps={steps}",
            "run.max_time_s=null",
            f"run.eval_every={steps}",
            "task.eval_size=50",
            f"run.out_dir={out}",
            f"run.name={name}",
            "run.progress=off",
            *extra,
        ]
    )
    return run_training(cfg, Console(quiet=True)).to_dict()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--cells", default="local,ray,engines2,ddp2,fsdp2,ray_e2_t2")
    ns = ap.parse_args()
    keys = ns.cells.split(",")
    runs: dict[str, list[dict]] = {k: [] for k in keys}
    with tempfile.TemporaryDirectory() as out:
        for rep in range(ns.repeats):
            for key in keys:
                label, extra = CELLS[key]
                s = run_cell(f"{key}-{rep}", extra, ns.steps, out)
                runs[key].append(s)
                print(
                    f"{label:32s} {s['samples_per_s']:7.0f} samples/s  engine idle {s['engine_idle_frac']:.0%}  "
                    f"trainer idle {s['trainer_idle_frac']:.0%}  ({s['steps']} steps, {s['rl_wall_s']:.1f} s)",
                    flush=True,
                )
    fields = ("samples_per_s", "engine_idle_frac", "trainer_idle_frac", "rl_wall_s")
    rows = [(CELLS[k][0], {f: statistics.median(r[f] for r in runs[k]) for f in fields}) for k in keys]
    base = rows[0][1]["samples_per_s"]
    print(f"\n{ns.steps} steps per cell, median of {ns.repeats} run(s), ratio against the first cell\n")
    print("| layout | samples/s | ratio | engine idle | trainer idle | RL wall s |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, s in rows:
        print(
            f"| {label} | {s['samples_per_s']:.0f} | {s['samples_per_s'] / base:.2f} | "
            f"{s['engine_idle_frac']:.0%} | {s['trainer_idle_frac']:.0%} | {s['rl_wall_s']:.1f} |"
        )


if __name__ == "__main__":
    main()
