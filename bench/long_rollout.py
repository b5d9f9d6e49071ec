"""Sync against async in the long-rollout regime, learning speed read from held-out curves (issues 29, 51).

Every arm runs the real CLI on `examples/long_rollout.yaml` (the shipped 1.78 M-parameter base,
its BPE, worked solutions of heavy-tailed length: median 85 tokens, p99 805), the engine pinned
to CPU 0 and the trainer to CPU 1, for the same RL wall time `--seconds`, evaluating held-out
accuracy every `--eval-every` steps, once per seed of `--seeds` (default 0,1,2), the arms of one
seed one after another (so a machine that slows down over the invocation slows every arm). Arms:

- sync: buffer.depth 0 (the trainer waits for each batch's longest completion, then the engine
  waits for the trainer);
- depth1, depth2: bounded buffers of 1 and 2 steps ahead (max_lag depth + 1);
- unbounded: buffer.depth null with max_lag `--max-lag`, at most (max_lag + 1) steps of groups queued;
- one arm per partial-rollout mode on the `--mode-depth` buffer (never_stop is that depth's own
  arm): abort_retry, save_resume, drain, and group_cancel (never_stop with engine.group_cancel).

**The curve.** Each run's held-out curve is (step, seconds, accuracy): the base policy's
evaluation at step 0 and 0 s, then every evaluation the run made. Its seconds are the RL clock at
the evaluated step less the time the run's earlier evaluations took (read from the span log): the
learning loop holds for an evaluation, and an arm that steps faster evaluates more often within
the same `--seconds`, so the RL clock with evaluations in it would charge the async arms for
being measured more. Generation that overlaps an evaluation (the engine filling its buffer,
bounded by the buffer's depth) is not charged either. The table also shows the time to target on
the RL clock with the evaluations in it ("wall"), and the RESULT line its median speed-up.

**The target.** After every arm of every seed ran: the highest accuracy any run showed at its
first two evaluations (step 0 and step `--eval-every`), plus `--margin` (default 0.03). So no arm
reaches it by its first evaluation after the start: what is compared is learning, not the time to
the first evaluation. Time to target is the first crossing, interpolated linearly between the
last evaluation below the target and the first at or above it. A run that never reached it is
"not reached", with no time.

**The speed-up** of a seed: sync's time to target over the best arm's (the arm, sync aside, with
the lowest median time to target over the seeds, a run not reached counting as never; ties by
samples/s). Where sync did not reach the target and the best arm did, sync's last evaluation's
time over the best arm's time to target is a lower bound (sync would have needed longer); where
the best arm did not reach it, the seed has no speed-up. The median, min and max are over the
seeds that have one; `speedup_bound=lower` says that one of them is a lower bound (then so are
the median, min and max), `speedup_seeds` how many seeds have one.

Per arm (median over the seeds): samples/s and tokens/s (completion tokens the engines generated
over the RL wall time), trainer and engine idle, held-out at the start, at the end and at the last
step every run evaluated (equal trained samples), evaluations per run, time to target per seed,
the lag histogram of trained tokens, and the tokens wasted: those generated but never trained
(groups dropped for lag, cancelled, or still in flight at the end), as a fraction of all
generated, with the groups dropped for uniform rewards shown apart (a property of the task).

    python bench/long_rollout.py [--seconds 220] [--eval-every 4] [--eval-size 100] [--quick]
        [--arms sync,depth2,...] [--seeds 0,1,2] [--margin 0.03] [--keep DIR]

One run costs `--seconds` and, estimated, 40 s more (start-up, the base evaluation, the last
step's overshoot). Within about 45 minutes on a quiet 2-core machine: `--arms sync,depth2,unbounded`
(9 runs of 220 s, then TRL's two arms of 4 batches). At 220 s sync makes about 20 steps, so
`--eval-every 4` gives it 6-7 evaluations (step 0 included); fewer steps a second (a loaded
machine) need a lower `--eval-every` or more `--seconds`.

`--quick` (plumbing only): 60 s per arm, evaluations every 2 steps on 30 held-out prompts, seed 0,
TRL's one-thread arm for 2 batches. The last line:

    RESULT speedup_median=... speedup_min=... speedup_max=... speedup_bound=exact|lower|missing speedup_seeds=...
    best_arm=... target=... seeds=... sync_trainer_idle=... best_trainer_idle=... ratio_vs_trl=...
    evals_min=... wasted_frac=... wall_speedup_median=...

(one line). evals_min is the fewest evaluations (step 0 included) of any run; the bench says so
when it is under 6, the fewest that show a curve. sync_trainer_idle, best_trainer_idle and
wasted_frac are medians over the seeds, ratio_vs_trl the best arm's median samples/s over the
better TRL arm's; n/a where a figure does not exist (no TRL arm, no seed with a speed-up).

TRL (`--trl-steps` generation batches, 0 skips it; needs the bench extra): `trl.GRPOTrainer` on
the same base, tokenizer, rows (the run's train split) and reward; per batch the config's
prompts_per_step x group_size completions of at most rollout.max_new_tokens, each batch used for
trainer.updates_per_batch optimizer steps (GRPO's mu, TRL's num_iterations); the learning rate
nonstop resolves for this config (sizing/defaults.py `learning_rate`: 1e-4 for the shipped base,
TASK_BASE_LR); fp32 (its bf16 is slower at this width: docs/precision.md). Two arms, torch's
default threads (both cores) and one thread, and the better one is the baseline (vs_trl.py's
rule). Its samples/s are counted over whole batches, from the end of the first batch's last
optimizer step to the end of the last's. TRL's arm makes no held-out evaluation: it gives
samples/s only, and the table says so.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from cli_run import ROOT, train
from nonstop.config import Config, load_config
from nonstop.observe.spans import read_spans
from nonstop.sizing.defaults import learning_rate

CONFIG = ROOT / "examples" / "long_rollout.yaml"
DEPTH_ARMS = {
    "sync": ["buffer.depth=0", "buffer.max_lag=0"],
    "depth1": ["buffer.depth=1", "buffer.max_lag=2"],
    "depth2": ["buffer.depth=2", "buffer.max_lag=3"],
}
MODES = ("abort_retry", "save_resume", "drain", "group_cancel")
MIN_EVALS = 6
"""Evaluations per run (step 0 included) that show a curve: the two the target is set above (step 0
and the first after it) and at least four after them to cross it in."""

Curve = list[tuple[int, float, float]]
"""(step, seconds, held-out accuracy) per evaluation, step 0 first."""


def arms(max_lag: int, mode_depth: str, prompts_per_step: int) -> dict[str, list[str]]:
    # unbounded: admission no longer waits for trainer steps, only for the queue's bound. The engine
    # calls stay within twice what the engine holds (sizing/defaults.py engine_calls_bound), so a deep
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


def curve(base: float, recs: list[dict], eval_s: dict[int, float], with_evals: bool = False) -> Curve:
    """A run's held-out curve from its metrics.jsonl records. A step record's time_s is the RL clock
    before that step's own evaluation; `eval_s` (step -> seconds) is what each evaluation took, and
    the seconds of every earlier one come off unless `with_evals`."""
    times = {r["step"]: r["time_s"] for r in recs if "time_s" in r}
    out: Curve = [(0, 0.0, base)]
    spent = 0.0
    seen: set[int] = set()
    for r in recs:
        step = r["step"]
        if r.get("eval_accuracy") is None or step in seen:
            continue
        seen.add(step)  # a final_eval line (the run ended between evaluations) has the step's time
        out.append((step, times[step] - (0.0 if with_evals else spent), r["eval_accuracy"]))
        spent += eval_s.get(step, 0.0)
    return out


def eval_seconds(run_dir: Path) -> dict[int, float]:
    """Seconds each held-out evaluation took, by step (the orchestrator's `eval` spans)."""
    events = read_spans(run_dir).get("orchestrator", [])
    return {e["step"]: e["t1"] - e["t0"] for e in events if e["ev"] == "eval"}


def target_from(curves: Iterable[Curve], margin: float) -> float:
    """Above every curve's first two evaluations (step 0 and the first after it) by `margin`."""
    return max(a for c in curves for _, _, a in c[:2]) + margin


def time_to_target(c: Curve, target: float) -> float | None:
    """Seconds at the first crossing of `target`, interpolated linearly between the last evaluation
    below it and the first at or above it; None when no evaluation reached it."""
    if c and c[0][2] >= target:
        return c[0][1]
    for (_, t0, a0), (_, t1, a1) in zip(c, c[1:]):
        if a1 >= target:
            return t0 + (t1 - t0) * (target - a0) / (a1 - a0)
    return None


def seed_speedup(sync: Curve, best: Curve, target: float) -> tuple[float | None, str]:
    """(sync's time to target / the best arm's, 'exact' | 'lower' | 'missing'). Sync not reached and
    the best arm reached: sync's last evaluation's time over the best's is a lower bound. The best
    arm not reached: no figure."""
    ts, tb = time_to_target(sync, target), time_to_target(best, target)
    if tb is None or tb <= 0:
        return None, "missing"
    if ts is None:
        return sync[-1][1] / tb, "lower"
    return ts / tb, "exact"


def spread(values: Sequence[tuple[float | None, str]]) -> dict:
    """Median, min and max of the seeds' speed-ups that exist; 'lower' when one is a lower bound."""
    known = [v for v, _ in values if v is not None]
    lower = any(kind == "lower" for _, kind in values)
    if not known:
        return {"median": None, "min": None, "max": None, "bound": "missing", "seeds": 0}
    return {
        "median": statistics.median(known),
        "min": min(known),
        "max": max(known),
        "bound": "lower" if lower else "exact",
        "seeds": len(known),
    }


def median_time(times: Sequence[float | None]) -> float:
    """Median time to target over seeds, a run not reached counting as never (infinity)."""
    return statistics.median([math.inf if t is None else t for t in times])


def records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def figures(name: str, seed: int, summary: dict, run_dir: Path) -> dict:
    """One run's row from its summary.json, metrics.jsonl and span log."""
    recs = records(run_dir)
    steps = [r for r in recs if "lag_hist" in r]  # step records (the trainer's metrics are flattened in)
    eval_s = eval_seconds(run_dir)
    lag: dict[str, int] = {}
    for r in steps:
        for k, v in r["lag_hist"].items():
            lag[k] = lag.get(k, 0) + v
    trained_tokens = sum(lag.values())
    generated = sum(int(e.get("tokens_generated", 0)) for e in summary["engines"])
    wall = summary["rl_wall_s"]
    drops = summary["drops"]
    pools = summary.get("pools") or {}
    return {
        "arm": name,
        "seed": seed,
        "steps": summary["steps"],
        "samples_per_s": summary["samples_per_s"],
        "tokens_per_s": generated / wall if wall > 0 else 0.0,
        "trainer_idle": summary["trainer_idle_frac"],
        "engine_idle": summary["engine_idle_frac"],
        "pool_busy": {k: v.get("busy_frac") for k, v in pools.get("roles", pools).items() if isinstance(v, dict)},
        "curve": curve(summary["base_accuracy"], recs, eval_s),
        "wall_curve": curve(summary["base_accuracy"], recs, eval_s, with_evals=True),
        "eval_s": sum(eval_s.values()),
        "lag": {k: v / max(trained_tokens, 1) for k, v in sorted(lag.items(), key=lambda kv: int(kv[0]))},
        "wasted_frac": max(0, generated - trained_tokens) / generated if generated else 0.0,
        "uniform_drops": drops.get("uniform_reward", 0),
        "lag_drops": sum(v for k, v in drops.items() if "lag" in k),
    }


def run_arm(name: str, seed: int, overrides: list[str], seconds: float, folder: Path, common: list[str]) -> dict:
    run = f"{name}-seed{seed}"
    sets = [*overrides, *common, f"run.seed={seed}", f"run.max_time_s={seconds}", "checkpoint.every_steps=null"]
    summary = train(run, folder, sets, config=CONFIG)
    return figures(name, seed, summary, folder / "runs" / run)


def trl_batch(cfg: Config) -> dict:
    """GRPOConfig's fields that make TRL's step nonstop's: the batch (prompts_per_step x group_size
    completions of at most max_new_tokens), mu (trainer.updates_per_batch) and the learning rate
    nonstop resolves for the config (sizing/defaults.py; the shipped base: no model.path)."""
    r = cfg.rollout
    return {
        "per_device_train_batch_size": r.group_size * r.prompts_per_step,
        "num_generations": r.group_size,
        "num_iterations": cfg.trainer.updates_per_batch,
        "max_completion_length": r.max_new_tokens,
        "learning_rate": learning_rate(cfg, None)[0],
    }


def run_trl(batches: int, threads: int | None, overrides: list[str]) -> dict:
    """TRL's synchronous GRPOTrainer on this workload, in this process (a child of main()): the
    config's batch, mu and the learning rate nonstop resolves for it."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    from nonstop.models.shipped import ASSETS, TASK_BASES
    from nonstop.tasks.data import load_task
    from trl_common import answer_dataset, exact_match_reward, grpo_config, step_ends

    cfg = load_config(str(CONFIG), overrides=overrides)
    r, mu = cfg.rollout, cfg.trainer.updates_per_batch
    same = trl_batch(cfg)
    base = str(ASSETS / TASK_BASES[cfg.task.name])
    data = load_task(cfg.task)  # the split the runs use (task.split_seed)
    ds = answer_dataset(data.train[: r.prompts_per_step * (batches + 2)])
    with tempfile.TemporaryDirectory() as out:
        trainer = GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
            reward_funcs=exact_match_reward,
            args=grpo_config(out, batches * mu, **same),
            train_dataset=ds,
            processing_class=AutoTokenizer.from_pretrained(base),
        )
        ends = step_ends(trainer)
        trainer.train()
    # a batch is generated, then trained mu times: whole batches from the end of the first's last step
    wall = ends[-1] - ends[mu - 1]
    return {
        "samples_per_s": r.group_size * r.prompts_per_step * (len(ends) // mu - 1) / wall,
        "steps": len(ends),
        "batches": len(ends) // mu,
        "threads": torch.get_num_threads(),
        "lr": same["learning_rate"],
    }


def trl_arms(batches: int, folder: Path, quick: bool, overrides: list[str]) -> dict[str, dict]:
    """Each TRL arm's figures, each in a child process (its own threads setting)."""
    out: dict[str, dict] = {}
    for arm, threads in (("trl1", 1),) if quick else (("trl", None), ("trl1", 1)):
        env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor")}
        cmd = [sys.executable, __file__, "--trl-child", str(batches), *(f"--set={o}" for o in overrides)] + (
            [] if threads is None else ["--trl-threads", "1"]
        )
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise SystemExit(f"{arm} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        out[arm] = json.loads(proc.stdout.strip().splitlines()[-1])
        res = out[arm]
        print(
            f"{arm:>12} {res['batches']} batches ({res['steps']} optimizer steps) at lr {res['lr']:g}, "
            f"{res['threads']} threads: {res['samples_per_s']:.2f} samples/s, no held-out evaluation",
            flush=True,
        )
    return out


def acc_at_step(c: Curve, step: int) -> float | None:
    return next((a for s, _, a in c if s == step), None)


def med(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def fmt(v: float | None, spec: str = ".2f") -> str:
    return "n/a" if v is None else format(v, spec)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=220.0, help="RL wall time of each run")
    p.add_argument("--eval-every", type=int, default=4)
    p.add_argument("--eval-size", type=int, default=100)
    p.add_argument("--margin", type=float, default=0.03, help="the target's margin over the first two evaluations")
    p.add_argument("--max-lag", type=int, default=4, help="the unbounded arm's buffer.max_lag")
    p.add_argument("--mode-depth", default="depth2", choices=[*DEPTH_ARMS])
    p.add_argument("--arms", default=None, help="comma-separated subset of the arms (sync always runs)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--trl-steps", type=int, default=4, help="TRL generation batches per arm (0: no TRL arm)")
    p.add_argument("--trl-child", type=int, help=argparse.SUPPRESS)
    p.add_argument("--trl-threads", type=int, help=argparse.SUPPRESS)
    p.add_argument("--set", dest="overrides", action="append", default=[], help="KEY=VALUE for every arm")
    p.add_argument("--keep", type=Path, default=None, help="keep the arms' run folders here (default: deleted)")
    ns = p.parse_args()
    if ns.trl_child is not None:
        print(json.dumps(run_trl(ns.trl_child, ns.trl_threads, ns.overrides)))
        return
    if ns.quick:
        ns.seconds, ns.eval_size, ns.eval_every, ns.seeds = min(ns.seconds, 60.0), min(ns.eval_size, 30), 2, "0"
        ns.trl_steps = min(ns.trl_steps, 2)
    pps = load_config(str(CONFIG), overrides=ns.overrides).rollout.prompts_per_step
    table = arms(ns.max_lag, ns.mode_depth, pps)
    names = ns.arms.split(",") if ns.arms else list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"--arms: unknown {unknown}; choose from {list(table)}")
    names = ["sync", *(n for n in names if n != "sync")]
    if len(names) < 2:
        raise SystemExit("--arms: name at least one arm besides sync")
    seeds = [int(s) for s in ns.seeds.split(",") if s.strip()]
    if not seeds:
        raise SystemExit("--seeds: at least one seed")
    if ns.trl_steps == 1:
        raise SystemExit("--trl-steps: at least 2 batches (samples/s are counted after the first), or 0")
    common = [f"run.eval_every={ns.eval_every}", f"task.eval_size={ns.eval_size}", *ns.overrides]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="nonstop-long-") as scratch:
        tmp = ns.keep or Path(scratch)
        tmp.mkdir(parents=True, exist_ok=True)
        for seed in seeds:
            for name in names:
                runs[name].append(run_arm(name, seed, table[name], ns.seconds, Path(tmp), common))
                print_run(runs[name][-1])
        trl = trl_arms(ns.trl_steps, Path(tmp), ns.quick, ns.overrides) if ns.trl_steps > 0 else {}
    print(f"total wall time of the runs {time.perf_counter() - t0:.0f} s")
    print(report(runs, trl, seeds, ns.margin, ns.eval_every))


