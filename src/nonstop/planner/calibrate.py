"""Calibration: the planner's costs (nonstop.planner.params) fitted to one run's span log.

`calibrate(timeline, cfg)` reads the span log through nonstop.observe.timeline. The orchestrator's
per-group time and handoff by a robust fit of its first-come-first-served handling to the
groups' return and buffering times (`fit_orchestrator`), its pauses as the silences of its log
while it owed work (`pauses`), the learning loop's costs as means over steps (`loop_costs`).
Those give the orchestrator's busy intervals; with the engines' chunks and the rank's steps they
give how many actors were busy at each instant, so every chunk and step is deflated to the time
it would have taken alone (`Sharing.work`) before tau by least squares over the chunks (a
chunk's mean pass time against its mean rows: a linear model's mean is the model at the mean)
and the step time from `update_s` and tokens.

Processor time recorded with the engines' chunks and the trainer's steps (`cpu_s`) is what each
took with a processor to itself; without it (older span logs) the wall times are deflated by the
sharing the actors' busy intervals imply on the host's processors. Costs that the span log
cannot show (a stated accelerator, another batch size) come from `--params` instead.
"""

from __future__ import annotations

import bisect
import math
from statistics import fmean, median
from typing import TYPE_CHECKING

import numpy as np

from nonstop.observe.timeline import union_length
from nonstop.planner.params import PlanParams, Shape
from nonstop.planner.sharing import Interval, Sharing, effective_cores, host_cores, union

if TYPE_CHECKING:
    from nonstop.config import Config
    from nonstop.observe.timeline import GroupLife, Timeline


def _lstsq(rows: list[list[float]], y: list[float], w: list[float]) -> list[float]:
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


def _fit_passes(chunks: list[dict], per_pass: list[tuple[float, float]]) -> tuple[float, float, float]:
    """A pass's cost = fixed + per row x rows + per read x cached positions its attention read
    (where the engine reports `reads`; else 0), weighted by passes: the fit then reproduces the
    total time of all passes. A negative term is dropped and the rest refitted."""
    w = [float(e["passes"]) for e in chunks]
    ys = [y for _, y in per_pass]
    if all("reads" in e for e in chunks):
        reads = [e["reads"] / e["passes"] for e in chunks]
        c0, c1, c2 = _lstsq([[1.0, x, r] for (x, _), r in zip(per_pass, reads)], ys, w)
        if min(c0, c1, c2) >= 0:
            return c0, c1, c2
    weighted = [xy for e, xy in zip(chunks, per_pass) for _ in range(e["passes"])]
    return (*_fit_line(*map(list, zip(*weighted))), 0.0)


def _median(xs: list[float]) -> float:
    return median(xs) if xs else 0.0


def fit_orchestrator(groups: list[GroupLife]) -> tuple[float, float, list[Interval]]:
    """The orchestrator handles finished groups one at a time on its one thread, first come first
    served, `s` each (receive, decode, hand to scoring): group i, returned by its engine at a_i,
    is handled by c_i = max(a_i, c_{i-1}) + s. Groups handled in one busy stretch come out
    together, `l` after the stretch ends (their scores come back from the scoring threads while
    the loop is still at the later ones' first halves; the event loop then finishes them in
    order). Fits s and l to the groups' `t_gen1` (a_i) and `t_done`, robustly (least median
    deviation: a pause that delays many groups at once is counted apart, see `pauses`).
    Returns s, l and the busy intervals [c_i - s, c_i]."""
    gs = sorted(groups, key=lambda g: g.t_gen1)
    if len(gs) < 2:
        return 0.0, fmean(g.t_done - g.t_gen1 for g in gs) if gs else 0.0, []
    a = np.array([g.t_gen1 for g in gs])
    done = np.array([g.t_done for g in gs])
    best = (math.inf, 0.0, 0.0)
    lo, hi = 0.0, max(float(done.max() - a.min()) / len(gs), 1e-6)
    for _ in range(2):  # a grid over s, then a finer one around the best
        for s in np.linspace(lo, hi, 201):
            r = done - stretch_ends(a, float(s))[1]
            l_ = float(np.median(r))
            loss = float(np.median(np.abs(r - l_)))
            if loss < best[0] - 1e-12:
                best = (loss, float(s), max(l_, 0.0))
        step = (hi - lo) / 200
        lo, hi = max(best[1] - step, 0.0), best[1] + step
    _, s_fit, l_fit = best
    c = stretch_ends(a, s_fit)[0]
    return s_fit, l_fit, [(float(x) - s_fit, float(x)) for x in c]


