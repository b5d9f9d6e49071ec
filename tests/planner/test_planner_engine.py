"""The planner's engine loop and admission, against hand-computed cases and synthetic span logs.

nonstop's engine actor runs one event loop: a decode task that runs a forward pass and yields,
a reader that takes the orchestrator's calls, and a task per call that submits it and sends its
answer. The loop's order sets when a call joins the batch and when its answer leaves; the
producer's order sets how an admission's calls reach the engine. These tests pin the model to
those orders (docs/planning.md, "Engine forward pass" and "Buffer and producer").
"""

from __future__ import annotations

import heapq
from collections import Counter
from pathlib import Path

import pytest

from nonstop.observe.timeline import GroupLife, Timeline
from nonstop.planner.calibrate import admissions, engine_wake
from nonstop.planner.model import SimGroup, Simulation
from nonstop.planner.params import PlanParams, Shape
from support.timelines import two_step_timeline

TAU = 0.010  # every pass 10 ms: no per-row cost, no sharing


def params(**kw) -> PlanParams:
    base = dict(
        pass_s=TAU,
        pass_row_s=0.0,
        step_s=0.2,
        step_token_s=0.0,
        publish_s=0.0,
        apply_s=0.0,
        groups_lens=[[2, 2, 2, 2]],
        pickup_passes=2,
        return_passes=1,
    )
    return PlanParams(**{**base, **kw})


SHAPE = Shape(engines=1, depth=0, max_lag=None, prompts_per_step=8, group_size=4, slots=64, steps=1)


def answered(sim: Simulation, until: float) -> list[float]:
    """Play the events up to `until`; the times the groups' answers reached the orchestrator."""
    while sim.events and sim.events[0][0] <= until:
        sim.t, _, kind, arg = heapq.heappop(sim.events)
        getattr(sim, f"on_{kind}")(arg)
    return [t for t, _ in sim.samples_done]


def test_a_call_to_a_busy_engine_joins_three_boundaries_later_and_is_answered_a_pass_late():
    """A long group decodes from 0 s; a 2-token group's call arrives at 15 ms, in the second pass.
    The loop runs the third pass before its reader runs, the fourth before the call's task submits
    it: it joins the pass that starts at 40 ms, its last token is out at 60 ms, and the loop runs
    the pass after that before the call's task sends the answer: 70 ms. An engine with nothing
    more to decode answers at once."""
    sim = Simulation(params(), SHAPE, seed=0)
    sim.on_dispatch(SimGroup([20, 20, 20, 20]))
    sim.at(0.015, "dispatch", SimGroup([2, 2, 2, 2]))
    assert answered(sim, 0.1) == [pytest.approx(0.070)]
    assert answered(sim, 0.3) == [
        pytest.approx(0.070),
        pytest.approx(0.200),
    ]  # the long one: the engine is idle after it
    older = Simulation(params(pickup_passes=1, return_passes=0), SHAPE, seed=0)  # the loop as first modelled
    older.on_dispatch(SimGroup([20, 20, 20, 20]))
    older.at(0.015, "dispatch", SimGroup([2, 2, 2, 2]))
    assert answered(older, 0.1) == [pytest.approx(0.050)]


def test_an_admissions_calls_leave_together():
    """The producer sends one admission's calls one after another in one turn of its loop: they
    leave its first call's delay (resampled per admission) plus 0.1 ms per call before them,
    never spread over the delays of unrelated admissions."""
    shape = Shape(engines=1, depth=0, max_lag=None, prompts_per_step=8, group_size=4, slots=64, steps=1)
    for seed in range(5):
        sim = Simulation(params(admit_delays=[0.001, 0.009], admit_gap_s=0.0001), shape, seed=seed)
        sim.admit()
        sent = sorted(t for t, _, kind, _ in sim.events if kind == "dispatch")
        assert sent[0] in (pytest.approx(0.001), pytest.approx(0.009))
        assert sent == [pytest.approx(sent[0] + 0.0001 * j) for j in range(8)]


def test_an_idle_engine_wakes_later_for_each_call_it_reads_first():
    """Idle, the engine's loop reads and submits every call waiting for it before its first pass:
    1 ms, and 0.25 ms per call: four calls 0.1 ms apart start the first pass at 2 ms, all four
    in it (2 passes of 2 tokens, answered at once at 22 ms: nothing else to decode)."""
    sim = Simulation(params(wake_s=0.001, wake_call_s=0.00025), SHAPE, seed=0)
    for j in range(4):
        sim.at(0.0001 * j, "dispatch", SimGroup([2, 2, 2, 2]))
    assert answered(sim, 0.1) == [pytest.approx(0.022)] * 4


def _life(i: int, t_admit: float, gen0: float) -> GroupLife:
    return GroupLife((0, i), t_admit, t_admit + gen0, t_admit + gen0 + 0.03, t_admit + gen0 + 0.031, [2] * 4, (0, 0))


def test_admissions_give_each_ones_first_delay_and_the_gap_between_its_calls():
    groups = [_life(i, 1.0, 0.002 + 0.0001 * i) for i in range(8)] + [
        _life(8 + i, 2.0, 0.0005 + 0.0001 * i) for i in range(3)
    ]
    firsts, gap = admissions(groups)
    assert sorted(firsts) == [pytest.approx(0.0005), pytest.approx(0.002)]
    assert gap == pytest.approx(0.0001)


def test_engine_wake_is_fitted_per_call_read():
    """Admissions of 1, 4 and 16 calls reach an idle engine; its first pass starts 1 ms + 0.2 ms
    per call after the first call: the fit finds both parts."""
    groups, chunks, i = [], [], 0
    for k, (t, n) in enumerate([(0.0, 1), (0.5, 4), (1.0, 16), (1.5, 4), (2.0, 1)]):
        for j in range(n):
            groups.append(_life(i, t, 0.0003))
            i += 1
        start = t + 0.0003 + 0.001 + 0.0002 * n
        chunks.append(dict(ev="busy", t0=start, t1=start + 0.02, passes=2, rows=8 * n, busy_s=0.02, cpu_s=0.02))
    events = {"orchestrator": [], "engine-0": chunks}
    lanes = {"engine-0": {"busy": [(c["t0"], c["t1"]) for c in chunks]}, "orchestrator": {}}
    tl = Timeline(Path("."), lanes, events, groups, Counter(), {})
    wake_s, per_call = engine_wake(tl)
    assert wake_s == pytest.approx(0.001, abs=1e-6) and per_call == pytest.approx(0.0002, abs=1e-7)


def test_effective_cores_explain_the_engines_passes_too():
    """The sharing slows every busy actor, so the processors a run had are fitted to the engine's
    chunks as well as the trainer's steps. Here the steps ran at full speed, alone, while the
    engine's chunks, alone too, got 75% of their wall time: the run had fewer processors than
    the host's 2 (someone else took a share); the fit pools both: (0.75 x 0.128 s + 0.2 s) over
    0.328 s of wall time = 0.902. Fitted on the steps alone it would be the host's 2."""
    from nonstop.config import load_config
    from nonstop.planner.calibrate import calibrate

    tl = two_step_timeline(engine_cpu_s=0.012)
    p = calibrate(tl, load_config(overrides=["rollout.prompts_per_step=4"]))
    assert p.cores == pytest.approx((0.75 * 0.128 + 0.2) / 0.328, rel=1e-2)
