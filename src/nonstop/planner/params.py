"""What the capacity planner knows about a pipeline: rates and sizes, calibrated or stated.

`PlanParams` holds the cost model (docs/planning.md has the equations):

- engine forward pass: tau(B) = (pass_s + pass_row_s x B) x (1 + engine_slowdown x [trainer busy]),
  B the rows (sequences) in the pass, every row emitting one token;
- trainer step on T completion tokens over R ranks: (step_s + step_token_s x T / R) x
  (1 + trainer_slowdown x engines-busy fraction at the step's start);
- publish_s per weight publish (trainer side), apply_s per version made live (engine side);
- admit_delay_s (admission -> engine call) and deliver_delay_s (engine done -> group buffered);
  `admit_delays`, when measured, are resampled instead of the mean: the producer sends the groups
  of one admission one call at a time, so they reach an engine spread over several passes;
- pickup_passes: 1 when a request that reaches a busy engine is seen by its loop at the next
  pass boundary and joins the batch at the one after (nonstop's engine: its actor reads calls
  between passes and submits them on the following loop turn), 0 when it joins at the next;
- loop_s: the learning loop's own time per step besides the trainer's work and waiting for a
  batch (calls' round trips, records, admission);
- completion lengths: `groups_lens`, the completion lengths of real groups, resampled whole; or,
  when stated instead of measured, a log-normal with median `len_median` and shape `len_sigma`,
  cut at `len_max` (the long tail of reasoning outputs);
- drop_frac: the share of groups dropped without learning signal (refunded and replaced);
- eval_s: one held-out evaluation.

Processes that share processors (on this 2-core machine every engine and trainer rank is a
CPU process) slow each other down: with `cores` set, an actor runs at min(1, cores / busy
actors) of its speed, so a second engine on the same cores is no free capacity. `cores` None
means each actor has its own device; the two slowdown terms then describe any other coupling.

`calibrate(timeline, cfg)` fits them to a run's span log (nonstop.timeline): tau by weighted
least squares over the engines' busy chunks (a chunk's mean pass time against its mean rows and
its overlap with trainer steps: a linear model's mean is the model at the mean, so chunks
average without bias; a chunk's time includes the engine's work between its passes), the step
time likewise over trainer steps, the rest as means. When the fitted slowdowns show the two sides competing,
they become `cores`: with n actors busy at once in the calibration run slowed by a factor 1 + s,
cores = n / (1 + s).
`Shape` is what the planner may change: engines, trainer ranks, depth, max_lag, batch.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from statistics import fmean
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nonstop.config import Config
    from nonstop.timeline import Timeline


@dataclass(frozen=True)
class Shape:
    """The pipeline's shape: what a sweep varies."""

    engines: int = 1
    trainer_ranks: int = 1
    depth: int | None = 1  # None: unbounded stream
    max_lag: int | None = 2  # None: no rejection
    prompts_per_step: int = 32
    group_size: int = 8
    slots: int = 256  # engine.max_concurrent_seqs
    steps: int = 60
    eval_every: int | None = None
    max_queued: int = 4096  # buffer.max_queued_groups: the unbounded stream's bound

    def label(self) -> str:
        depth = "inf" if self.depth is None else str(self.depth)
        return f"engines={self.engines} ranks={self.trainer_ranks} depth={depth} batch={self.prompts_per_step}"

    @classmethod
    def of(cls, cfg: Config) -> "Shape":
        return cls(cfg.runtime.num_engines, cfg.trainer.ranks, cfg.buffer.depth,
                   cfg.buffer.max_lag if cfg.buffer.reject == "group" else None, cfg.rollout.prompts_per_step,
                   cfg.rollout.group_size, cfg.engine.max_concurrent_seqs, cfg.run.max_steps, cfg.run.eval_every,
                   cfg.buffer.max_queued_groups)


