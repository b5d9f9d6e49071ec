"""Live progress: a rich panel on a terminal, plain lines elsewhere (CI, logs), or nothing; and
`summary_table`, the table `nonstop train` prints at the end of a run."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

if TYPE_CHECKING:
    from nonstop.orchestrator.records import RunSummary, StepRecord


def _lag_text(hist: dict[str, int]) -> str:
    total = sum(hist.values()) or 1
    return " ".join(f"{k}:{v / total:.0%}" for k, v in hist.items()) or "-"


def _mfu_text(r: "StepRecord", engine_frac: float | None) -> str:
    """Achieved FLOP/s as fractions of the measured matmul peaks: 'trainer%/engine%' ('-' where unknown)."""
    trainer = r.trainer.get("peak_frac")
    parts = [f"{x:.0%}" if x is not None else "-" for x in (trainer, engine_frac)]
    return "/".join(parts)


class Progress:
    def __init__(self, mode: str, total_steps: int, console: Console | None = None) -> None:
        self.console = console or Console(stderr=False)
        if mode == "auto":
            mode = "rich" if self.console.is_terminal else "plain"
        self.mode = mode
        self.total_steps = total_steps
        self.live: Live | None = None
        self.last_eval: float | None = None
        self.base_eval: float | None = None
        self.metric = "exact_match"
        """The held-out score's name (the task's reward), shown beside it."""
        self.engine_frac: float | None = None  # the engines' counters are read every few seconds, not every step
        self._last_plain = 0.0

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def log(self, message: str) -> None:
        if self.mode == "off":
            return
        if self.live is not None:
            self.live.console.print(message)
        else:
            self.console.print(message, highlight=False, soft_wrap=True)

    def _table(self, r: "StepRecord") -> Table:
        t = Table(title="nonstop train", show_header=True, header_style="bold")
        for col in (
            "step",
            "version",
            "reward",
            f"held-out {self.metric}",
            "samples/s",
            "trainer idle",
            "engine idle",
            "lag",
            "drops",
            "mfu trainer/engine",
        ):
            t.add_column(col)
        acc = "-" if self.last_eval is None else f"{self.last_eval:.1%}"
        if self.base_eval is not None and self.last_eval is not None:
            acc += f" (base {self.base_eval:.1%})"
        t.add_row(
            f"{r.step}/{self.total_steps}",
            str(r.policy_version),
            f"{r.reward_mean:.3f}",
            acc,
            f"{r.samples_per_s:.0f}",
            f"{r.trainer_idle_frac:.0%}",
            f"{r.engine_idle_frac:.0%}",
            _lag_text(r.lag_hist),
            str(sum(r.drops.values())),
            _mfu_text(r, self.engine_frac),
        )
        return t

    def update(self, record: "StepRecord") -> None:
        if record.eval_accuracy is not None:
            self.last_eval = record.eval_accuracy
        if record.engine_peak_frac is not None:
            self.engine_frac = record.engine_peak_frac
        if self.mode == "rich":
            if self.live is None:
                self.live = Live(self._table(record), console=self.console, refresh_per_second=4)
                self.live.start()
            else:
                self.live.update(self._table(record))
        elif self.mode == "plain":
            now = time.monotonic()
            if record.eval_accuracy is not None or now - self._last_plain >= 10.0:
                self._last_plain = now
                acc = "" if record.eval_accuracy is None else f" held-out {self.metric} {record.eval_accuracy:.1%}"
                self.log(
                    f"step {record.step:>4} v{record.policy_version} reward {record.reward_mean:.3f}{acc} "
                    f"{record.samples_per_s:.0f} samples/s trainer idle {record.trainer_idle_frac:.0%} "
                    f"lag {_lag_text(record.lag_hist)} mfu {_mfu_text(record, self.engine_frac)}"
                )

    def stop(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None


def summary_table(s: "RunSummary") -> Table:
    t = Table(title="nonstop: end of run", show_header=False)
    base, final = s.base_accuracy, s.final_accuracy or 0.0
    t.add_row(f"held-out {s.eval_metric}", f"base {base:.1%} -> final {final:.1%} ({100 * (final - base):+.1f} points)")
    if s.resumed_from:  # the RL clock continues across resumes; this command's wall time does not
        t.add_row(
            "wall time",
            f"{s.wall_s:.1f} s this session (resumed; {s.warmup_s:.1f} s loading the checkpoint); "
            f"RL {s.rl_wall_s:.1f} s over all sessions",
        )
    else:
        t.add_row("wall time", f"{s.wall_s:.1f} s total ({s.warmup_s:.1f} s base policy, {s.rl_wall_s:.1f} s RL)")
    t.add_row("steps", f"{s.steps} (policy_version {s.policy_version})")
    t.add_row("samples/s", f"{s.samples_per_s:.0f} ({s.samples_generated} generated)")
    t.add_row("idle", f"trainer {s.trainer_idle_frac:.0%}, engine {s.engine_idle_frac:.0%}")
    if s.pools:  # pinned pools: how busy each role kept its own CPUs
        t.add_row(
            "CPU pools",
            ", ".join(
                f"{role} cpus {','.join(map(str, p['cpus']))} busy {p['busy_frac']:.0%}"
                if p["cpus"]
                else f"{role} {p['busy_frac']:.2f} cores"
                for role, p in s.pools.items()
            ),
        )
    t.add_row("dropped groups", json.dumps(s.drops) if s.drops else "none")
    p, faults = s.prompts, s.engine_faults
    t.add_row(
        "prompts",
        f"{p['settled']} settled, {p['in_flight']} in flight, {p['duplicated']} duplicated, "
        f"{p['requeued'] + faults['requeued']} re-queued",
    )
    if faults["restarts"]:
        t.add_row(
            "engine restarts",
            f"{faults['restarts']} (detect <= {faults['max_detect_s']:.1f} s, "
            f"recover <= {faults['max_recover_s']:.1f} s)",
        )
    if s.reward_errors:
        t.add_row("reward errors", f"{json.dumps(s.reward_errors)}; last: {s.last_reward_error}")
    if s.doctor is not None and s.doctor["enabled"]:
        findings = s.doctor["findings"]
        t.add_row(
            "doctor",
            "\n".join(f"{f['code']} (step {f['step']}): {f['cause']}; try {'; '.join(f['try'])}" for f in findings)
            or "no findings",
        )
    t.add_row("run folder", s.run_dir)
    return t
