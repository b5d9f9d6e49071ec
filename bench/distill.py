"""On-policy distillation: a weak student taught by a stronger teacher, vs learning from the reward.

The teacher is the shipped one (`distill.teacher=builtin`: the shipped 'builtin' base after
1,500 steps of RL, the same bytes on every CPU; bench/make_teacher.py builds it), or with
`--teacher-seconds S` one made on the fly: the default job trained further by RL for S seconds
(its accuracy then depends on the machine's speed and CPU). The student
is the shipped weak base ('builtin_weak', 9%: GRPO crawls from it, because few groups hold
both a right and a wrong answer). Three student runs get the same RL wall time, side by side:
reward only (the default job), distillation only (the teacher's per-token reverse KL as the
whole advantage, `distill.task_reward=false`), and both (reward advantage + KL term). Printed
per run: final held-out accuracy, steps, the mean teacher KL of the first and last steps.

    python bench/distill.py [--quick] [--seconds 90 | --steps N] [--teacher-seconds S] [--coef 1.0] [--normalize]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from rich.console import Console

from nonstop.cli import run_training
from nonstop.config import load_config
from nonstop.config_scoring import SHIPPED_TEACHER
from nonstop.tasks.base import verify

COMMON = ["checkpoint.every_steps=null", "run.progress=off", "run.max_steps=100000", "run.eval_every=100000"]


def train(out: str, name: str, seconds: float, *overrides: str, steps: int | None = None) -> tuple[dict, list[dict]]:
    """One run of `seconds` of RL, or of `steps` trainer steps when given (then time is unbounded)."""
    budget = [f"run.max_time_s={seconds}"] if steps is None else ["run.max_time_s=null", f"run.max_steps={steps}"]
    cfg = load_config(overrides=[*COMMON, f"run.out_dir={out}", f"run.name={name}", *budget, *overrides])
    summary = run_training(cfg, Console(quiet=True)).to_dict()
    recs = [json.loads(x) for x in (Path(out) / name / "metrics.jsonl").read_text().splitlines()]
    return summary, [r for r in recs if not r.get("final_eval")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="3 x 45 s students (about 3 minutes)")
    ap.add_argument("--seconds", type=float, default=90.0, help="RL wall time of each student run")
    ap.add_argument("--teacher-seconds", type=float, default=0.0,
                    help="train a teacher for this long instead of the shipped one (0: the shipped one)")
    ap.add_argument("--coef", type=float, default=1.0)
    ap.add_argument("--normalize", action="store_true", help="distill.normalize=true: standardise the teacher term")
    ap.add_argument("--steps", type=int, default=None,
                    help="give each student this many trainer steps instead of --seconds (load-independent)")
    ns = ap.parse_args()
    seconds, teacher_s = (45.0 if ns.quick else ns.seconds), ns.teacher_seconds
    rows = {}
    with tempfile.TemporaryDirectory() as out:
        if teacher_s > 0:
            teacher_sum, _ = train(out, "teacher", teacher_s)
            teacher, teacher_acc = teacher_sum["final_dir"], teacher_sum["final_accuracy"]
            made = f"shipped base + {teacher_s:g} s RL"
        else:
            teacher = str(SHIPPED_TEACHER)
            prov = verify(teacher)
            teacher_acc, made = prov["heldout_accuracy"], f"shipped, {prov['steps']} steps of RL"
        print(f"teacher: {made}, held-out {teacher_acc:.1%}", flush=True)
        student = ["model.base=builtin_weak"]
        distill = [f"distill.teacher={teacher}", f"distill.coef={ns.coef}", f"distill.normalize={ns.normalize}",
                   "rollout.filter_uniform_reward=false"]
        for name, extra in (("reward", []), ("distill", [*distill, "distill.task_reward=false"]), ("both", distill)):
            summary, recs = train(out, name, seconds, *student, *extra, steps=ns.steps)
            kl = [r["teacher_kl"] for r in recs if "teacher_kl" in r]
            rows[name] = {"acc": summary["final_accuracy"], "base": summary["base_accuracy"], "steps": summary["steps"],
                          "kl_first": kl[0] if kl else None, "kl_last": sum(kl[-3:]) / len(kl[-3:]) if kl else None}
            print(f"{name:>8}: {summary['base_accuracy']:.1%} -> {summary['final_accuracy']:.1%} "
                  f"({summary['steps']} steps)", flush=True)
    budget = f"{seconds:g} s of RL" if ns.steps is None else f"{ns.steps} steps"
    print(f"\nStudent: shipped weak base; teacher: {made} ({teacher_acc:.1%}); {budget} per student run; "
          f"coef {ns.coef:g}{', normalized' if ns.normalize else ''}")
    print(f"{'signal':>8} {'held-out acc':>13} {'steps':>6} {'teacher KL first':>17} {'last':>6}")
    for name, r in rows.items():
        first = "-" if r["kl_first"] is None else f"{r['kl_first']:.3f}"
        last = "-" if r["kl_last"] is None else f"{r['kl_last']:.3f}"
        print(f"{name:>8} {r['acc']:>13.1%} {r['steps']:>6} {first:>17} {last:>6}")
    print(f"RESULT acc_reward={rows['reward']['acc']:.3f} acc_distill={rows['distill']['acc']:.3f} "
          f"acc_both={rows['both']['acc']:.3f} base={rows['reward']['base']:.3f} "
          f"teacher={teacher_acc:.3f}")


if __name__ == "__main__":
    main()
