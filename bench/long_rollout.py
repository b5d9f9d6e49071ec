"""Sync against async in the long-rollout regime (issue 29, docs/long_rollout.md).

Every arm runs the real CLI on `examples/long_rollout.yaml` (the shipped 1.78 M-parameter base,
its BPE, worked solutions of heavy-tailed length: median 85 tokens, p99 805), the engine pinned
to CPU 0 and the trainer to CPU 1, for the same RL wall time `--seconds`, evaluating held-out
accuracy every `--eval-every` steps. Arms:

- sync: buffer.depth 0 (the trainer waits for each batch's longest completion, then the engine
  waits for the trainer);
- depth1, depth2: bounded buffers of 1 and 2 steps ahead (max_lag depth + 1);
- unbounded: buffer.depth null with max_lag `--max-lag`, at most (max_lag + 1) steps of groups queued;
- one arm per partial-rollout mode on the `--mode-depth` buffer (never_stop is that depth's own
  arm): abort_retry, save_resume, drain, and group_cancel (never_stop with engine.group_cancel).

Per arm: samples/s and tokens/s (completion tokens the engines generated over the RL wall time),
trainer and engine idle, each pinned pool's busy fraction, held-out accuracy at equal wall clock
(the end) and at equal trained samples (the last evaluation every arm reached), the wall time to
`--target` held-out accuracy, the lag histogram of trained tokens, and the tokens wasted: those
generated but never trained (groups dropped for lag, cancelled, or still in flight at the end),
as a fraction of all generated, with the groups dropped for uniform rewards shown apart (a
property of the task, not of the arm). Then `--seeds` (default 0,1,2): sync and the fastest arm
again, each to the trained samples sync reached in `--seconds`, for final accuracy over seeds.

    python bench/long_rollout.py [--seconds 600] [--quick] [--arms sync,depth2,...] [--seeds 0,1,2] [--keep DIR]

`--quick` (about 25 minutes): 100 s per arm, evaluations on 50 held-out prompts, seed 0 only,
TRL's one-thread arm for 3 steps. The last line:
`RESULT sync_trainer_idle=... best_trainer_idle=... best_speedup=... best_arm=... acc_delta=...
wasted_frac=... ratio_vs_trl=...`; best_speedup is sync's wall time to the target over the best
arm's (when both reached it; else the samples/s ratio, marked by `speedup_basis=samples`),
acc_delta the best arm's mean final accuracy minus sync's at equal trained samples over the seeds,
and ratio_vs_trl the best arm's samples/s over TRL's.

TRL (`--trl-steps`, 0 skips it; needs the bench extra): `trl.GRPOTrainer` on the same base,
tokenizer, rows and reward, the config's prompts x 8 completions of at most 1,024 new tokens per step, the
learning rate nonstop resolves for this base, fp32 (its bf16 is slower at this width: docs/precision.md);
two arms, torch's default threads (both cores) and one thread, and the better one is the baseline
(vs_trl.py's rule). Its samples/s are counted from the end of its first step to the end of its last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cli_run import ROOT, train
from nonstop.config import load_config

CONFIG = ROOT / "examples" / "long_rollout.yaml"
DEPTH_ARMS = {
    "sync": ["buffer.depth=0", "buffer.max_lag=0"],
    "depth1": ["buffer.depth=1", "buffer.max_lag=2"],
    "depth2": ["buffer.depth=2", "buffer.max_lag=3"],
}
MODES = ("abort_retry", "save_resume", "drain", "group_cancel")


def arms(max_lag: int, mode_depth: str, prompts_per_step: int) -> dict[str, list[str]]:
    # unbounded: admission no longer waits for trainer steps, only for the queue's bound. The engine
    # calls stay within twice what the engine holds (config/sizing.py engine_calls_bound), so a deep
    # queue no longer times a call out; but with the default bound (4096 groups) a whole epoch would
    # be admitted and most of it dropped for lag: (max_lag + 1) steps of groups is what max_lag lets
    # train at all.
    queued = (max_lag + 1) * prompts_per_step
    out = {
        **DEPTH_ARMS,
        "unbounded": ["buffer.depth=null", f"buffer.max_lag={max_lag}", f"buffer.max_queued_groups={queued}"],
    }
    base = out[mode_depth]
    for mode in MODES:
        extra = ["engine.group_cancel=true"] if mode == "group_cancel" else [f"engine.update_mode={mode}"]
        out[mode] = [*base, *extra]
    return out


def records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def figures(name: str, summary: dict, recs: list[dict], target: float) -> dict:
    """One arm's row from its summary.json and metrics.jsonl."""
    steps = [r for r in recs if "lag_hist" in r]  # step records (the trainer's metrics are flattened in)
    evals = [(r["step"], r["time_s"], r["eval_accuracy"]) for r in steps if r.get("eval_accuracy") is not None]
    lag: dict[str, int] = {}
    for r in steps:
        for k, v in r["lag_hist"].items():
            lag[k] = lag.get(k, 0) + v
    trained_tokens = sum(lag.values())
    generated = sum(int(e.get("tokens_generated", 0)) for e in summary["engines"])
    wall = summary["rl_wall_s"]
    drops = summary["drops"]
    reached = next((t for _, t, a in evals if a >= target), None)
    pools = summary.get("pools") or {}
    return {
        "arm": name,
        "steps": summary["steps"],
        "samples_per_s": summary["samples_per_s"],
        "tokens_per_s": generated / wall if wall > 0 else 0.0,
        "trainer_idle": summary["trainer_idle_frac"],
        "engine_idle": summary["engine_idle_frac"],
        "pool_busy": {k: v.get("busy_frac") for k, v in pools.get("roles", pools).items() if isinstance(v, dict)},
        "base": summary["base_accuracy"],
        "final": summary["final_accuracy"],
        "evals": evals,
        "time_to_target_s": reached,
        "lag": {k: v / max(trained_tokens, 1) for k, v in sorted(lag.items(), key=lambda kv: int(kv[0]))},
        "wasted_frac": max(0, generated - trained_tokens) / generated if generated else 0.0,
        "uniform_drops": drops.get("uniform_reward", 0),
        "lag_drops": sum(v for k, v in drops.items() if "lag" in k),
        "samples_trained": sum(r["samples_trained"] for r in steps),
    }