def stretch_ends(a, s: float):
    """For arrivals `a` (sorted) served s each, first come first served: each one's completion
    and the end of the busy stretch it belongs to."""
    idx = np.arange(len(a))
    c = (idx + 1) * s + np.maximum.accumulate(a - idx * s)  # c_i = max(a_i, c_{i-1}) + s, in closed form
    starts = np.r_[True, a[1:] > c[:-1]]
    stretch = np.cumsum(starts) - 1
    last = np.r_[np.flatnonzero(starts)[1:] - 1, len(a) - 1]
    return c, c[last][stretch]


PAUSE_S = 0.05
"""A pause of the orchestrator: no event of its own for this long while it owes work (a group
returned and not yet buffered, a finished step or publish not yet taken up); its ordinary work
between two events is a few milliseconds. Garbage collection of the orchestrator's many objects
is the usual cause: it comes with the objects made, so the planner counts pauses per group."""


def pauses(tl: Timeline) -> list[Interval]:
    """The orchestrator's pauses in a run (see PAUSE_S)."""
    orch = tl.events.get("orchestrator", [])
    points = sorted(t for e in orch for t in _times(e))
    owed = [(g.t_gen1, g.t_done) for g in tl.groups]
    trains = {e["step"]: e for e in orch if e["ev"] == "train"}
    publishes = {e["step"]: e for e in orch if e["ev"] == "publish"}
    for e in tl.events.get("trainer-0", []):
        if e["ev"] in ("step", "publish"):  # done at the rank, not yet taken up by the loop
            took = (trains if e["ev"] == "step" else publishes).get(e["version"])
            if took is not None:
                owed.append((e["t1"], took["t1"]))
    owed = union(owed)
    return [(a, b) for a, b in zip(points, points[1:]) if b - a > PAUSE_S and union_length(owed, a, b) >= b - a - 1e-6]


def _times(e: dict) -> list[float]:
    if e["ev"] == "group":
        return [e["t_admit"], e["t_gen0"], e["t_gen1"], e["t_done"]]
    return [e[k] for k in ("t", "t0", "t1") if k in e]


def loop_costs(tl: Timeline) -> tuple[float, float, list[Interval]]:
    """The learning loop's own work per step, means over steps (pauses apart): `call_s` from calling the step
    to the rank starting it (the batch sent), `loop_s` after the rank's step (taking its result,
    calling the publish, the step's records) besides the rank's publish. Returns them and the
    intervals the loop was at work."""
    orch = tl.events.get("orchestrator", [])
    trains = {e["step"]: e for e in orch if e["ev"] == "train"}
    waits = {e["step"]: e for e in orch if e["ev"] == "wait"}
    rank = tl.events.get("trainer-0", [])
    steps = {e["version"]: e for e in rank if e["ev"] == "step"}
    pubs = {e["version"]: e for e in rank if e["ev"] == "publish"}
    extra: dict[int, float] = {}
    for e in orch:
        if e["ev"] in ("eval", "checkpoint"):
            extra[e["step"]] = extra.get(e["step"], 0.0) + e["t1"] - e["t0"]
    calls, loops, busy = [], [], []
    for step, tr in trains.items():
        st, pub, nxt = steps.get(step), pubs.get(step), waits.get(step + 1)
        if st is None or pub is None:
            continue
        calls.append(st["t0"] - tr["t0"])
        busy += [(tr["t0"], st["t0"]), (st["t1"], pub["t0"])]
        if nxt is not None:
            loops.append(nxt["t0"] - st["t1"] - (pub["t1"] - pub["t0"]) - extra.get(step, 0.0))
            busy.append((pub["t1"], nxt["t0"]))
    return max(_ordinary_mean(calls), 0.0), max(_ordinary_mean(loops), 0.0), busy