def report(runs: dict[str, list[dict]], trl: dict[str, dict], seeds: list[int], margin: float, eval_every: int) -> str:
    """Print the target, the table and each seed's speed-up from every run's row (sync's first, one
    row per seed in `seeds`' order); return the RESULT line."""
    target = target_from((r["curve"] for rs in runs.values() for r in rs), margin)
    for rs in runs.values():
        for r in rs:
            r["ttt"] = time_to_target(r["curve"], target)
            r["wall_ttt"] = time_to_target(r["wall_curve"], target)
    others = [n for n in runs if n != "sync"]
    best_name = min(others, key=lambda n: (median_time([r["ttt"] for r in runs[n]]), -med(runs[n], "samples_per_s")))
    sync, best = runs["sync"], runs[best_name]
    per_seed = [seed_speedup(s["curve"], b["curve"], target) for s, b in zip(sync, best)]
    wall = spread([seed_speedup(s["wall_curve"], b["wall_curve"], target) for s, b in zip(sync, best)])
    sp = spread(per_seed)
    evals_min = min(len(r["curve"]) for rs in runs.values() for r in rs)
    print(f"\ntarget {target:.1%}: the highest of every run's first two evaluations + {margin:.2f}")
    print_table(runs, trl, eval_every)
    for seed, (v, kind), s, b in zip(seeds, per_seed, sync, best):
        if kind == "exact":
            what = f"{v:.2f}x"
        elif kind == "lower":
            what = f">= {v:.2f}x (sync did not reach the target)"
        else:
            what = f"none ({best_name} did not reach the target)"
        print(f"seed {seed}: sync {show_t(s['ttt'])}, {best_name} {show_t(b['ttt'])}: {what}")
    if evals_min < MIN_EVALS:
        print(f"fewest evaluations in a run: {evals_min} (under {MIN_EVALS}: raise --seconds or lower --eval-every)")
    vs_trl = med(best, "samples_per_s") / max(t["samples_per_s"] for t in trl.values()) if trl else None
    return (
        f"RESULT speedup_median={fmt(sp['median'])} speedup_min={fmt(sp['min'])} speedup_max={fmt(sp['max'])} "
        f"speedup_bound={sp['bound']} speedup_seeds={sp['seeds']} best_arm={best_name} target={target:.3f} "
        f"seeds={len(seeds)} sync_trainer_idle={med(sync, 'trainer_idle'):.3f} "
        f"best_trainer_idle={med(best, 'trainer_idle'):.3f} ratio_vs_trl={fmt(vs_trl)} evals_min={evals_min} "
        f"wasted_frac={med(best, 'wasted_frac'):.3f} wall_speedup_median={fmt(wall['median'])}"
    )


