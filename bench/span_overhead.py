"""Span-log overhead on the default job: samples/s with `run.spans` on and off, side by side.

Runs the default job bound by steps (not time, so both arms do the same work) alternately with
spans on and off, `--pairs` times, and prints each pair's ratio. Because a few-percent effect
drowns in run-to-run noise on a shared machine, it also measures the cost of the span log
directly: the time of one `emit` (and one engine forward pass recorded), times the number of
events the `on` runs wrote per second of RL, as a fraction of wall time. The last line:

    RESULT overhead_measured=<1 - median(on/off samples/s)> overhead_bound=<events/s x cost per event, of wall time>

    python bench/span_overhead.py [--pairs 3] [--steps 60]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console

from nonstop.cli import run_training
from nonstop.config import load_config
from nonstop.observe.spans import SPANS_DIR, PassRecorder, SpanLog, now


def run_once(spans: bool, steps: int, out: str, name: str) -> tuple[float, int, int, float]:
    """samples/s, span events written, engine forward passes recorded, RL wall seconds."""
    cfg = load_config(
        overrides=[
            f"run.spans={str(spans).lower()}",
            f"run.max_steps={steps}",
            "run.max_time_s=null",
            f"run.eval_every={steps}",
            "checkpoint.every_steps=null",
            f"run.out_dir={out}",
            f"run.name={name}",
            "run.progress=off",
        ]
    )
    s = run_training(cfg, Console(quiet=True))
    folder = Path(out) / name / SPANS_DIR
    lines = [json.loads(x) for p in folder.glob("*.jsonl") for x in p.read_text().splitlines()] if spans else []
    passes = sum(e.get("passes", 0) for e in lines)
    return s.samples_per_s, len(lines), passes, s.rl_wall_s


def cost_per_event_s(n: int = 20000) -> tuple[float, float]:
    """Seconds per orchestrator-sized `emit`, and per recorded engine forward pass."""
    with tempfile.TemporaryDirectory() as d:
        log = SpanLog(Path(d) / "x.jsonl")
        t = time.perf_counter()
        for i in range(n):
            log.emit("group", id=[0, i], t_admit=1.0, t_gen0=1.1, t_gen1=1.2, t_done=1.3, lens=[4] * 8, v=[3, 4])
        emit = (time.perf_counter() - t) / n
        rec = PassRecorder(log)
        t = time.perf_counter()
        for i in range(n):
            a = now()
            rec.record(a, now(), 256)
        per_pass = (time.perf_counter() - t) / n
        log.close()
    return emit, per_pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ns = ap.parse_args()
    ratios, rates, pass_rates = [], [], []
    with tempfile.TemporaryDirectory() as out:
        for i in range(ns.pairs):
            arms = [True, False] if i % 2 == 0 else [False, True]  # alternate which arm goes first
            got = {arm: run_once(arm, ns.steps, out, f"{'on' if arm else 'off'}-{i}") for arm in arms}
            (on, events, passes, wall), (off, *_) = got[True], got[False]
            ratios.append(on / off)
            rates.append(events / wall)
            pass_rates.append(passes / wall)
            print(
                f"pair {i}: spans on {on:7.1f} samples/s, off {off:7.1f} samples/s, on/off {on / off:.3f}; "
                f"{events} events in {wall:.1f} s",
                flush=True,
            )
    emit, per_pass = cost_per_event_s()
    # every pass pays `per_pass` (which includes its share of chunk emits); every other line one emit
    bound = statistics.median(rates) * emit + statistics.median(pass_rates) * per_pass
    print(
        f"cost per event {emit * 1e6:.1f} us (emit), {per_pass * 1e6:.1f} us (engine pass recorded); "
        f"{statistics.median(rates):.0f} lines/s, {statistics.median(pass_rates):.0f} engine passes/s"
    )
    print(
        f"RESULT overhead_measured={1 - statistics.median(ratios):.4f} overhead_bound={bound:.4f} "
        f"pairs={ns.pairs} steps={ns.steps}"
    )


if __name__ == "__main__":
    main()
