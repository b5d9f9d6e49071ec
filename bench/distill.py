"""On-policy distillation: a weak student taught by a stronger teacher, vs learning from the reward.

Two tasks (`--task`):

- `cipher` (the default): replace each of twelve letters by its letter in a fixed key
  ("enc:ggaehgehfdce=" -> "ccebfcbfdhab", examples/tasks/cipher.jsonl), rewarded by exact match:
  a long answer and a sparse reward. The student (examples/tasks/cipher-student, 13.4% greedy
  held-out) is a supervised warm-up stopped at step 40; the teacher (cipher-teacher, 100%) is the
  same warm-up run to step 100. Both are shipped with their provenance, because a warm-up is
  chaotic in floating point and would be another model on another CPU. The student's samples
  (temperature 1) almost never spell all twelve letters right, so the reward alone gives it
  almost no signal, while the teacher grades every letter.
- `addition`: the built-in task (3-4-token answers). The student is the shipped weak base
  ('builtin_weak', 8.8%), the teacher the shipped one (`distill.teacher=builtin`: the shipped
  base after 1,500 steps of RL, 79.6%), or with `--teacher-seconds S` one made on the fly.

Three signals, each run once per seed (`run.seed`) with the same budget: reward only,
distillation only (the teacher's per-token reverse KL as the whole advantage,
`distill.task_reward=false`) and both (reward advantage + KL term). On `cipher` every signal
trains on every group (`rollout.filter_uniform_reward=false`), so reward only runs its budget on
groups whose rewards are all equal instead of stopping with NoLearningSignal; on `addition`
reward only is the default job (with `rollout.refill`).

The budget is trainer steps by default (`--steps`, load-independent: a loaded machine makes
every run slower, not shorter); `--seconds S` bounds each run by RL wall time instead. Printed
per signal: the held-out accuracy's mean, min and max over the seeds, mean steps and samples
generated, the mean reward of the last 5 steps, the mean teacher KL of the first and last steps,
and the mean wall time of a run; the RESULT line holds the means.

    python bench/distill.py [--quick] [--task cipher|addition] [--steps N | --seconds S] [--seeds 0,1,2]
                            [--signals reward,distill,both] [--teacher PATH] [--student PATH]
                            [--teacher-seconds S] [--coef 1.0] [--normalize] [--set KEY=VALUE ...]

`--quick`: 2 seeds per signal, 50 steps on cipher (about 4 minutes on a quiet 2-core machine),
120 on addition (4-5 minutes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from rich.console import Console

from nonstop.cli import run_training
from nonstop.config import load_config
from nonstop.config.scoring import SHIPPED_TEACHER
from nonstop.models.shipped import verify

ROOT = Path(__file__).resolve().parent.parent
CIPHER = ROOT / "examples" / "tasks"


class Task(NamedTuple):
    student: str  # a folder (model.path), or 'builtin_weak' (model.base)
    teacher: str
    overrides: list[str]  # of every run
    steps: int
    quick_steps: int


TASKS = {
    "cipher": Task(
        str(CIPHER / "cipher-student"),
        str(CIPHER / "cipher-teacher"),
        [
            "task.name=jsonl",
            f"task.dataset_path={CIPHER / 'cipher.jsonl'}",
            "rollout.max_new_tokens=13",
            "rollout.filter_uniform_reward=false",
        ],
        100,
        50,
    ),
    "addition": Task("builtin_weak", str(SHIPPED_TEACHER), [], 250, 120),
}
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
    distill = [
        f"distill.teacher={teacher}",
        f"distill.coef={ns.coef}",
        f"distill.normalize={ns.normalize}",
        "rollout.filter_uniform_reward=false",
    ]
    return {"reward": [], "distill": [*distill, "distill.task_reward=false"], "both": distill}


def summarise(runs: list[dict]) -> dict:
    accs = [r["acc"] for r in runs]
    kl_first = [r["kl_first"] for r in runs if r["kl_first"] is not None]
    kl_last = [r["kl_last"] for r in runs if r["kl_last"] is not None]
    return {
        "mean": statistics.fmean(accs),
        "min": min(accs),
        "max": max(accs),
        "steps": statistics.fmean(r["steps"] for r in runs),
        "samples": statistics.fmean(r["samples"] for r in runs),
        "reward_last": statistics.fmean(r["reward_last"] for r in runs),
        "wall_s": statistics.fmean(r["wall_s"] for r in runs),
        "kl_first": statistics.fmean(kl_first) if kl_first else None,
        "kl_last": statistics.fmean(kl_last) if kl_last else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="2 seeds per signal, 50 steps (cipher) or 120 (addition)")
    ap.add_argument("--task", choices=tuple(TASKS), default="cipher")
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help="trainer steps per run (default 100 on cipher, 250 on addition; quick 50 / 120)",
    )
    ap.add_argument("--seconds", type=float, default=None, help="bound each run by RL wall time instead of steps")
    ap.add_argument(
        "--seeds", default=None, help="comma-separated run seeds, each signal once per seed (default 0,1,2; quick 0,1)"
    )
    ap.add_argument(
        "--teacher", default=None, help="a teacher folder with a provenance.json; default: the task's shipped one"
    )
    ap.add_argument("--student", default=None, help="a student folder (model.path); default: the task's shipped one")
    ap.add_argument(
        "--teacher-seconds",
        type=float,
        default=0.0,
        help="train a teacher for this long instead of the shipped one (0: the shipped one)",
    )
    ap.add_argument("--coef", type=float, default=1.0)
    ap.add_argument("--normalize", action="store_true", help="distill.normalize=true: standardise the teacher term")
    ap.add_argument("--signals", default=",".join(SIGNALS), help="which of reward,distill,both to run")
    ap.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every student run (e.g. trainer.lr=0.001)",
    )
    ns = ap.parse_args()
    if ns.steps is not None and ns.seconds is not None:
        ap.error("--steps and --seconds are two budgets: give one")
    signals = [x for x in ns.signals.split(",") if x]
    if not signals or set(signals) - set(SIGNALS):
        ap.error(f"--signals: a comma-separated subset of {','.join(SIGNALS)}")
    seeds = [int(s) for s in (ns.seeds or ("0,1" if ns.quick else "0,1,2")).split(",")]
    task = TASKS[ns.task]
    if ns.seconds is not None:
        budget, label = [f"run.max_time_s={ns.seconds}"], f"{ns.seconds:g} s of RL"
    else:
        steps = ns.steps or (task.quick_steps if ns.quick else task.steps)
        budget, label = ["run.max_time_s=null", f"run.max_steps={steps}"], f"{steps} steps"
    student_dir = ns.student or task.student
    student = ["model.base=builtin_weak"] if student_dir == "builtin_weak" else [f"model.path={student_dir}"]
    if ns.teacher_seconds > 0 and ns.task != "addition":
        ap.error("--teacher-seconds trains a teacher on the addition task: use it with --task addition")
    runs: dict[str, list[dict]] = {name: [] for name in signals}
    base = None
    with tempfile.TemporaryDirectory() as out:
        if ns.teacher_seconds > 0:
            teacher_sum, _, _ = train(out, "teacher", [f"run.max_time_s={ns.teacher_seconds}"])
            teacher, teacher_acc = teacher_sum["final_dir"], teacher_sum["final_accuracy"]
            made = f"shipped base + {ns.teacher_seconds:g} s RL"
        else:
            teacher = ns.teacher or task.teacher
            prov = verify(teacher)
            teacher_acc, made = prov["heldout_accuracy"], f"{Path(teacher).name}, {prov['steps']} steps"
        print(f"teacher: {made}, held-out {teacher_acc:.1%}", flush=True)
        per_signal = signal_overrides(teacher, ns)
        for seed in seeds:  # seed-major: an interrupted run still has every signal of the first seeds
            for name in signals:
                summary, recs, wall = train(
                    out,
                    f"{name}-s{seed}",
                    budget,
                    *student,
                    *task.overrides,
                    f"run.seed={seed}",
                    *per_signal[name],
                    *ns.sets,
                )
                kl = [r["teacher_kl"] for r in recs if "teacher_kl" in r]
                rewards = [r["reward_mean"] for r in recs if r.get("reward_mean") is not None]
                base = summary["base_accuracy"]
                runs[name].append(
                    {
                        "acc": summary["final_accuracy"],
                        "steps": summary["steps"],
                        "wall_s": wall,
                        "samples": summary["samples_generated"],
                        "reward_last": statistics.fmean(rewards[-5:]) if rewards else 0.0,
                        "kl_first": kl[0] if kl else None,
                        "kl_last": statistics.fmean(kl[-3:]) if kl else None,
                    }
                )
                print(
                    f"seed {seed} {name:>8}: {base:.1%} -> {summary['final_accuracy']:.1%} "
                    f"({summary['steps']} steps, {summary['samples_generated']} samples, {wall:.0f} s)",
                    flush=True,
                )
    rows = {name: summarise(r) for name, r in runs.items()}
    extra = f"; {' '.join(ns.sets)}" if ns.sets else ""
    print(
        f"\nTask {ns.task}; student: {Path(student_dir).name} ({base:.1%}); "
        f"teacher: {made} ({teacher_acc:.1%}); {label} per run; "
        f"seeds {','.join(map(str, seeds))}; coef {ns.coef:g}{', normalized' if ns.normalize else ''}{extra}"
    )
    print(
        f"{'signal':>8} {'held-out mean':>14} {'min':>6} {'max':>6} {'steps':>6} {'samples':>8} "
        f"{'reward':>7} {'KL first':>9} {'last':>6} {'s/run':>6}"
    )
    for name, r in rows.items():
        first = "-" if r["kl_first"] is None else f"{r['kl_first']:.2f}"
        last = "-" if r["kl_last"] is None else f"{r['kl_last']:.2f}"
        print(
            f"{name:>8} {r['mean']:>14.1%} {r['min']:>6.1%} {r['max']:>6.1%} {r['steps']:>6.0f} "
            f"{r['samples']:>8.0f} {r['reward_last']:>7.3f} {first:>9} {last:>6} {r['wall_s']:>6.0f}"
        )
    accs = " ".join(f"acc_{name}={rows[name]['mean']:.3f}" for name in signals)
    print(f"RESULT {accs} base={base:.3f} teacher={teacher_acc:.3f} seeds={len(seeds)} task={ns.task}")


if __name__ == "__main__":
    main()