@dataclass(frozen=True)
class PlanParams:
    pass_s: float
    pass_row_s: float
    step_s: float
    step_token_s: float
    publish_s: float
    apply_s: float
    groups_lens: list[list[int]] = field(default_factory=list)
    len_median: float = 0.0
    len_sigma: float = 1.0
    len_max: int = 0
    admit_delay_s: float = 0.0
    admit_delays: list[float] = field(default_factory=list)
    deliver_delay_s: float = 0.0
    loop_s: float = 0.0
    pickup_passes: int = 0
    engine_slowdown: float = 0.0
    trainer_slowdown: float = 0.0
    drop_frac: float = 0.0
    eval_s: float = 0.0
    cores: float | None = None
    calibrated_on: Shape | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PlanParams":
        shape = d.get("calibrated_on")
        return cls(**{**d, "calibrated_on": Shape(**shape) if shape else None})

    @classmethod
    def load(cls, path: Path | str) -> "PlanParams":
        """From JSON (as `to_json` writes) or YAML with the same keys."""
        import yaml

        return cls.from_dict(yaml.safe_load(Path(path).read_text()))

    def with_lens(self, lens: list[list[int]]) -> "PlanParams":
        return replace(self, groups_lens=lens)


def _lstsq(rows: list[list[float]], y: list[float], w: list[float]) -> list[float]:
    import numpy as np

    a, b, sw = np.array(rows), np.array(y), np.sqrt(np.array(w))
    return [float(x) for x in np.linalg.lstsq(a * sw[:, None], b * sw, rcond=None)[0]]


def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """y = c0 + c1 x by least squares with c0, c1 >= 0 (a clipped term is refitted without it)."""
    c0, c1 = _lstsq([[1.0, x] for x in xs], ys, [1.0] * len(xs))
    if c1 < 0:
        return fmean(ys), 0.0
    if c0 < 0:
        return 0.0, sum(x * y for x, y in zip(xs, ys)) / max(sum(x * x for x in xs), 1e-12)
    return c0, c1


