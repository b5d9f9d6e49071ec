"""The capacity planner's model against hand-computed cases, its invariants, and the worked example."""

from __future__ import annotations

import dataclasses
import heapq
from collections import Counter
from pathlib import Path

import pytest

from nonstop.config import ConfigError, load_config
from nonstop.observe.timeline import GroupLife, Timeline
from nonstop.planner.calibrate import (
    PAUSE_S,
    _fit_line,
    _fit_passes,
    _ordinary_mean,
    fit_orchestrator,
    pauses,
)
from nonstop.planner.cli import parse_axes
from nonstop.planner.model import Simulation, simulate
from nonstop.planner.params import PlanParams, Shape
from nonstop.planner.sharing import Sharing, effective_cores
from nonstop.planner.sweep import recommend, sweep
from support import ROOT
from support.timelines import two_step_timeline


def params(**kw) -> PlanParams:
    base = dict(
        pass_s=0.010,
        pass_row_s=0.0001,
        step_s=0.2,
        step_token_s=0.001,
        publish_s=0.05,
        apply_s=0.0,
        groups_lens=[[4, 4, 4, 4]],
    )
    return PlanParams(**{**base, **kw})


def test_synchronous_cycle_matches_the_hand_computed_one():
    """Depth 0, one engine, every completion 4 tokens, all 8 groups x 4 rows fit at once:
    a step is 4 passes of 32 rows, then the step on 128 tokens and the publish. The orchestrator
    is on the path: the 8 groups finish in one pass and are handled one after another (2 ms
    each), buffered together 5 ms after the last; sending the batch costs 0.1 ms per sample;
    the loop's 30 ms (result, publish call, records) come before the publish."""
    p = params(loop_s=0.03, orch_group_s=0.002, deliver_delay_s=0.005, call_sample_s=0.0001)
    shape = Shape(engines=1, depth=0, max_lag=None, prompts_per_step=8, group_size=4, slots=64, steps=10)
    gen = 4 * (0.010 + 0.0001 * 32)
    orchestrator = 8 * 0.002 + 0.005 + 32 * 0.0001 + 0.03
    train = 0.2 + 0.001 * 128
    pred = simulate(p, shape)
    assert pred.wall_s == pytest.approx(10 * (gen + orchestrator + train + 0.05), rel=1e-9)
    assert pred.samples_per_s == pytest.approx(10 * 32 / pred.wall_s, rel=1e-9)
    assert pred.trainer_idle == pytest.approx(1 - 10 * (train + 0.05) / pred.wall_s, rel=1e-9)
    assert pred.lag_hist == {0: 10 * 128}


def test_a_double_buffer_hides_generation_behind_training():
    """Depth 1 with generation shorter than training: after the first two batches (generated
    together, 64 rows) the trainer never waits."""
    shape = Shape(engines=1, depth=1, max_lag=None, prompts_per_step=8, group_size=4, slots=64, steps=20)
    pred = simulate(params(), shape)
    first = 4 * (0.010 + 0.0001 * 64)
    assert pred.wall_s == pytest.approx(first + 20 * (0.2 + 0.128 + 0.05), rel=1e-9)
    assert set(pred.lag_hist) == {0, 1}


@pytest.mark.parametrize("depth", [0, 1, 2, 4])
def test_depth_bounds_the_lag_when_groups_finish_in_admission_order(depth):
    p = params(groups_lens=[[3, 9, 30, 2]], step_s=0.01, step_token_s=0.0001)
    shape = Shape(engines=2, depth=depth, max_lag=None, prompts_per_step=4, group_size=4, slots=12, steps=30)
    pred = simulate(p, shape, seed=depth)
    assert max(pred.lag_hist) <= depth
    assert max(pred.lag_hist) == depth  # and the bound is reached


