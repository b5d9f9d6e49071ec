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
from nonstop.config.policy import TINY_MODEL_LR
from nonstop.sizing.defaults import TASK_BASE_LR

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


def row(arm: str, curve: list, samples_per_s: float, idle: float) -> dict:
    """A run's row as figures() makes it, with a hand-made curve (no evaluation time)."""
    return {
        "arm": arm,
        "curve": curve,
        "wall_curve": curve,
        "samples_per_s": samples_per_s,
        "trainer_idle": idle,
        "engine_idle": 0.1,
        "wasted_frac": 0.2,
    }


def test_the_result_line_reads_every_seed_and_says_what_was_not_reached(bench, capsys):
    start = [(0, 0.0, 0.30), (4, 0.0, 0.40)]

    def rising(seconds_per_point: float, top: float) -> list:
        # from 40% at step 4, one point of held-out accuracy per `seconds_per_point`, up to `top`
        pts = [(4 * (i + 2), 10.0 * (i + 1), min(top, 0.40 + 0.05 * (i + 1))) for i in range(8)]
        return [start[0], (4, 0.0, 0.40)] + [(s, t * seconds_per_point, a) for s, t, a in pts]

    runs = {
        # target 0.43 (40% + 0.03): sync crosses at 6 s x seconds_per_point 3 = 18 s in seeds 0 and 2
        "sync": [
            row("sync", rising(3.0, 0.9), 8, 0.5),
            row("sync", rising(3.0, 0.42), 8, 0.5),
            row("sync", rising(3.0, 0.9), 8, 0.5),
        ],
        "depth2": [row("depth2", rising(1.0, 0.9), 18, 0.05)] * 3,  # 6 s every seed
        "depth1": [
            row("depth1", rising(1.5, 0.9), 15, 0.1),
            row("depth1", rising(9.0, 0.42), 15, 0.1),
            row("depth1", rising(1.5, 0.9), 15, 0.1),
        ],
    }
    line = bench.report(runs, {"trl1": {"samples_per_s": 3.0, "batches": 4, "lr": 1e-4}}, [0, 1, 2], 0.03, 4)
    out = capsys.readouterr().out
    fields = dict(kv.split("=") for kv in line.removeprefix("RESULT ").split())
    assert fields["best_arm"] == "depth2" and fields["target"] == "0.430" and fields["seeds"] == "3"
    # seeds 0 and 2: 18 s / 6 s; seed 1 sync never reached 43%: its last evaluation (240 s) / 6 s, a lower bound
    assert (fields["speedup_median"], fields["speedup_min"], fields["speedup_max"]) == ("3.00", "3.00", "40.00")
    assert fields["speedup_bound"] == "lower" and fields["speedup_seeds"] == "3"
    assert fields["ratio_vs_trl"] == "6.00" and fields["evals_min"] == "10"
    assert fields["sync_trainer_idle"] == "0.500" and fields["best_trainer_idle"] == "0.050"
    assert "seed 1: sync not reached, depth2 6s: >= 40.00x (sync did not reach the target)" in out
    assert "no held-out evaluation" in out
    assert "|    10 |" in out  # every run's evaluations, step 0 included

    runs["depth2"] = [row("depth2", rising(1.0, 0.42), 18, 0.05)] * 3  # the fastest arm never reaches it
    line = bench.report(runs, {}, [0, 1, 2], 0.03, 4)
    fields = dict(kv.split("=") for kv in line.removeprefix("RESULT ").split())
    assert fields["best_arm"] == "depth1"  # median 9 s against depth2's never
    # seed 1: depth1 did not reach it either, so that seed has no speed-up (sync's 18 s / 9 s in the others)
    assert fields["speedup_seeds"] == "2" and fields["speedup_bound"] == "exact" and fields["ratio_vs_trl"] == "n/a"
    assert fields["speedup_median"] == "2.00"
    runs["depth1"] = [row("depth1", rising(1.0, 0.42), 15, 0.1)] * 3
    line = bench.report(runs, {}, [0, 1, 2], 0.03, 4)
    fields = dict(kv.split("=") for kv in line.removeprefix("RESULT ").split())
    assert fields["speedup_median"] == "n/a" and fields["speedup_bound"] == "missing" and fields["speedup_seeds"] == "0"