def _fit_with_slowdown(rows: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """Fit y = (c0 + c1 x)(1 + s o) over rows (x, o, y): least squares on [1, x, o, x o], then s is
    the overlap term relative to the base at the mean x. Falls back to s = 0 when o hardly varies
    (nothing to learn it from) or the fit is unphysical (negative terms)."""
    xs, os_, ys = zip(*rows)
    if max(os_) - min(os_) > 0.3 and len(rows) >= 8:
        c0, c1, k0, k1 = _lstsq([[1.0, x, o, x * o] for x, o, _ in rows], list(ys), [1.0] * len(rows))
        base, extra = c0 + c1 * fmean(xs), k0 + k1 * fmean(xs)
        if c0 >= 0 and c1 >= 0 and base > 0 and extra >= 0:
            return c0, c1, extra / base
    c0, c1 = _fit_line(list(xs), list(ys))
    return c0, c1, 0.0


def _fit_steps(steps: list[dict], overlaps: list[float]) -> tuple[float, float, float]:
    """Step time = (fixed + per token x tokens)(1 + slowdown x engines busy). Where the rank
    reports `update_s` (gradient clip and optimizer step: no growth with the batch) that is the
    fixed part, and the rest is fitted through the origin against tokens: one batch size alone
    cannot tell a fixed cost from a per-token one. The slowdown is fitted from how much of each
    step overlapped generation, when that varies enough to tell."""
    xs = [float(e["tokens"]) for e in steps]
    ys = [e["t1"] - e["t0"] for e in steps]
    if not all("update_s" in e for e in steps):
        c0, c1, slow = _fit_with_slowdown(list(zip(xs, overlaps, ys)))
        return c0, c1, slow
    fixed = fmean(e["update_s"] for e in steps)
    rest = [y - e["update_s"] for y, e in zip(ys, steps)]
    if max(overlaps) - min(overlaps) > 0.3 and len(steps) >= 8:
        c1, k = _lstsq([[x, x * o] for x, o in zip(xs, overlaps)], rest, [1.0] * len(xs))
        if c1 > 0 and k >= 0:
            return fixed, c1, k / c1
    per_token = sum(x * y for x, y in zip(xs, rest)) / max(sum(x * x for x in xs), 1e-12)
    return fixed, max(per_token, 0.0), 0.0


def calibrate(tl: Timeline, cfg: Config) -> PlanParams:
    """Fit the cost model to one run (its span log and its config)."""
    from nonstop.timeline import union_length

    trainers = [iv for a in tl.actors("trainer") for iv in tl.trainer_busy(a)]
    chunks = []
    for actor in tl.actors("engine"):
        for e in tl.events[actor]:
            if e["ev"] == "busy" and e["passes"] and e["t1"] > e["t0"]:
                overlap = union_length(trainers, e["t0"], e["t1"]) / (e["t1"] - e["t0"])
                # weighted by passes: the fit then reproduces the total time of all passes
                chunks += [(e["rows"] / e["passes"], overlap, (e["t1"] - e["t0"]) / e["passes"])] * e["passes"]
    if not chunks:
        raise ValueError(f"{tl.run_dir}: the span log holds no engine forward passes")
    pass_s, pass_row_s, engine_slowdown = _fit_with_slowdown(chunks)
    ranks = max(len(tl.actors("trainer")), 1)
    steps = [dict(e, tokens=e["tokens"] / ranks) for e in tl.events.get("trainer-0", []) if e["ev"] == "step"]
    if not steps:
        raise ValueError(f"{tl.run_dir}: the span log holds no trainer steps")
    engines = tl.actors("engine")
    overlaps = [sum(union_length(tl.engine_busy(a), e["t0"], e["t1"]) for a in engines)
                / max(len(engines) * (e["t1"] - e["t0"]), 1e-9) for e in steps]
    step_s, step_token_s, trainer_slowdown = _fit_steps(steps, overlaps)
    cores = None
    seen = [x for x in (engine_slowdown, trainer_slowdown) if x > 0]
    if seen and fmean(seen) > 0.05:  # the two sides slowed each other: they share processors
        cores = (len(engines) + ranks) / (1 + fmean(seen))
        engine_slowdown = trainer_slowdown = 0.0
    pubs = [e["t1"] - e["t0"] for e in tl.events.get("trainer-0", []) if e["ev"] == "publish"]
    applies = [e["t1"] - e["t0"] for a in tl.actors("engine") for e in tl.events[a] if e["ev"] == "apply"]
    orch = tl.events.get("orchestrator", [])
    evals = [e["t1"] - e["t0"] for e in orch if e["ev"] == "eval"]
    groups = tl.groups
    uniform = tl.drops.get("uniform_reward", 0)
    return PlanParams(
        pass_s=pass_s, pass_row_s=pass_row_s, step_s=step_s, step_token_s=step_token_s,
        publish_s=fmean(pubs) if pubs else 0.0, apply_s=fmean(applies) if applies else 0.0,
        groups_lens=[g.lens for g in groups],
        admit_delay_s=fmean(g.t_gen0 - g.t_admit for g in groups),
        admit_delays=[round(g.t_gen0 - g.t_admit, 6) for g in groups[:: max(1, len(groups) // 4000)]],
        deliver_delay_s=fmean(g.t_done - g.t_gen1 for g in groups),
        engine_slowdown=engine_slowdown, trainer_slowdown=trainer_slowdown,
        drop_frac=uniform / len(groups) if groups and cfg.rollout.filter_uniform_reward and cfg.rollout.refill else 0.0,
        loop_s=_loop_s(tl), pickup_passes=1, eval_s=fmean(evals) if evals else 0.0, cores=cores, calibrated_on=Shape.of(cfg),
    )


def _loop_s(tl: Timeline) -> float:
    """Mean over steps of the learning loop's cycle (one `wait` start to the next) less the
    rank's step and publish, the wait for a batch, and evaluations and checkpoints."""
    orch = tl.events.get("orchestrator", [])
    waits = {e["step"]: e for e in orch if e["ev"] == "wait"}
    extra: dict[int, float] = {}
    for e in orch:
        if e["ev"] in ("eval", "checkpoint"):
            extra[e["step"]] = extra.get(e["step"], 0.0) + e["t1"] - e["t0"]
    rank = [e for e in tl.events.get("trainer-0", []) if e["ev"] in ("step", "publish")]
    gaps = []
    for step, w in waits.items():
        nxt = waits.get(step + 1)
        if nxt is None:
            continue
        work = sum(e["t1"] - e["t0"] for e in rank if w["t1"] <= e["t0"] and e["t1"] <= nxt["t0"])
        gaps.append(nxt["t0"] - w["t0"] - (w["t1"] - w["t0"]) - work - extra.get(step, 0.0))
    return max(fmean(gaps), 0.0) if gaps else 0.0