def _ordinary_mean(xs: list[float]) -> float:
    """The mean of the values shorter than a pause (PAUSE_S): the pauses are counted apart, and
    a median would lose the skew of the rest (the loop's work varies with the step's records)."""
    kept = [x for x in xs if x < PAUSE_S]
    return fmean(kept) if kept else _median(xs)


def engine_wake(tl: Timeline) -> tuple[float, float]:
    """How long an idle engine takes from the first call of an admission to its first pass: its
    actor reads every call waiting in its pipe and submits it first, so the admission's groups
    join that pass together, and a larger admission takes longer (32 calls: 3-6 ms, one call
    about 1 ms on this machine). Least squares over admissions that found an engine idle,
    against the calls each engine got (the admission's groups over the engines); wakes longer
    than a pause (PAUSE_S) are left out. Returns the fixed part and the part per call."""
    chunks = {a: sorted((e["t0"], e["t1"]) for e in tl.events[a] if e["ev"] == "busy") for a in tl.actors("engine")}
    first: dict[float, float] = {}
    calls: dict[float, int] = {}
    for g in tl.groups:
        first[g.t_admit] = min(first.get(g.t_admit, math.inf), g.t_gen0)
        calls[g.t_admit] = calls.get(g.t_admit, 0) + 1
    xs, wakes = [], []
    for t_admit, t in first.items():
        nxt = []
        for ivs in chunks.values():
            i = bisect.bisect_right(ivs, (t, math.inf))
            if (i == 0 or ivs[i - 1][1] <= t) and i < len(ivs):  # idle at t, busy later
                nxt.append(ivs[i][0] - t)
        if nxt and min(nxt) < PAUSE_S:
            xs.append(max(calls[t_admit] / max(len(chunks), 1), 1.0))
            wakes.append(min(nxt))
    if len(set(xs)) < 2:
        return max(_median(wakes), 0.0), 0.0
    w0, w1 = _fit_line(xs, wakes)
    return w0, w1