def test_stragglers_overtaken_by_later_groups_lag_more_than_the_depth():
    """Batches are formed in arrival order: a slow group admitted for one step is trained in a later
    one, so its tokens lag past the depth; buffer.max_lag is what bounds them."""
    p = params(groups_lens=[[1, 1, 1, 1], [1, 1, 1, 1], [2, 2, 2, 90]], step_s=0.01, step_token_s=0.0001)
    shape = Shape(engines=1, depth=1, max_lag=None, prompts_per_step=4, group_size=4, slots=64, steps=40)
    assert max(simulate(p, shape).lag_hist) > 1
    bounded = simulate(p, dataclasses.replace(shape, max_lag=1))
    assert max(bounded.lag_hist) <= 1 and bounded.dropped_for_lag > 0


def test_max_lag_drops_and_refunds_stale_groups():
    """An unbounded stream with a strict max_lag drops groups (refunded) but still trains every step."""
    p = params(groups_lens=[[2, 2, 2, 80]], step_s=0.01, step_token_s=0.0)
    shape = Shape(engines=1, depth=None, max_lag=0, prompts_per_step=2, group_size=4, slots=8, steps=15, max_queued=16)
    pred = simulate(p, shape)
    assert pred.dropped_for_lag > 0 and max(pred.lag_hist) == 0


def test_long_tail_is_a_few_events_not_one_per_token():
    """Macro steps: 32K-token completions simulate in well under a second."""
    p = params(groups_lens=[], len_median=3000, len_sigma=1.0, len_max=32768)
    pred = simulate(p, Shape(engines=4, depth=2, max_lag=None, prompts_per_step=8, group_size=8, slots=64, steps=5))
    assert pred.samples_per_s > 0


def test_shared_cores_slow_every_busy_actor():
    """Two engines and the trainer on one core: each runs at a third of its speed while all are busy."""
    shape = Shape(engines=2, depth=0, max_lag=None, prompts_per_step=2, group_size=4, slots=4, steps=5)
    alone = simulate(params(), shape)
    shared = simulate(params(cores=1.0), shape)
    # depth 0: the trainer never overlaps generation; the two engines share the core, so generation takes 2x
    gen = 4 * (0.010 + 0.0001 * 4)
    assert shared.wall_s - alone.wall_s == pytest.approx(5 * gen, rel=1e-6)
    assert simulate(params(cores=3.0), shape).wall_s == pytest.approx(alone.wall_s, rel=1e-12)


def test_a_pass_pays_for_the_keys_its_rows_read():
    """Depth 0, one group of 4 rows of 3 tokens after 2-token prompts: its 3 passes read 4 x 3, 4 x 4
    and 4 x 5 cached positions (one block), 16 a pass on average, at 1 ms per position."""
    p = params(groups_lens=[[3, 3, 3, 3]], pass_read_s=0.001, prompt_len=2.0)
    shape = Shape(engines=1, depth=0, max_lag=None, prompts_per_step=1, group_size=4, slots=64, steps=5)
    gen = 3 * (0.010 + 0.0001 * 4 + 0.001 * 16)
    assert simulate(p, shape).wall_s == pytest.approx(5 * (gen + 0.2 + 0.001 * 12 + 0.05), rel=1e-9)


def test_pass_fit_recovers_the_cost_of_reads():
    chunks = [{"passes": n, "rows": n * r, "reads": n * r * k} for n, r, k in [(5, 8, 40), (9, 16, 300), (3, 64, 90)]]
    chunks += [{"passes": 4, "rows": 4 * 32, "reads": 4 * 32 * 700}]
    per_pass = [
        (c["rows"] / c["passes"], 0.002 + 1e-4 * c["rows"] / c["passes"] + 3e-7 * c["reads"] / c["passes"])
        for c in chunks
    ]
    assert _fit_passes(chunks, per_pass) == pytest.approx((0.002, 1e-4, 3e-7))
    no_reads = [{k: v for k, v in c.items() if k != "reads"} for c in chunks]
    assert _fit_passes(no_reads, per_pass)[2] == 0.0


def test_refill_ahead_admits_replacements_for_the_drops_it_expects():
    """Half the groups carry no signal: without refill_ahead each replacement is generated only after
    the drop, and the trainer waits for it; admitting the expected drops ahead fills batches sooner."""
    p = params(groups_lens=[[6, 6, 6, 6]], drop_frac=0.5, step_s=0.02, step_token_s=0.0001)
    shape = Shape(engines=1, depth=1, max_lag=3, prompts_per_step=4, group_size=4, slots=64, steps=40)
    plain = simulate(p, shape)
    ahead = simulate(p, dataclasses.replace(shape, refill_ahead=True))
    assert ahead.samples_per_s > 1.2 * plain.samples_per_s
    assert ahead.trainer_idle < plain.trainer_idle
    assert max(ahead.lag_hist) > max(plain.lag_hist)  # a surplus group trains a step later


