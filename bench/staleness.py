"""Staleness sweep: buffer depth x off-policy correction on the built-in task.

Every cell starts from the same cached warm-up base (seed 0) and runs asynchronous GRPO for the
same wall-time budget; held-out accuracy is measured every few steps. Printed per cell: the
wall time of RL until held-out accuracy first reached the target, the final accuracy, the mean
lag of the trained tokens and the mean |ratio - 1| (how off-policy the batches were).

    python bench/staleness.py [--seconds 45] [--target 0.45] [--depths 0,1,2,4,none]
                              [--corrections none,tis,mis,decoupled]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from rich.console import Console

from nonstop.cli import run_training
from nonstop.config import load_config


def run_cell(depth: str, correction: str, seconds: float, out: str, eval_every: int) -> dict:
    max_lag = 8 if depth == "none" else max(int(depth), 1)
    cfg = load_config(
        overrides=[
            f"buffer.depth={'null' if depth == 'none' else depth}",
            f"buffer.max_lag={max_lag}",
            f"trainer.correction={correction}",
            f"run.max_time_s={seconds}",
            f"run.eval_every={eval_every}",
            f"run.out_dir={out}",
            f"run.name=d{depth}-{correction}",
            "run.progress=off",
        ]
    )
    summary = run_training(cfg, Console(quiet=True)).to_dict()
    recs = [json.loads(x) for x in (Path(out) / f"d{depth}-{correction}" / "metrics.jsonl").read_text().splitlines()]
    lags = [(int(k), v) for r in recs for k, v in r["lag_hist"].items()]
    tokens = sum(v for _, v in lags) or 1
    return {
        "base": summary["base_accuracy"],
        "final": summary["final_accuracy"],
        "evals": [(r["time_s"], r["eval_accuracy"]) for r in recs if "eval_accuracy" in r],
        "mean_lag": sum(k * v for k, v in lags) / tokens,
        "ratio_dev": sum(max(abs(r["ratio_max"] - 1), abs(1 - r["ratio_min"])) for r in recs) / len(recs),
        "drops": summary["drops"].get("max_lag", 0),
        "steps": summary["steps"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=45.0)
    ap.add_argument("--target", type=float, default=0.45)
    ap.add_argument("--depths", default="0,1,2,4,none")
    ap.add_argument("--corrections", default="none,tis,mis,decoupled")
    ap.add_argument("--eval-every", type=int, default=10)
    ns = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as out:
        for depth in ns.depths.split(","):
            for corr in ns.corrections.split(","):
                r = run_cell(depth, corr, ns.seconds, out, ns.eval_every)
                hit = next((t for t, acc in r["evals"] if acc >= ns.target), None)
                rows.append((depth, corr, hit, r))
                print(
                    f"depth {depth:>4} {corr:>9}: base {r['base']:.1%} final {r['final']:.1%} "
                    f"t@{ns.target:.0%} {'-' if hit is None else f'{hit:.0f}s'} lag {r['mean_lag']:.2f} "
                    f"steps {r['steps']}",
                    flush=True,
                )
    print(f"\nRL budget {ns.seconds:g} s per cell; target held-out accuracy {ns.target:.0%}")
    print(
        f"{'depth':>6} {'correction':>10} {'time to target':>15} {'final acc':>10} "
        f"{'mean lag':>9} {'max|r-1|':>9} {'steps':>6}"
    )
    for depth, corr, hit, r in rows:
        print(
            f"{depth:>6} {corr:>10} {('-' if hit is None else f'{hit:.0f} s'):>15} {r['final']:>10.1%} "
            f"{r['mean_lag']:>9.2f} {r['ratio_dev']:>9.3f} {r['steps']:>6}"
        )


if __name__ == "__main__":
    main()
