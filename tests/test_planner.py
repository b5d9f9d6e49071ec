"""The capacity planner's model against hand-computed cases, its invariants, and the worked example."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from nonstop.config import ConfigError, load_config
from nonstop.planner.cli import parse_axes
from nonstop.planner.model import simulate
from nonstop.planner.params import PlanParams, Shape, _fit_line, _fit_with_slowdown
from nonstop.planner.sweep import recommend, sweep

ROOT = Path(__file__).resolve().parent.parent


def params(**kw) -> PlanParams:
    base = dict(pass_s=0.010, pass_row_s=0.0001, step_s=0.2, step_token_s=0.001, publish_s=0.05, apply_s=0.0,
                groups_lens=[[4, 4, 4, 4]])
    return PlanParams(**{**base, **kw})


def test_synchronous_cycle_matches_the_hand_computed_one():
    """Depth 0, one engine, every completion 4 tokens, all 8 groups x 4 rows fit at once:
    a step is 4 passes of 32 rows, then the step on 128 tokens and the publish. The learning
    loop's own 30 ms after a publish overlap the next batch's generation (admission opened at
    the publish), so they cost nothing while generation takes longer."""
    p = params(loop_s=0.03)
    shape = Shape(engines=1, depth=0, max_lag=None, prompts_per_step=8, group_size=4, slots=64, steps=10)
    gen = 4 * (0.010 + 0.0001 * 32)
    train = 0.2 + 0.001 * 128
    assert gen > 0.03
    pred = simulate(p, shape)
    assert pred.wall_s == pytest.approx(10 * (gen + train + 0.05), rel=1e-9)
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
    shape = Shape(engines=1, depth=None, max_lag=0, prompts_per_step=2, group_size=4, slots=8, steps=15,
                  max_queued=16)
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


def test_fits_recover_known_lines():
    xs = [float(x) for x in range(8, 257, 8)]
    assert _fit_line(xs, [0.01 + 0.0002 * x for x in xs]) == pytest.approx((0.01, 0.0002))
    rows = [(x, o, (0.01 + 0.0002 * x) * (1 + 0.5 * o)) for x in xs for o in (0.0, 1.0)]
    assert _fit_with_slowdown(rows) == pytest.approx((0.01, 0.0002, 0.5))
    assert _fit_line(xs, [1.0 - 0.001 * x for x in xs])[1] == 0.0  # never a negative cost


def test_sweep_axes_set_fields_together_and_are_validated():
    assert parse_axes(("runtime.num_engines+trainer.ranks=2:1,1:2",)) == {
        "runtime.num_engines+trainer.ranks": ["2:1", "1:2"]}
    with pytest.raises(ConfigError, match="2 parts"):
        parse_axes(("runtime.num_engines+trainer.ranks=2",))
    rows = sweep(params(), load_config(overrides=["run.max_steps=5"]),
                 {"runtime.num_engines+trainer.ranks": ["1:1", "2:2"], "buffer.depth": ["0", "1"]}, seeds=1)
    assert sorted((r.shape.engines, r.shape.trainer_ranks, r.shape.depth) for r in rows) == [
        (1, 1, 0), (1, 1, 1), (2, 2, 0), (2, 2, 1)]
    with pytest.raises(ConfigError, match="buffer.depht"):
        sweep(params(), load_config(), {"buffer.depht": ["1"]})


def test_worked_example_of_planning_md():
    """docs/planning.md: at paper scale the synchronous pipeline idles the trainer most of each step;
    a deeper buffer and more engines per trainer GPU fix it."""
    p = PlanParams.load(ROOT / "examples" / "planner" / "costs_32b_h100.yaml")
    cfg = load_config(ROOT / "examples" / "planner_32b.yaml", ["run.max_steps=20"])
    sync = simulate(p, Shape.of(cfg))
    assert sync.trainer_idle > 0.8 and sync.lag_hist.keys() == {0}
    rows = sweep(p, cfg, {"buffer.depth": ["0", "4"], "buffer.max_lag": ["8"],
                          "runtime.num_engines+trainer.ranks": ["8:32", "12:16"]}, seeds=1)
    best = recommend(rows)
    assert best is not None and best.shape.depth == 4 and best.shape.engines == 12
    assert best.samples_per_s > 3 * sync.samples_per_s and best.trainer_idle < sync.trainer_idle - 0.3
    assert recommend(rows, max_mean_lag=0.0) is not None and recommend(rows, max_mean_lag=0.0).shape.depth == 0


def test_stated_costs_round_trip_through_json(tmp_path):
    p = dataclasses.replace(params(), calibrated_on=Shape(engines=2))
    (tmp_path / "c.json").write_text(p.to_json())
    assert PlanParams.load(tmp_path / "c.json") == p