def test_forwards_run_ahead_while_the_batch_fills_shorten_the_step():
    """Groups of different lengths finish one by one, so the trainer, waiting for its batch, finds the
    queue dry between them: it runs their forwards then, and the step after is shorter by as much
    (depth 0, where the step is on the critical path)."""
    p = params(groups_lens=[[2, 2, 2, 2], [30, 30, 30, 30], [60, 60, 60, 60], [90, 90, 90, 90]], step_token_s=0.002)
    shape = Shape(engines=1, depth=0, max_lag=None, prompts_per_step=4, group_size=4, slots=64, steps=20)
    plain = simulate(p, shape)
    assert simulate(dataclasses.replace(p, ahead_frac=0.4), shape).wall_s == plain.wall_s  # forward_ahead off
    assert simulate(p, dataclasses.replace(shape, forward_ahead=True)).wall_s == plain.wall_s  # nothing to run ahead
    ahead = simulate(dataclasses.replace(p, ahead_frac=0.4), dataclasses.replace(shape, forward_ahead=True))
    assert ahead.wall_s < 0.95 * plain.wall_s
    assert ahead.trainer_idle < plain.trainer_idle


def test_fits_recover_known_lines():
    xs = [float(x) for x in range(8, 257, 8)]
    assert _fit_line(xs, [0.01 + 0.0002 * x for x in xs]) == pytest.approx((0.01, 0.0002))
    assert _fit_line(xs, [1.0 - 0.001 * x for x in xs])[1] == 0.0  # never a negative cost


def test_sweep_axes_set_fields_together_and_are_validated():
    assert parse_axes(("runtime.num_engines+trainer.ranks=2:1,1:2",)) == {
        "runtime.num_engines+trainer.ranks": ["2:1", "1:2"]
    }
    with pytest.raises(ConfigError, match="2 parts"):
        parse_axes(("runtime.num_engines+trainer.ranks=2",))
    rows = sweep(
        params(),
        load_config(overrides=["run.max_steps=5"]),
        {"runtime.num_engines+trainer.ranks": ["1:1", "2:2"], "buffer.depth": ["0", "1"]},
        seeds=1,
    )
    assert sorted((r.shape.engines, r.shape.trainer_ranks, r.shape.depth) for r in rows) == [
        (1, 1, 0),
        (1, 1, 1),
        (2, 2, 0),
        (2, 2, 1),
    ]
    with pytest.raises(ConfigError, match="buffer.depht"):
        sweep(params(), load_config(), {"buffer.depht": ["1"]})


def test_worked_example_of_planning_md():
    """docs/planning.md: at paper scale the synchronous pipeline idles the trainer most of each step;
    a deeper buffer and more engines per trainer GPU fix it."""
    p = PlanParams.load(ROOT / "examples" / "planner" / "costs_32b_h100.yaml")
    cfg = load_config(ROOT / "examples" / "planner_32b.yaml", ["run.max_steps=20"])
    sync = simulate(p, Shape.of(cfg))
    assert sync.trainer_idle > 0.8 and sync.lag_hist.keys() == {0}
    rows = sweep(
        p,
        cfg,
        {"buffer.depth": ["0", "4"], "buffer.max_lag": ["8"], "runtime.num_engines+trainer.ranks": ["8:32", "12:16"]},
        seeds=1,
    )
    best = recommend(rows)
    assert best is not None and best.shape.depth == 4 and best.shape.engines == 12
    assert best.samples_per_s > 3 * sync.samples_per_s and best.trainer_idle < sync.trainer_idle - 0.3
    assert recommend(rows, max_mean_lag=0.0) is not None and recommend(rows, max_mean_lag=0.0).shape.depth == 0