def show_t(t: float | None) -> str:
    return "not reached" if t is None else f"{t:.0f}s"


def print_run(r: dict) -> None:
    lag = " ".join(f"{k}:{v:.0%}" for k, v in r["lag"].items() if v >= 0.005)
    c = " ".join(f"{s}:{a:.0%}@{t:.0f}s" for s, t, a in r["curve"])
    print(
        f"{r['arm']:>12} seed {r['seed']} steps {r['steps']:>4} {r['samples_per_s']:6.1f} samples/s "
        f"{r['tokens_per_s']:7.0f} tok/s trainer idle {r['trainer_idle']:4.0%} engine idle {r['engine_idle']:4.0%} "
        f"wasted {r['wasted_frac']:.1%} (lag drops {r['lag_drops']}, uniform {r['uniform_drops']}) lag {lag} "
        f"pools {r['pool_busy']}; evaluations {r['eval_s']:.0f}s, curve (step:acc@s) {c}",
        flush=True,
    )


def print_table(runs: dict[str, list[dict]], trl: dict[str, dict], eval_every: int) -> None:
    """Medians over the seeds; times to target per seed."""
    sync = med(runs["sync"], "samples_per_s")

    def x_sync(samples_per_s: float) -> str:
        return fmt(samples_per_s / sync if sync > 0 else None)

    common = min(r["curve"][-1][0] for rs in runs.values() for r in rs) // eval_every * eval_every
    print(
        f"\n{'arm':>12} | samples/s x sync | trainer idle | engine idle | evals | held-out start -> end | "
        f"at step {common} | to target (s), per seed | wall, with evals (s) | wasted"
    )
    for name, rs in runs.items():
        at = [a for a in (acc_at_step(r["curve"], common) for r in rs) if a is not None]
        counts = sorted(len(r["curve"]) for r in rs)
        evals = str(counts[0]) if counts[0] == counts[-1] else f"{counts[0]}-{counts[-1]}"
        start, end = [r["curve"][0][2] for r in rs], [r["curve"][-1][2] for r in rs]
        print(
            f"{name:>12} | {x_sync(med(rs, 'samples_per_s')):>16} | "
            f"{med(rs, 'trainer_idle'):12.0%} | {med(rs, 'engine_idle'):11.0%} | "
            f"{evals:>5} | "
            f"{statistics.median(start):10.1%} -> {statistics.median(end):5.1%} | "
            f"{fmt(statistics.median(at) if at else None, '.1%'):>9} | "
            f"{', '.join(show_t(r['ttt']) for r in rs):>22} | {', '.join(show_t(r['wall_ttt']) for r in rs):>20} | "
            f"{med(rs, 'wasted_frac'):6.1%}"
        )
    for arm, t in trl.items():
        print(
            f"{arm:>12} | {x_sync(t['samples_per_s']):>16} | {'':>12} | {'':>11} | "
            f"{0:>5} | no held-out evaluation (samples/s only: {t['batches']} batches, lr {t['lr']:g})"
        )
    modes = sorted((rs for n, rs in runs.items() if n in MODES), key=lambda rs: -med(rs, "samples_per_s"))
    if modes:
        print(
            "partial-rollout modes by speed: "
            + ", ".join(f"{rs[0]['arm']} {med(rs, 'samples_per_s'):.1f}/s" for rs in modes)
        )
        by_waste = sorted(modes, key=lambda rs: med(rs, "wasted_frac"))
        print(
            "partial-rollout modes by waste: "
            + ", ".join(f"{rs[0]['arm']} {med(rs, 'wasted_frac'):.1%}" for rs in by_waste)
        )


if __name__ == "__main__":
    main()
