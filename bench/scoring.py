"""Scoring stage: what a slow reward costs the trainer, scored on the event loop vs by the stage.

Four runs of the default job (shipped base, depth 1, same seed, same RL wall-time budget),
side by side: reward exact_match as it is ("fast") or with 20 ms of waiting per sample added
("slow", like a remote verifier or an API call), scored on the orchestrator's event loop
(`scoring.pool=loop`, how nonstop scored before the stage existed) or by the concurrent stage
(`scoring.pool=thread`, the default; `--pools` adds `auto`, threads with a sync function slower
than 2 ms per sample moved to worker processes, and `process`, worker processes throughout).
Printed per run: trainer idle %, samples/s, steps, reward-call latency p50/p99 and final
held-out accuracy. The RESULT line gives the trainer idle added by the slow reward, in
percentage points, for each way of scoring, and the steps the slow run kept of the fast run's.
Every run has the default job's trainer.forward_ahead (the forward pass of a batch's first
groups runs while its last are scored); `--set trainer.forward_ahead=false` measures without it.

    python bench/scoring.py [--quick] [--seconds 60] [--delay-ms 20] [--pools loop,thread,auto,process]
                            [--slow-reward sync|async] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from rich.console import Console

from nonstop.cli import run_training
from nonstop.config import load_config

HERE = Path(__file__).resolve().parent


SLOW = {"sync": "slow_exact_match", "async": "slow_exact_match_async"}


def run_cell(pool: str, slow: bool, seconds: float, out: str, sets: list[str], reward_kind: str = "sync") -> dict:
    name = f"{pool}-{'slow' if slow else 'fast'}"
    cfg = load_config(
        overrides=[
            f"scoring.pool={pool}",
            f"run.max_time_s={seconds}",
            "run.max_steps=100000",
            "run.eval_every=100000",
            "checkpoint.every_steps=null",
            f"run.out_dir={out}",
            f"run.name={name}",
            "run.progress=off",
            *sets,
        ]
    )
    # by name, so that worker processes (scoring.pool=process) import it too
    cfg = cfg.model_copy(
        update={
            "task": cfg.task.model_copy(
                # held-out evaluation by exact match in both arms: the slow reward's 20 ms a sample is
                # what the scoring stage is measured on, not what an evaluation costs
                update={
                    "reward": f"slow_reward:{SLOW[reward_kind]}" if slow else "exact_match",
                    "eval_reward": "exact_match",
                }
            )
        }
    )
    summary = run_training(cfg, Console(quiet=True)).to_dict()
    recs = [json.loads(x) for x in (Path(out) / name / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "reward_latency_p50_s" in r]
    p50 = sorted(r["reward_latency_p50_s"] for r in steps)[len(steps) // 2] if steps else 0.0
    p99 = max((r["reward_latency_p99_s"] for r in steps), default=0.0)
    return {
        "idle": summary["trainer_idle_frac"],
        "sps": summary["samples_per_s"],
        "steps": summary["steps"],
        "p50": p50,
        "p99": p99,
        "acc": summary["final_accuracy"],
        "base": summary["base_accuracy"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="30 s of RL per run (about 4 minutes in all)")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--delay-ms", type=float, default=20.0)
    ap.add_argument(
        "--slow-reward",
        choices=tuple(SLOW),
        default="sync",
        help="the slow reward as a plain function (time.sleep) or an async def one (asyncio.sleep)",
    )
    ap.add_argument("--pools", default="loop,thread", help="which of loop,thread,auto,process to run")
    ap.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every run (e.g. buffer.depth=2)",
    )
    ns = ap.parse_args()
    seconds = 30.0 if ns.quick else ns.seconds
    os.environ["NONSTOP_BENCH_REWARD_DELAY_MS"] = str(ns.delay_ms)  # read when slow_reward is imported
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, str(HERE))
    cells = {}
    with tempfile.TemporaryDirectory() as out:
        for pool in ns.pools.split(","):
            for slow in (False, True):
                r = cells[(pool, slow)] = run_cell(pool, slow, seconds, out, ns.sets, ns.slow_reward)
                print(
                    f"{pool:>6} {'slow' if slow else 'fast'}: trainer idle {r['idle']:.1%} "
                    f"{r['sps']:.0f} samples/s, {r['steps']} steps",
                    flush=True,
                )
    print(f"\nDefault job, {seconds:g} s of RL per run; slow = exact_match + {ns.delay_ms:g} ms per sample")
    print(
        f"{'scoring':>8} {'reward':>6} {'trainer idle':>13} {'samples/s':>10} {'steps':>6} "
        f"{'call p50':>9} {'call p99':>9} {'final acc':>10}"
    )
    for (pool, slow), r in cells.items():
        print(
            f"{pool:>8} {'slow' if slow else 'fast':>6} {r['idle']:>13.1%} {r['sps']:>10.0f} {r['steps']:>6} "
            f"{r['p50'] * 1e3:>7.1f}ms {r['p99'] * 1e3:>7.1f}ms {r['acc']:>10.1%}"
        )
    added = {p: 100 * (cells[(p, True)]["idle"] - cells[(p, False)]["idle"]) for p in ns.pools.split(",")}
    names = {
        "thread": "idle_added_pts",
        "loop": "blocking_idle_added_pts",
        "auto": "auto_idle_added_pts",
        "process": "process_idle_added_pts",
    }
    # the steps the slow reward left of the fast run's: a way of scoring that lowers the trainer's
    # idle share by slowing the trainer down (workers taking its processor) shows here
    kept = {p: cells[(p, True)]["steps"] / max(cells[(p, False)]["steps"], 1) for p in added}
    print(
        "RESULT "
        + " ".join(f"{names[p]}={added[p]:.1f}" for p in names if p in added)
        + " "
        + " ".join(f"{names[p].replace('idle_added_pts', 'steps_kept')}={kept[p]:.2f}" for p in names if p in kept)
    )


if __name__ == "__main__":
    main()