def test_stated_costs_round_trip_through_json(tmp_path):
    p = dataclasses.replace(params(), calibrated_on=Shape(engines=2))
    (tmp_path / "c.json").write_text(p.to_json())
    assert PlanParams.load(tmp_path / "c.json") == p


def test_a_pause_of_the_orchestrator_holds_every_group_behind_it():
    """One pause per 8 groups handled: with 8 groups a step, every synchronous cycle takes one."""
    p = params(orch_group_s=0.002, pause_every=8.0, pause_s=0.1)
    shape = Shape(engines=1, depth=0, max_lag=None, prompts_per_step=8, group_size=4, slots=64, steps=10)
    base = simulate(params(orch_group_s=0.002), shape)
    for seed in range(3):  # the first pause's phase is random; the count per cycle is not
        assert simulate(p, shape, seed).wall_s - base.wall_s == pytest.approx(10 * 0.1, rel=1e-9)


def test_an_idle_engine_reads_its_calls_before_its_first_pass():
    """Admission sends a batch's groups one call at a time: an engine that started its first pass
    with the first call would take the other three two passes later (they arrive while it is
    busy); waking 5 ms after the first call it takes all four in one pass, so generation is the
    2 ms admission delay, the wake, then 4 passes of 16 rows."""
    shape = Shape(engines=1, depth=0, max_lag=None, prompts_per_step=4, group_size=4, slots=64, steps=5)
    gen = 0.002 + 0.005 + 4 * (0.010 + 0.0001 * 16)
    woken = simulate(params(admit_delays=[0.002], wake_s=0.005, pickup_passes=1), shape)
    assert woken.wall_s == pytest.approx(5 * (gen + 0.2 + 0.001 * 64 + 0.05), rel=1e-9)
    eager = simulate(params(admit_delays=[0.002], pickup_passes=1), shape)
    assert eager.wall_s > woken.wall_s  # 6 passes, the first with one group alone


def test_a_step_sharing_its_core_with_the_orchestrator_runs_at_half_speed():
    """One core: a 100 ms step whose first 40 ms share it with 40 ms of orchestrator work gets
    20 ms done in them, so it ends at 120 ms."""
    sim = Simulation(params(step_s=0.1, step_token_s=0.0, cores=1.0), Shape(prompts_per_step=1, steps=1), seed=0)
    sim.on_step_start(None)
    sim.orchestrate(0.04)
    end = None
    while sim.events:
        sim.t, _, kind, arg = heapq.heappop(sim.events)
        if kind == "step_end" and arg == sim.step_gen:
            end = sim.t
            break
        getattr(sim, f"on_{kind}")(arg)
    assert end == pytest.approx(0.12, rel=1e-9)


def test_sharing_gives_the_work_done_under_processor_sharing():
    """Actor A busy 0..2 s, B busy 1..3 s on one core: A got 1 s alone and 1 s at half speed."""
    sh = Sharing([[(0.0, 2.0)], [(1.0, 3.0)]], cores=1.0)
    assert sh.work(0.0, 2.0) == pytest.approx(1.5)
    assert sh.work(2.0, 3.0) == pytest.approx(1.0)
    assert Sharing([[(0.0, 2.0)], [(1.0, 3.0)]], cores=2.0).work(0.0, 2.0) == pytest.approx(2.0)
    assert Sharing([[(0.0, 2.0)], [(1.0, 3.0)]], cores=None).work(0.5, 1.5) == pytest.approx(1.0)


def test_effective_cores_explain_the_processor_time_the_steps_got():
    """Steps that overlapped a second busy actor half of the time and got 75% of their wall time
    as processor time ran on one effective core; full processor time means nothing to share."""
    busy = [[(0.0, 1.0), (2.0, 3.0)], [(0.5, 1.0), (2.5, 3.0)]]
    steps = [(0.0, 1.0, 0.75), (2.0, 3.0, 0.75)]
    assert effective_cores(busy, steps, host=2.0) == pytest.approx(1.0, rel=1e-3)
    assert effective_cores(busy, [(0.0, 1.0, 1.0)], host=2.0) is None