def calibrate(tl: Timeline, cfg: Config) -> PlanParams:
    """Fit the cost model to one run (its span log and its config)."""
    ranks = max(len(tl.actors("trainer")), 1)
    steps, aheads = with_aheads(tl.events.get("trainer-0", []), ranks)
    if not steps:
        raise ValueError(f"{tl.run_dir}: the span log holds no trainer steps")
    groups = tl.groups
    orch_group_s, deliver_delay_s, handling = fit_orchestrator(groups)
    paused = pauses(tl)
    call_s, loop_s, loop_busy = loop_costs(tl)
    cores = host_cores(tl, cfg)
    busy = (
        [tl.engine_busy(a) for a in tl.actors("engine")]
        + [tl.trainer_busy(a) for a in tl.actors("trainer")]
        + [handling + loop_busy + paused]
    )
    chunk_events = [
        e for a in tl.actors("engine") for e in tl.events[a] if e["ev"] == "busy" and e["passes"] and e["t1"] > e["t0"]
    ]
    if not chunk_events:
        raise ValueError(f"{tl.run_dir}: the span log holds no engine forward passes")
    if cores is not None and all("cpu_s" in e for e in chunk_events + steps):
        # processor time says what each took alone; the steps' and the chunks' wall time how shared they
        # were (both: the sharing slows every busy actor, and the engine's chunks hold most of the evidence)
        fitted = effective_cores(
            busy,
            [(e["t0"], e["t1"], e["cpu_s"]) for e in steps + chunk_events + [a for part in aheads for a in part]],
            cores,
        )
        cores = cores if fitted is None else fitted  # at full speed: the host's, still shared
        per_pass = [(e["rows"] / e["passes"], e["cpu_s"] / e["passes"]) for e in chunk_events]
        work = [e["cpu_s"] + sum(a["cpu_s"] for a in part) for e, part in zip(steps, aheads)]
    else:
        sharing = Sharing(busy, cores)
        per_pass = [(e["rows"] / e["passes"], sharing.work(e["t0"], e["t1"]) / e["passes"]) for e in chunk_events]
        work = [
            sharing.work(e["t0"], e["t1"]) + sum(sharing.work(a["t0"], a["t1"]) for a in part)
            for e, part in zip(steps, aheads)
        ]
    send_s = _send_cost(tl, handling + loop_busy + paused, busy, cores)
    pass_s, pass_row_s, pass_read_s = _fit_passes(chunk_events, per_pass)
    # a step's forward run ahead (trainer.forward_ahead) is its work too: its time joins the step's
    step_s, step_token_s = _fit_steps(
        [dict(e, t0=e["t0"] - sum(a["t1"] - a["t0"] for a in part)) for e, part in zip(steps, aheads)], work
    )
    ahead_frac = _ahead_frac(steps, aheads, step_token_s, cfg.rollout.prompts_per_step)
    pubs = [e["t1"] - e["t0"] for e in tl.events.get("trainer-0", []) if e["ev"] == "publish"]
    applies = [e["t1"] - e["t0"] for a in tl.actors("engine") for e in tl.events[a] if e["ev"] == "apply"]
    evals = [e["t1"] - e["t0"] for e in tl.events.get("orchestrator", []) if e["ev"] == "eval"]
    uniform = tl.drops.get("uniform_reward", 0)
    firsts, gap_s = admissions(groups)
    wake_s, wake_call_s = engine_wake(tl)
    return PlanParams(
        pass_s=pass_s,
        pass_row_s=pass_row_s,
        pass_read_s=pass_read_s,
        ahead_frac=ahead_frac,
        prompt_len=sum(e.get("prefill_tokens", 0) for e in chunk_events) / max(len(groups), 1),
        step_s=step_s,
        step_token_s=step_token_s,
        publish_s=fmean(pubs) if pubs else 0.0,
        apply_s=fmean(applies) if applies else 0.0,
        groups_lens=[g.lens for g in groups],
        admit_delay_s=fmean(firsts) if firsts else 0.0,
        admit_delays=[round(x, 6) for x in firsts[:: max(1, len(firsts) // 4000)]],
        admit_gap_s=gap_s,
        deliver_delay_s=deliver_delay_s,
        orch_group_s=orch_group_s,
        pause_s=fmean(b - a for a, b in paused) if paused else 0.0,
        pause_every=len(groups) / len(paused) if paused else 0.0,
        call_sample_s=call_s / (cfg.rollout.prompts_per_step * cfg.rollout.group_size),
        loop_s=loop_s,
        drop_frac=uniform / len(groups) if groups and cfg.rollout.filter_uniform_reward and cfg.rollout.refill else 0.0,
        # the engine actor's loop order (engine/aio.py, runtime/local.py): a call that arrives mid-pass
        # is read after the next pass and submitted after the one after; an answer leaves after the next
        pickup_passes=2,
        return_passes=1,
        send_s=send_s,
        wake_s=wake_s,
        wake_call_s=wake_call_s,
        eval_s=fmean(evals) if evals else 0.0,
        cores=cores,
        calibrated_on=Shape.of(cfg),
    )


def admissions(groups: list[GroupLife]) -> tuple[list[float], float]:
    """Each admission's delay to its first engine call, and the mean gap between its later calls
    (the producer sends one admission's calls one after another, in one turn of its loop)."""
    by: dict[float, list[float]] = {}
    for g in groups:
        by.setdefault(g.t_admit, []).append(g.t_gen0 - g.t_admit)
    gaps = [(max(d) - min(d)) / (len(d) - 1) for d in by.values() if len(d) > 1]
    return [min(d) for d in by.values()], fmean(gaps) if gaps else 0.0


def _send_cost(tl: Timeline, orch_busy: list[Interval], busy: list[list[Interval]], cores: float | None) -> float:
    """The orchestrator's processor time that its modelled work (handling groups, the learning
    loop, pauses) does not account for, per admitted group: sending the engine calls, mostly.
    From the processor time the learning loop's `wait` spans record, over the span from the
    first to the last; in the time the modelled work took (its wall time per unit of work in
    the calibration run). 0 for span logs without it."""
    waits = [e for e in tl.events.get("orchestrator", []) if e["ev"] == "wait" and "cpu" in e]
    if len(waits) < 2:
        return 0.0
    lo, hi = waits[0]["t0"], waits[-1]["t0"]
    cpu = waits[-1]["cpu"] - waits[0]["cpu"]
    ivs = [(max(a, lo), min(b, hi)) for a, b in union(orch_busy) if b > lo and a < hi]
    wall = union_length(ivs)
    sharing = Sharing(busy, cores)
    work = sum(sharing.work(a, b) for a, b in ivs)
    groups = sum(1 for g in tl.groups if lo <= g.t_admit < hi)
    if groups == 0 or cpu <= work:
        return 0.0
    return (cpu - work) / groups * (wall / work if work > 0 else 1.0)


def with_aheads(rank_events: list[dict], ranks: int) -> tuple[list[dict], list[list[dict]]]:
    """A rank's steps (tokens per rank) and, for each, the forwards it ran ahead of it (the
    `ahead` spans since the previous step): the planner models a step as one piece of work."""
    steps: list[dict] = []
    aheads: list[list[dict]] = []
    pending: list[dict] = []
    for e in rank_events:
        if e["ev"] == "ahead" and "cpu_s" in e:
            pending.append(e)
        elif e["ev"] == "step":
            steps.append(dict(e, tokens=e["tokens"] / ranks))
            aheads.append(pending)
            pending = []
    return steps, aheads


def _ahead_frac(steps: list[dict], aheads: list[list[dict]], step_token_s: float, groups_per_step: int) -> float:
    """The forwards run ahead, as a share of the per-token step cost of their tokens (each ahead
    group counted at its step's mean tokens per group): 0 where none ran."""
    tokens = sum(sum(a["groups"] for a in part) * e["tokens"] / groups_per_step for e, part in zip(steps, aheads))
    cost = sum(a.get("cpu_s", a["t1"] - a["t0"]) for part in aheads for a in part)
    return min(1.0, cost / (step_token_s * tokens)) if tokens > 0 and step_token_s > 0 else 0.0


def _fit_steps(steps: list[dict], work: list[float]) -> tuple[float, float]:
    """Step time = fixed + per token x tokens, from each step's uncontended time (`work`). Where
    the rank reports `update_s` (gradient clip and optimizer step: no growth with the batch) that
    is the fixed part, and the rest is fitted through the origin against tokens: one batch size
    alone cannot tell a fixed cost from a per-token one."""
    xs = [float(e["tokens"]) for e in steps]
    if not all("update_s" in e for e in steps):
        return _fit_line(xs, work)
    fixed = fmean(e["update_s"] * w / max(e["t1"] - e["t0"], 1e-12) for e, w in zip(steps, work))
    per_token = sum(x * (w - fixed) for x, w in zip(xs, work)) / max(sum(x * x for x in xs), 1e-12)
    return fixed, max(per_token, 0.0)
