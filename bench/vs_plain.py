"""nonstop's pipeline vs a plain synchronous GRPO loop, side by side in one invocation.

Same base policy (the shipped addition base), task (two-operand addition, exact match), batch
(32 prompts x 8 completions of <= 4 new tokens per step), learning rate and loss. Arms:

- plain:    `nonstop.reference`, the plain loop a user writes in an afternoon: one process,
            the whole batch sampled at once with an HF forward and a KV cache, then one forward +
            backward over the groups with a learning signal; run with torch on both cores
            (plain2: 2 threads) and on one (plain1), and the better of the two is the baseline
            (two threads win on a quiet machine; on a busy one their spinning can cost 10x);
- depth 0/1/2: `nonstop train` with buffer.depth 0, 1, 2: an engine process and a trainer
            process, one thread each, the orchestrator in the main process.

Every arm trains on the groups with a learning signal among each step's 32 prompts
(rollout.refill=false in the pipeline, as the plain loop does), so each step generates exactly
256 samples in every arm. samples/s: completions generated per second in steady state (from
the end of step `--skip` to the end of the last step; start-up and evaluations excluded). Each
arm trains for `--seconds` in its own subprocess; arms alternate over `--rounds` rounds and each
arm's figure is its best round (the machine is shared: the best round is the least disturbed).

    python bench/vs_plain.py [--quick] [--rounds 2] [--seconds 40]

The last line is `RESULT ratio_vs_plain=<best pipeline arm's samples/s / the best plain arm's>`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ARMS = ("plain2", "plain1", "depth0", "depth1", "depth2")
COMMON = [
    "model.base=builtin",
    "rollout.prompts_per_step=32",
    "rollout.group_size=8",
    "rollout.max_new_tokens=4",
    "rollout.filter_uniform_reward=true",
    "rollout.refill=false",
    "task.eval_size=50",
    "run.seed=0",
]


def steady(points: list[tuple[float, int]], skip: int) -> float:
    """Samples/s between the end of step `skip` and the last step; points: (seconds, samples) per step."""
    (t0, n0), (t1, n1) = points[min(skip, len(points) - 2)], points[-1]
    return (n1 - n0) / (t1 - t0)


class _TimeUp(Exception):
    """The plain arm's time budget is spent (raised from its per-step log callback)."""


def run_plain(threads: int, seconds: float, skip: int) -> dict:
    from nonstop.config import load_config
    from nonstop.models.shipped import shipped_dir
    from nonstop.reference import run_reference

    recs: list[dict] = []

    def log(record: dict) -> None:
        recs.append(record)
        if record["seconds"] >= seconds:
            raise _TimeUp

    try:
        run_reference(
            load_config(overrides=COMMON),
            str(shipped_dir("builtin")),
            10**9,
            eval_every=10**9,
            threads=threads,
            log=log,
        )
    except _TimeUp:
        pass
    return {
        "samples_per_s": steady([(r["seconds"], r["samples"]) for r in recs], skip),
        "steps": len(recs),
        "groups_trained": sum(r["groups_trained"] for r in recs),
    }


def run_pipeline(depth: int, seconds: float, skip: int, out: str) -> dict:
    from rich.console import Console

    from nonstop.cli import run_training
    from nonstop.config import load_config

    cfg = load_config(
        overrides=[
            *COMMON,
            f"buffer.depth={depth}",
            f"run.max_steps={10**6}",
            f"run.max_time_s={seconds}",
            f"run.eval_every={10**6}",
            "checkpoint.every_steps=null",
            f"run.out_dir={out}",
            "run.name=run",
            "run.progress=off",
        ]
    )
    run_training(cfg, Console(quiet=True))
    recs = [json.loads(x) for x in (Path(out) / "run" / "metrics.jsonl").read_text().splitlines() if '"step"' in x]
    recs = [r for r in recs if "samples_generated" in r]
    a, b = recs[min(skip, len(recs) - 2)], recs[-1]
    wall = b["time_s"] - a["time_s"]
    return {
        "samples_per_s": steady([(r["time_s"], r["samples_generated"]) for r in recs], skip),
        "steps": len(recs),
        "groups_trained": sum(r["samples_trained"] for r in recs) // 8,
        "trainer_idle": max(0.0, 1 - (b["training_busy_s"] - a["training_busy_s"]) / wall),
        "engine_idle": max(0.0, 1 - (b["generation_busy_s"] - a["generation_busy_s"]) / wall),
    }


def child(arm: str, seconds: float, skip: int) -> None:
    with tempfile.TemporaryDirectory() as out:
        res = (
            run_plain(int(arm[-1]), seconds, skip)
            if arm.startswith("plain")
            else run_pipeline(int(arm[-1]), seconds, skip, out)
        )
    print(json.dumps(res))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="one round of 25 s per arm (about 3 minutes)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=40.0, help="training seconds per arm and round")
    ap.add_argument("--skip", type=int, default=5, help="first steps left out of the steady state")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.arm:
        child(ns.arm, ns.seconds, ns.skip)
        return
    rounds, seconds = (1, 25.0) if ns.quick else (ns.rounds, ns.seconds)
    arms = ns.arms.split(",")
    print(
        f"{len(arms)} arms x {rounds} round(s) x {seconds:g} s of steps of 32 prompts x 8 completions "
        f"(<= 4 new tokens); steady state after step {ns.skip}",
        flush=True,
    )
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error"}
    best: dict[str, dict] = {}
    t_start = time.perf_counter()
    for r in range(rounds):
        for arm in arms if r % 2 == 0 else arms[::-1]:  # alternate the order: drift hits every arm alike
            proc = subprocess.run(
                [sys.executable, __file__, "--arm", arm, "--seconds", str(seconds), "--skip", str(ns.skip)],
                capture_output=True,
                text=True,
                env=env,
            )
            if proc.returncode != 0:
                print(f"  {arm}: failed\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}", flush=True)
                continue
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            print(f"  round {r + 1} {arm}: {res['samples_per_s']:.0f} samples/s", flush=True)
            if arm not in best or res["samples_per_s"] > best[arm]["samples_per_s"]:
                best[arm] = res
    plains = [best[a]["samples_per_s"] for a in arms if a.startswith("plain") and a in best]
    plain = max(plains) if plains else None
    print(
        f"\n{'arm':<10}{'samples/s':>11}{'vs plain':>10}{'trainer idle':>14}{'engine idle':>13}{'groups trained':>16}"
    )
    for arm in arms:
        if arm not in best:
            continue
        res = best[arm]
        ratio = f"{res['samples_per_s'] / plain:.2f}x" if plain else "-"
        idle = [f"{res[k]:.0%}" if k in res else "-" for k in ("trainer_idle", "engine_idle")]
        print(f"{arm:<10}{res['samples_per_s']:>11.0f}{ratio:>10}{idle[0]:>14}{idle[1]:>13}{res['groups_trained']:>16}")
    pipeline = [best[a]["samples_per_s"] for a in arms if not a.startswith("plain") and a in best]
    print(f"(wall {time.perf_counter() - t_start:.0f} s)")
    if plain and pipeline:
        print(f"RESULT ratio_vs_plain={max(pipeline) / plain:.2f}")
    else:
        print("RESULT ratio_vs_plain=nan")


if __name__ == "__main__":
    main()