def run_arm(name: str, overrides: list[str], seconds: float, folder: Path, common: list[str], target: float) -> dict:
    sets = [*overrides, *common, f"run.max_time_s={seconds}", "checkpoint.every_steps=null"]
    summary = train(name, folder, sets, config=CONFIG)
    return figures(name, summary, records(folder / "runs" / name), target)


def run_trl(steps: int, threads: int | None, prompts: int) -> dict:
    """TRL's synchronous GRPOTrainer on this workload, `prompts` x 8 completions a step, in this
    process (a child of main())."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from nonstop.config import TaskConfig
    from nonstop.config.actors import TINY_MODEL_LR
    from nonstop.scoring.rewards import exact_match
    from nonstop.tasks.base import ASSETS, TASK_BASES
    from nonstop.tasks.data import load_task

    base = str(ASSETS / TASK_BASES["long_rollout"])
    data = load_task(TaskConfig(name="long_rollout", eval_size=100), seed=0)
    ds = Dataset.from_list([{"prompt": e.prompt, "answer": e.answer} for e in data.train[: prompts * (steps + 2)]])

    def reward(prompts, completions, answer, **_):
        return [exact_match(c, a) for c, a in zip(completions, answer)]

    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=8 * prompts,
            num_generations=8,
            max_completion_length=1024,
            max_steps=steps,
            learning_rate=TINY_MODEL_LR,
            bf16=False,
            use_cpu=True,
            gradient_checkpointing=False,
            report_to="none",
            save_strategy="no",
            logging_steps=10**6,
            disable_tqdm=True,
            seed=0,
            temperature=1.0,
        )
        trainer = GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
            reward_funcs=reward,
            args=args,
            train_dataset=ds,
            processing_class=AutoTokenizer.from_pretrained(base),
        )
        ends: list[float] = []

        class Ends(TrainerCallback):
            def on_step_end(self, *a, **kw):
                ends.append(time.perf_counter())

        trainer.add_callback(Ends())
        trainer.train()
    wall = ends[-1] - ends[0]
    return {
        "samples_per_s": 8 * prompts * (len(ends) - 1) / wall,
        "steps": len(ends),
        "threads": torch.get_num_threads(),
    }


def trl_arms(steps: int, folder: Path, quick: bool, overrides: list[str]) -> dict[str, float]:
    """samples/s of each TRL arm, each in a child process (its own threads setting)."""
    out: dict[str, float] = {}
    for arm, threads in (("trl1", 1),) if quick else (("trl", None), ("trl1", 1)):
        env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor")}
        cmd = [sys.executable, __file__, "--trl-child", str(steps), *(f"--set={o}" for o in overrides)] + (
            [] if threads is None else ["--trl-threads", "1"]
        )
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise SystemExit(f"{arm} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        out[arm] = res["samples_per_s"]
        print(
            f"{arm:>12} {res['steps']} steps, {res['threads']} threads: {res['samples_per_s']:.2f} samples/s",
            flush=True,
        )
    return out


def acc_at_step(row: dict, step: int) -> float | None:
    return next((a for s, _, a in row["evals"] if s == step), None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=600.0)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-size", type=int, default=100)
    p.add_argument("--target", type=float, default=0.45, help="held-out accuracy whose wall time is compared")
    p.add_argument("--max-lag", type=int, default=4, help="the unbounded arm's buffer.max_lag")
    p.add_argument("--mode-depth", default="depth2", choices=[*DEPTH_ARMS])
    p.add_argument("--arms", default=None, help="comma-separated subset of the arms")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--trl-steps", type=int, default=6, help="TRL steps per arm (0: no TRL arm)")
    p.add_argument("--trl-child", type=int, help=argparse.SUPPRESS)
    p.add_argument("--trl-threads", type=int, help=argparse.SUPPRESS)
    p.add_argument("--set", dest="overrides", action="append", default=[], help="KEY=VALUE for every arm")
    p.add_argument("--keep", type=Path, default=None, help="keep the arms' run folders here (default: deleted)")
    ns = p.parse_args()
    pps = load_config(str(CONFIG), overrides=ns.overrides).rollout.prompts_per_step
    if ns.trl_child is not None:
        print(json.dumps(run_trl(ns.trl_child, ns.trl_threads, pps)))
        return
    if ns.quick:
        ns.seconds, ns.eval_size, ns.seeds = min(ns.seconds, 100.0), min(ns.eval_size, 50), "0"
        ns.trl_steps = min(ns.trl_steps, 3)
    table = arms(ns.max_lag, ns.mode_depth, pps)
    names = ns.arms.split(",") if ns.arms else list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"--arms: unknown {unknown}; choose from {list(table)}")
    if "sync" not in names:
        names.insert(0, "sync")
    common = [f"run.eval_every={ns.eval_every}", f"task.eval_size={ns.eval_size}", *ns.overrides]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="nonstop-long-") as scratch:
        tmp = ns.keep or Path(scratch)
        tmp.mkdir(parents=True, exist_ok=True)
        for name in names:
            rows.append(run_arm(name, table[name], ns.seconds, Path(tmp), common, ns.target))
            print_row(rows[-1], flush=True)
        sync = rows[0]
        common_step = min(max((s for s, _, _ in r["evals"]), default=0) for r in rows)
        best = max(rows[1:], key=lambda r: r["samples_per_s"]) if len(rows) > 1 else sync
        print_table(rows, common_step)
        seeds_acc = seed_runs(ns, table, sync, best, common, Path(tmp))
        trl = trl_arms(ns.trl_steps, Path(tmp), ns.quick, ns.overrides) if ns.trl_steps > 0 else {}
    vs_trl = f"{best['samples_per_s'] / max(trl.values()):.2f}" if trl else "n/a"
    if sync["time_to_target_s"] and best["time_to_target_s"]:
        speedup, basis = sync["time_to_target_s"] / best["time_to_target_s"], "target"
    else:
        speedup, basis = best["samples_per_s"] / max(sync["samples_per_s"], 1e-9), "samples"
    delta = (
        statistics.mean(seeds_acc[best["arm"]]) - statistics.mean(seeds_acc["sync"])
        if all(seeds_acc.values())
        else float("nan")
    )
    print(
        f"RESULT sync_trainer_idle={sync['trainer_idle']:.3f} best_trainer_idle={best['trainer_idle']:.3f} "
        f"best_speedup={speedup:.2f} speedup_basis={basis} best_arm={best['arm']} acc_delta={delta:+.3f} "
        f"wasted_frac={best['wasted_frac']:.3f} ratio_vs_trl={vs_trl}"
    )


def seed_runs(ns, table: dict, sync: dict, best: dict, common: list[str], folder: Path) -> dict[str, list[float]]:
    """Sync and the best arm over seeds, each to the samples sync trained in --seconds (equal trained samples)."""
    steps = sync["steps"]
    out: dict[str, list[float]] = {"sync": [], best["arm"]: []}
    for seed in [int(s) for s in ns.seeds.split(",") if s.strip()]:
        for arm in out:
            sets = [*table[arm], *common, f"run.seed={seed}", f"run.max_steps={steps}", "checkpoint.every_steps=null"]
            s = train(f"{arm}-seed{seed}", folder, sets, config=CONFIG)
            out[arm].append(s["final_accuracy"])
            print(f"seed {seed} {arm:>12}: {steps} steps, final held-out {s['final_accuracy']:.1%}", flush=True)
    for arm, accs in out.items():
        if accs:
            sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
            print(f"{arm:>12}: final held-out over seeds {statistics.mean(accs):.1%} (sd {sd:.1%}) at {steps} steps")
    return out


def print_row(r: dict, flush: bool = False) -> None:
    ttt = f"{r['time_to_target_s']:.0f}s" if r["time_to_target_s"] is not None else "-"
    lag = " ".join(f"{k}:{v:.0%}" for k, v in r["lag"].items() if v >= 0.005)
    print(
        f"{r['arm']:>12} steps {r['steps']:>4} {r['samples_per_s']:6.1f} samples/s {r['tokens_per_s']:7.0f} tok/s "
        f"trainer idle {r['trainer_idle']:4.0%} engine idle {r['engine_idle']:4.0%} "
        f"held-out {r['base']:.0%}->{r['final']:.0%} to target {ttt} wasted {r['wasted_frac']:.1%} "
        f"(lag drops {r['lag_drops']}, uniform {r['uniform_drops']}) lag {lag} pools {r['pool_busy']}",
        flush=flush,
    )


def print_table(rows: list[dict], common_step: int) -> None:
    sync = rows[0]
    print(f"\n{'arm':>12} | samples/s x sync | trainer idle | engine idle | acc@end | acc@step {common_step} | wasted")
    for r in rows:
        at = acc_at_step(r, common_step)
        print(
            f"{r['arm']:>12} | {r['samples_per_s'] / max(sync['samples_per_s'], 1e-9):16.2f} | "
            f"{r['trainer_idle']:12.0%} | {r['engine_idle']:11.0%} | {r['final']:7.1%} | "
            f"{'-' if at is None else f'{at:.1%}':>12} | {r['wasted_frac']:6.1%}"
        )
    modes = sorted((r for r in rows if r["arm"] in MODES), key=lambda r: -r["samples_per_s"])
    if modes:
        print("partial-rollout modes by speed: " + ", ".join(f"{r['arm']} {r['samples_per_s']:.1f}/s" for r in modes))
        by_waste = sorted(modes, key=lambda r: r["wasted_frac"])
        print("partial-rollout modes by waste: " + ", ".join(f"{r['arm']} {r['wasted_frac']:.1%}" for r in by_waste))


if __name__ == "__main__":
    main()
