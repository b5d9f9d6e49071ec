"""bench/long_rollout.py reads learning speed from held-out curves: the target above every run's
first two evaluations, the time to it interpolated between evaluations, a run that never reached
it reported as not reached (a lower bound or no speed-up, never a made-up time), and TRL's arm at
the learning rate nonstop resolves for the config."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

from nonstop.config import load_config
from nonstop.config.actors import TINY_MODEL_LR
from nonstop.config.sizing import TASK_BASE_LR

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "bench"))  # the bench imports its neighbour cli_run as a script does
    try:
        spec = importlib.util.spec_from_file_location("bench_long_rollout", ROOT / "bench" / "long_rollout.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(ROOT / "bench"))


def test_the_target_is_above_every_runs_first_two_evaluations(bench):
    curves = [
        [(0, 0.0, 0.30), (5, 40.0, 0.44), (10, 80.0, 0.60)],
        [(0, 0.0, 0.32), (5, 20.0, 0.48), (10, 40.0, 0.50)],
    ]
    # 0.48 is depth's second evaluation; the later 0.60 does not count
    assert bench.target_from(curves, 0.03) == pytest.approx(0.51)
    assert bench.target_from(curves, 0.0) == pytest.approx(0.48)


def test_time_to_target_is_the_first_crossing_interpolated(bench):
    c = [(0, 0.0, 0.30), (5, 40.0, 0.40), (10, 80.0, 0.60), (15, 120.0, 0.50), (20, 160.0, 0.70)]
    assert bench.time_to_target(c, 0.50) == pytest.approx(60.0)  # halfway from 40% at 40 s to 60% at 80 s
    assert bench.time_to_target(c, 0.60) == pytest.approx(80.0)  # an evaluation exactly at the target
    assert bench.time_to_target(c, 0.65) == pytest.approx(150.0)  # from the dip at step 15, not before it
    assert bench.time_to_target(c, 0.71) is None


def test_speedups_of_runs_that_did_not_reach_are_bounds_or_missing(bench):
    target = 0.5
    fast = [(0, 0.0, 0.3), (5, 10.0, 0.4), (10, 20.0, 0.6)]  # crosses at 15 s
    slow = [(0, 0.0, 0.3), (5, 30.0, 0.4), (10, 60.0, 0.6)]  # crosses at 45 s
    never = [(0, 0.0, 0.3), (5, 40.0, 0.4), (10, 90.0, 0.45)]
    assert bench.seed_speedup(slow, fast, target) == (pytest.approx(3.0), "exact")
    # sync never reached it in 90 s: the best arm's 15 s make a speed-up of at least 6
    assert bench.seed_speedup(never, fast, target) == (pytest.approx(6.0), "lower")
    assert bench.seed_speedup(slow, never, target) == (None, "missing")
    assert bench.seed_speedup(never, never, target) == (None, "missing")

    exact = bench.spread([(3.0, "exact"), (2.0, "exact"), (4.0, "exact")])
    assert (exact["median"], exact["min"], exact["max"], exact["bound"], exact["seeds"]) == (3.0, 2.0, 4.0, "exact", 3)
    mixed = bench.spread([(3.0, "exact"), (6.0, "lower"), (None, "missing")])
    assert (mixed["median"], mixed["min"], mixed["max"], mixed["bound"], mixed["seeds"]) == (4.5, 3.0, 6.0, "lower", 2)
    none = bench.spread([(None, "missing")] * 3)
    assert none["median"] is None and none["seeds"] == 0 and none["bound"] == "missing"
    # the best arm: a run not reached counts as never, so one miss in three still has a median
    assert bench.median_time([10.0, None, 20.0]) == 20.0
    assert bench.median_time([10.0, None, None]) == math.inf


def test_a_curve_takes_earlier_evaluations_off_the_clock(bench):
    recs = [
        {"step": 1, "time_s": 5.0, "lag_hist": {}},
        {"step": 2, "time_s": 10.0, "lag_hist": {}, "eval_accuracy": 0.4},
        {"step": 3, "time_s": 25.0, "lag_hist": {}},  # 10 s of it was step 2's evaluation
        {"step": 4, "time_s": 30.0, "lag_hist": {}, "eval_accuracy": 0.5},
        {"step": 5, "time_s": 45.0, "lag_hist": {}},
        {"step": 5, "policy_version": 5, "eval_accuracy": 0.55, "final_eval": True},
    ]
    eval_s = {2: 10.0, 4: 5.0, 5: 6.0}
    assert bench.curve(0.3, recs, eval_s) == [(0, 0.0, 0.3), (2, 10.0, 0.4), (4, 20.0, 0.5), (5, 30.0, 0.55)]
    assert bench.curve(0.3, recs, eval_s, with_evals=True)[1:] == [(2, 10.0, 0.4), (4, 30.0, 0.5), (5, 45.0, 0.55)]


def test_trl_runs_at_the_rate_nonstop_resolves_with_the_same_batch(bench):
    cfg = load_config(str(bench.CONFIG))
    same = bench.trl_batch(cfg)
    assert same["learning_rate"] == TASK_BASE_LR["long_rollout"] != TINY_MODEL_LR
    assert same["per_device_train_batch_size"] == cfg.rollout.prompts_per_step * cfg.rollout.group_size
    assert same["num_generations"] == cfg.rollout.group_size
    assert same["num_iterations"] == cfg.trainer.updates_per_batch
    assert same["max_completion_length"] == cfg.rollout.max_new_tokens
    assert bench.trl_batch(load_config(str(bench.CONFIG), overrides=["trainer.lr=2e-4"]))["learning_rate"] == 2e-4
