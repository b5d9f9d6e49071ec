"""On-policy distillation: a weak student taught by a stronger teacher, vs learning from the reward.

The teacher is the shipped one (`distill.teacher=builtin`: the shipped 'builtin' base after
1,500 steps of RL, 79.6% held-out, the same bytes on every CPU; bench/make_teacher.py builds
it), or with `--teacher-seconds S` one made on the fly: the default job trained further by RL
for S seconds (its accuracy then depends on the machine's speed). The student is the shipped
weak base ('builtin_weak', 8.8%: GRPO crawls from it, because few groups hold both a right and
a wrong answer). Three signals, each run once per seed (`run.seed`) with the same budget:
reward only (the default job), distillation only (the teacher's per-token reverse KL as the
whole advantage, `distill.task_reward=false`) and both (reward advantage + KL term).

The budget is trainer steps by default (`--steps`, load-independent: a loaded machine makes
every run slower, not shorter); `--seconds S` bounds each run by RL wall time instead. One run
of 250 steps from the weak base varies by several points from seed to seed, more than the
signals differ, so the comparison takes the mean over seeds. Printed per signal: the held-out
accuracy's mean, min and max over the seeds, mean steps and samples generated (reward only
generates more per step: with `rollout.refill` it replaces the groups whose rewards are all
equal, which the other two signals train on), the mean teacher KL of the first and
last steps, and the mean wall time of a run; the RESULT line holds the means.

    python bench/distill.py [--quick] [--steps 250 | --seconds S] [--seeds 0,1,2] [--signals reward,distill,both]
                            [--teacher-seconds S] [--coef 1.0] [--normalize] [--set KEY=VALUE ...]

`--quick`: 2 seeds x 120 steps per signal (six runs, about 4-5 minutes on a quiet 2-core machine).
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
from nonstop.config_scoring import SHIPPED_TEACHER
from nonstop.tasks.base import verify

COMMON = ["checkpoint.every_steps=null", "run.progress=off", "run.max_steps=100000", "run.eval_every=100000"]
SIGNALS = ("reward", "distill", "both")


def train(out: str, name: str, budget: list[str], *overrides: str) -> tuple[dict, list[dict], float]:
    """One run under `budget` (max_time_s or max_steps overrides): summary, step records, wall s."""
    cfg = load_config(overrides=[*COMMON, f"run.out_dir={out}", f"run.name={name}", *budget, *overrides])
    t0 = time.perf_counter()
    summary = run_training(cfg, Console(quiet=True)).to_dict()
    wall = time.perf_counter() - t0
    recs = [json.loads(x) for x in (Path(out) / name / "metrics.jsonl").read_text().splitlines()]
    return summary, [r for r in recs if not r.get("final_eval")], wall


def signal_overrides(teacher: str, ns: argparse.Namespace) -> dict[str, list[str]]:
    distill = [f"distill.teacher={teacher}", f"distill.coef={ns.coef}", f"distill.normalize={ns.normalize}",
               "rollout.filter_uniform_reward=false"]
    return {"reward": [], "distill": [*distill, "distill.task_reward=false"], "both": distill}


def summarise(runs: list[dict]) -> dict:
    accs = [r["acc"] for r in runs]
    kl_first = [r["kl_first"] for r in runs if r["kl_first"] is not None]
    kl_last = [r["kl_last"] for r in runs if r["kl_last"] is not None]
    return {"mean": statistics.fmean(accs), "min": min(accs), "max": max(accs),
            "steps": statistics.fmean(r["steps"] for r in runs),
            "samples": statistics.fmean(r["samples"] for r in runs),
            "wall_s": statistics.fmean(r["wall_s"] for r in runs),
            "kl_first": statistics.fmean(kl_first) if kl_first else None,
            "kl_last": statistics.fmean(kl_last) if kl_last else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="2 seeds x 120 steps per signal (about 4-5 minutes, quiet)")
    ap.add_argument("--steps", type=int, default=None, help="trainer steps per run (default 250; quick 120)")
    ap.add_argument("--seconds", type=float, default=None, help="bound each run by RL wall time instead of steps")
    ap.add_argument("--seeds", default=None, help="comma-separated run seeds, each signal once per seed "
                                                  "(default 0,1,2; quick 0,1)")
    ap.add_argument("--teacher", default=None,
                    help="a teacher folder with a provenance.json (bench/make_teacher.py); default: the shipped one")
    ap.add_argument("--teacher-seconds", type=float, default=0.0,
                    help="train a teacher for this long instead of the shipped one (0: the shipped one)")
    ap.add_argument("--coef", type=float, default=1.0)
    ap.add_argument("--normalize", action="store_true", help="distill.normalize=true: standardise the teacher term")
    ap.add_argument("--signals", default=",".join(SIGNALS), help="which of reward,distill,both to run")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every student run (e.g. trainer.lr=0.001)")
    ns = ap.parse_args()
    if ns.steps is not None and ns.seconds is not None:
        ap.error("--steps and --seconds are two budgets: give one")
    signals = [x for x in ns.signals.split(",") if x]
    if not signals or set(signals) - set(SIGNALS):
        ap.error(f"--signals: a comma-separated subset of {','.join(SIGNALS)}")
    seeds = [int(s) for s in (ns.seeds or ("0,1" if ns.quick else "0,1,2")).split(",")]
    if ns.seconds is not None:
        budget, label = [f"run.max_time_s={ns.seconds}"], f"{ns.seconds:g} s of RL"
    else:
        steps = ns.steps or (120 if ns.quick else 250)
        budget, label = ["run.max_time_s=null", f"run.max_steps={steps}"], f"{steps} steps"
    runs: dict[str, list[dict]] = {name: [] for name in signals}
    base = None
    with tempfile.TemporaryDirectory() as out:
        if ns.teacher_seconds > 0:
            teacher_sum, _, _ = train(out, "teacher", [f"run.max_time_s={ns.teacher_seconds}"])
            teacher, teacher_acc = teacher_sum["final_dir"], teacher_sum["final_accuracy"]
            made = f"shipped base + {ns.teacher_seconds:g} s RL"
        else:
            teacher = ns.teacher or str(SHIPPED_TEACHER)
            prov = verify(teacher)
            teacher_acc, made = prov["heldout_accuracy"], f"shipped, {prov['steps']} steps of RL"
        print(f"teacher: {made}, held-out {teacher_acc:.1%}", flush=True)
        per_signal = signal_overrides(teacher, ns)
        for seed in seeds:  # seed-major: an interrupted run still has every signal of the first seeds
            for name in signals:
                summary, recs, wall = train(out, f"{name}-s{seed}", budget, "model.base=builtin_weak",
                                            f"run.seed={seed}", *per_signal[name], *ns.sets)
                kl = [r["teacher_kl"] for r in recs if "teacher_kl" in r]
                base = summary["base_accuracy"]
                runs[name].append({"acc": summary["final_accuracy"], "steps": summary["steps"], "wall_s": wall,
                                   "samples": summary["samples_generated"],
                                   "kl_first": kl[0] if kl else None,
                                   "kl_last": statistics.fmean(kl[-3:]) if kl else None})
                print(f"seed {seed} {name:>8}: {base:.1%} -> {summary['final_accuracy']:.1%} "
                      f"({summary['steps']} steps, {summary['samples_generated']} samples, {wall:.0f} s)", flush=True)
    rows = {name: summarise(r) for name, r in runs.items()}
    extra = f"; {' '.join(ns.sets)}" if ns.sets else ""
    print(f"\nStudent: shipped weak base ({base:.1%}); teacher: {made} ({teacher_acc:.1%}); {label} per run; "
          f"seeds {','.join(map(str, seeds))}; coef {ns.coef:g}{', normalized' if ns.normalize else ''}{extra}")
    print(f"{'signal':>8} {'held-out mean':>14} {'min':>6} {'max':>6} {'steps':>6} {'samples':>8} "
          f"{'KL first':>9} {'last':>6} {'s/run':>6}")
    for name, r in rows.items():
        first = "-" if r["kl_first"] is None else f"{r['kl_first']:.2f}"
        last = "-" if r["kl_last"] is None else f"{r['kl_last']:.2f}"
        print(f"{name:>8} {r['mean']:>14.1%} {r['min']:>6.1%} {r['max']:>6.1%} {r['steps']:>6.0f} "
              f"{r['samples']:>8.0f} {first:>9} {last:>6} {r['wall_s']:>6.0f}")
    accs = " ".join(f"acc_{name}={rows[name]['mean']:.3f}" for name in signals)
    print(f"RESULT {accs} base={base:.3f} teacher={teacher_acc:.3f} seeds={len(seeds)}")


if __name__ == "__main__":
    main()
