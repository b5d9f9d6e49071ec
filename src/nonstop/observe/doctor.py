"""The run doctor: patterns in a run's step records that mean it has stopped learning, each named
with its likely cause and the setting to try.

Six patterns, each a pure function over a few summaries of the records (observe/patterns.py):
- `reward_not_heldout`: the training reward rose while held-out accuracy stayed flat: the policy
  learns the reward, not the task (a partial credit or a format the held-out exact match does not
  count), or it learns the training prompts only;
- `signal_collapse`: few generated groups still have rewards that differ, and GRPO learns only
  from those;
- `entropy_collapse`: the policy samples nearly one completion per prompt before it is right;
- `length_at_limit`: most completions are cut at rollout.max_new_tokens;
- `ratio_clipping`: the trainer clips the ratio of many tokens (its policy is far from the one
  that sampled);
- `below_base`: held-out accuracy fell under the base policy's (marked cleared at the end of a
  run whose final evaluation is over the base's: a dip early in a run that then learnt).

Every finding is reported once. The thresholds are the `doctor:` section of the config
(config/flow.py); docs/doctor.md says how they were calibrated.

`Doctor` is the watcher the learning loop feeds with each step record (a metrics.jsonl line as a
dict): it keeps the first window of steps, the newest window and one entry per evaluation, so
its memory does not grow with the run's length, and it runs the checks only on evaluation steps
and once a window, so a step costs it a few dictionary reads. `diagnose(records, ...)` runs the
same over a finished run's metrics.jsonl (`nonstop report` uses it for runs that predate it).
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from nonstop.config.flow import DoctorConfig
from nonstop.observe.patterns import (
    Context,
    Eval,
    Finding,
    Point,
    Window,
    below_base_cleared,
    check_below_base,
    check_entropy_collapse,
    check_length_at_limit,
    check_no_step,
    check_ratio_clipping,
    check_reward_not_heldout,
    check_signal_collapse,
)

__all__ = ["Context", "Doctor", "Finding", "diagnose", "read_records"]


class Doctor:
    """Feeds on step records, keeps bounded summaries, reports each pattern once (see the module docstring)."""

    def __init__(self, cfg: DoctorConfig, ctx: Context, base_accuracy: float) -> None:
        self.cfg, self.ctx, self.base = cfg, ctx, base_accuracy
        self.early: list[Point] = []
        self.late: deque[Point] = deque(maxlen=cfg.window_steps)
        self.evals: list[Eval] = [Eval(0, base_accuracy, None, None)]
        self.found: dict[str, Finding] = {}
        self.lr = ctx.lr
        self._next_check = cfg.min_steps

    @property
    def findings(self) -> list[Finding]:
        return sorted(self.found.values(), key=lambda f: f.step)

    def report(self) -> dict[str, Any]:
        """summary.json's `doctor`."""
        return {"enabled": self.cfg.enabled, "findings": [f.to_dict() for f in self.findings]}

    def observe(self, record: Mapping[str, Any]) -> list[Finding]:
        """Take one step record (or an evaluation-only line); return the patterns seen for the first time."""
        if not self.cfg.enabled:
            return []
        if "reward_mean" in record:
            p = Point.of(record)
            if len(self.early) < self.cfg.window_steps:
                self.early.append(p)
            self.late.append(p)
            self.lr = record.get("lr", self.lr)
        acc = record.get("eval_accuracy")
        step = int(record["step"])
        if acc is not None:
            late = self._late()
            self.evals.append(Eval(step, float(acc), late.mean("reward"), late.mean("sample_accuracy")))
        if step < self.cfg.min_steps or (acc is None and step < self._next_check):
            return []
        self._next_check = step + self.cfg.window_steps
        return self._check()

    def _late(self) -> Window:
        return Window(list(self.late))

    def _check(self) -> list[Finding]:
        if not self.early:
            return []
        cfg, ctx, lr = self.cfg, self.ctx, self.lr
        early, late = Window(self.early), self._late()
        seen = [
            check_reward_not_heldout(self.evals, early, ctx, cfg, lr, late.points[-1].epoch if late.points else 0),
            check_signal_collapse(early, late, self.evals, ctx, cfg, lr),
            check_entropy_collapse(early, late, self.evals, cfg, lr),
            check_length_at_limit(early, late, ctx, cfg),
            check_ratio_clipping(late, cfg, lr),
            check_below_base(self.evals, self.base, cfg, lr),
        ]
        new = [f for f in seen if f is not None and f.code not in self.found]
        for f in new:
            self.found[f.code] = f
        return new

    def finish(self, pending: Mapping[str, Any]) -> list[Finding]:
        """At the end of the run, the groups scored since its last step (`pending`: Vitals.take()'s
        fields; {} when none): a run that kept waiting for batches with signal is a finding, also
        one too short (or stuck before its first step) for the window checks. A `below_base`
        finding that the final evaluation undoes is marked cleared. Returns the new findings and
        the ones cleared."""
        if not self.cfg.enabled:
            return []
        out = self.clear()
        if "signal_collapse" not in self.found:
            f = check_no_step(self._late(), pending, self.evals[-1].accuracy, self.ctx, self.cfg)
            if f is not None:
                self.found[f.code] = f
                out.append(f)
        return out

    def clear(self) -> list[Finding]:
        """Mark a `below_base` finding that the newest evaluation undoes as cleared; returns it, if so."""
        below = self.found.get("below_base")
        cleared = below_base_cleared(self.evals, self.base, self.cfg) if below and not below.cleared else None
        if below is None or cleared is None:
            return []
        self.found["below_base"] = replace(below, cleared=cleared)
        return [self.found["below_base"]]


def read_records(path: Path, upto_step: int | None = None) -> list[dict[str, Any]]:
    """metrics.jsonl's lines as dicts (up to `upto_step`); a line cut short by a crash is skipped."""
    out: list[dict[str, Any]] = []
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(r, dict) and "step" in r and (upto_step is None or r["step"] <= upto_step):
            out.append(r)
    return out


def diagnose(
    records: Iterable[Mapping[str, Any]], base_accuracy: float, ctx: Context, cfg: DoctorConfig | None = None
) -> list[Finding]:
    """Every pattern a Doctor fed these records (metrics.jsonl's lines, in order) would report, a
    `below_base` that the newest evaluation undoes marked cleared."""
    doctor = Doctor(cfg or DoctorConfig(), ctx, base_accuracy)
    for r in records:
        doctor.observe(r)
    doctor.clear()
    return doctor.findings
