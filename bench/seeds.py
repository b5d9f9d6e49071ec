"""The default job over run seeds: does `nonstop train` (no settings) meet the bar for every seed?

Runs the real CLI, `nonstop train --set run.seed=S` (everything else default: the shipped base,
190 s of RL), one seed after the other in a fresh folder, and prints per seed the base and final
held-out accuracy, the gain, the wall time of the whole command, trainer steps and samples/s.
The acceptance bar is +30 points within 300 s of wall time for every seed. Run it on a quiet
machine: the RL budget is wall time, so a loaded machine does fewer steps.

    python bench/seeds.py [--seeds 0,1,2,3,4] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from cli_run import train


def run_seed(seed: int, folder: Path, overrides: list[str]) -> dict:
    s = train(f"seed{seed}", folder, [f"run.seed={seed}", *overrides])
    return {
        "seed": seed,
        "base": s["base_accuracy"],
        "final": s["final_accuracy"],
        "gain": s["final_accuracy"] - s["base_accuracy"],
        "wall_s": s["cli_wall_s"],
        "steps": s["steps"],
        "samples_per_s": s["samples_per_s"],
        "rl_s": s["rl_wall_s"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ns = ap.parse_args()
    rows = []
    print(f"{'seed':>4} {'base':>7} {'final':>7} {'gain':>8} {'wall s':>7} {'RL s':>6} {'steps':>6} {'samples/s':>10}")
    with tempfile.TemporaryDirectory(prefix="nonstop-seeds-") as tmp:
        for seed in (int(s) for s in ns.seeds.split(",")):
            r = run_seed(seed, Path(tmp), ns.overrides)
            rows.append(r)
            print(
                f"{r['seed']:>4} {r['base']:>7.1%} {r['final']:>7.1%} {100 * r['gain']:>+7.1f}p {r['wall_s']:>7.1f} "
                f"{r['rl_s']:>6.1f} {r['steps']:>6} {r['samples_per_s']:>10.0f}",
                flush=True,
            )
    print(
        f"RESULT min_gain={min(r['gain'] for r in rows):.3f} max_wall_s={max(r['wall_s'] for r in rows):.1f} "
        f"seeds={len(rows)}"
    )


if __name__ == "__main__":
    main()