def test_loop_costs_are_means_apart_from_pauses():
    """The learning loop's work per step is skewed (most steps short, some longer): its mean, not
    its median, is what the steps cost in all; a pause (counted apart, as pauses) is left out."""
    loops = [0.010, 0.010, 0.010, 0.030, PAUSE_S * 5]
    assert _ordinary_mean(loops) == pytest.approx(0.015)
    assert _ordinary_mean([PAUSE_S * 2, PAUSE_S * 3]) == pytest.approx(PAUSE_S * 2.5)  # only pauses: their median


def _group(i: int, t_gen1: float, t_done: float) -> GroupLife:
    return GroupLife((0, i), t_gen1 - 0.05, t_gen1 - 0.04, t_gen1, t_done, [4] * 4, (0, 0))


def test_orchestrator_fit_recovers_its_handling_time_and_handoff():
    """Bursts of groups returned together, handled 1.5 ms each, buffered together 4 ms after the
    burst's last: the fit finds both."""
    groups, i = [], 0
    for burst, n in enumerate([8, 3, 12, 5, 1, 9]):
        t = burst * 0.2
        for k in range(n):
            groups.append(_group(i, t + 0.0001 * k, t + n * 0.0015 + 0.004))
            i += 1
    s, lat, busy = fit_orchestrator(groups)
    assert s == pytest.approx(0.0015, abs=3e-5) and lat == pytest.approx(0.004, abs=1e-4)
    assert len(busy) == len(groups)


def test_pauses_are_silences_while_the_orchestrator_owes_work():
    """A group returned at 1.0 s and buffered at 1.3 s with nothing else logged between: one
    pause of 0.3 s; the idle time before it, when nothing was owed, is none."""
    groups = [_group(0, 0.5, 0.502), _group(1, 1.0, 1.3)]
    orch = [
        dict(
            ev="group",
            id=[0, g.id[1]],
            t_admit=g.t_admit,
            t_gen0=g.t_gen0,
            t_gen1=g.t_gen1,
            t_done=g.t_done,
            lens=g.lens,
            v=[0, 0],
        )
        for g in groups
    ]
    tl = Timeline(Path("."), {}, {"orchestrator": orch}, groups, Counter(), {})
    assert pauses(tl) == [pytest.approx((1.0, 1.3))]


def test_steps_at_full_speed_still_share_the_hosts_processors():
    """A calibration run whose steps got all their wall time as processor time (a quiet machine,
    the engine idle while the trainer steps) shows no contention, but its actors are still CPU
    processes on a 2-processor host: the planner keeps the host's 2 processors (so a third busy
    actor slows the others), never 'no sharing', which would make more engines free."""
    from nonstop.planner.calibrate import calibrate

    tl = two_step_timeline(engine_cpu_s=0.016)
    cfg = load_config(overrides=["rollout.prompts_per_step=4"])
    p = calibrate(tl, cfg)
    assert p.cores == 2.0
    assert p.step_s == pytest.approx(0.01) and p.pass_s + 8 * p.pass_row_s == pytest.approx(0.016 / 3)


def test_sending_an_admissions_calls_keeps_the_orchestrator_busy():
    """An admission of 8 groups at 2 ms each holds the event loop for 16 ms: a batch call made
    then waits behind it (first come first served), while the groups leave on their measured
    admission delays as before; on a shared processor the sending slows the busy engine."""
    shape = Shape(engines=1, depth=0, max_lag=None, prompts_per_step=8, group_size=4, slots=64, steps=2)
    sim = Simulation(params(send_s=0.002, admit_delays=[0.001]), shape, seed=0)
    sim.admit()
    assert sim.orch_free == pytest.approx(0.016)
    assert sorted(t for t, _, kind, _ in sim.events if kind == "dispatch") == [pytest.approx(0.001)] * 8
    assert sim.orchestrate(0.003) == pytest.approx(0.019)
    quiet = Simulation(params(admit_delays=[0.001]), shape, seed=0)
    quiet.admit()
    assert quiet.orch_free == 0.0
    # on one shared core the engine decodes at half speed while the calls are sent
    assert simulate(params(send_s=0.002, cores=1.0), shape).wall_s > simulate(params(cores=1.0), shape).wall_s
