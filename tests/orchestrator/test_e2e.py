"""End-to-end runs of the real CLI: orchestrator + engine process + trainer process."""

from __future__ import annotations

import json
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from nonstop.checkpoint import list_checkpoints, saved_policy_version
from nonstop.models.shipped import read_provenance, shipped_dir
from support.cli import nonstop, records, sets, small_model_args
from support.served import served_versions


def test_short_run_learns(tmp_path):
    """The default job, step-bound: the shipped base (the same bytes on every CPU), 60 steps of
    async GRPO at depth 1 (refilling ahead). Over run seeds 0-2 the gain at step 60 was +15.6, +11.4
    and +13.8 points; the bar is +5. Evaluated every 20 steps, so the run doctor has a held-out
    trend to read (from step 50 on), and it must stay silent: the default job learns."""
    result = nonstop(
        [
            "train",
            *sets(
                {
                    "run.name": "learn",
                    "run.max_steps": 60,
                    "run.max_time_s": None,
                    "run.eval_every": 20,
                    "run.progress": "plain",
                }
            ),
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "base policy: shipped 'builtin'" in result.stdout
    assert "doctor [" not in result.stdout
    run_dir = tmp_path / "runs" / "learn"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["base_accuracy"] == read_provenance(shipped_dir())["heldout_accuracy"], summary
    assert summary["steps"] == 60
    assert summary["final_accuracy"] >= summary["base_accuracy"] + 0.05, summary
    assert summary["doctor"] == {"enabled": True, "findings": []}
    recs = records(run_dir)
    for key in (
        "step",
        "policy_version",
        "reward_mean",
        "loss",
        "ratio_mean",
        "ratio_max",
        "lag_hist",
        "generation_busy_s",
        "generation_idle_s",
        "training_busy_s",
        "training_idle_s",
        "samples_per_s",
        "rollout_reward_mean",
        "rollout_signal_groups",
        "rollout_entropy",
    ):
        assert key in recs[-1], key
    assert [r["policy_version"] for r in recs] == list(range(1, len(recs) + 1))
    # depth 1 bounds the lag by 1, and by 2 (max_lag) for a group admitted ahead (rollout.refill_ahead)
    # that its batch did not need and the next one trained
    assert all(int(lag) <= 2 for r in recs for lag in r["lag_hist"])
    # trainer.forward_ahead: the first groups of a batch the loop waited for had their forward run
    # ahead, and each step used every such group's forward (none at another version or of another group)
    spans = [json.loads(line) for line in (run_dir / "spans" / "orchestrator.jsonl").read_text().splitlines()]
    ran_ahead = {r["step"]: 0 for r in recs}
    for e in spans:
        if e["ev"] == "ahead":
            ran_ahead[e["step"]] += e["groups"]
    assert {r["step"]: r["ahead_groups"] for r in recs} == ran_ahead
    assert sum(ran_ahead.values()) > 0
    assert "eval_accuracy" in recs[-1]
    model = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    assert model.config.model_type == "qwen2"
    assert "held-out exact_match" in result.stdout and "base" in result.stdout  # the metric is the task reward's name


@pytest.mark.parametrize(
    "transport,sampling",
    [
        ("shm", []),
        ("broadcast", []),
        ("files", []),
        ("shm", sets({"rollout.top_k": 6, "rollout.top_p": 0.9})),
    ],
)
def test_depth0_first_step_is_exactly_on_policy(tiny_dir, tmp_path, transport, sampling):
    """Depth 0: ratio 1 on every step; with top-k/top-p only because the trainer replays the kept sets."""
    result = nonstop(
        [
            "train",
            *small_model_args(tiny_dir),
            *sets(
                {
                    "buffer.depth": 0,
                    "buffer.max_lag": 0,
                    "run.max_steps": 4,
                    "run.name": "d0",
                    "transport.kind": transport,
                    "rollout.filter_uniform_reward": False,
                    "rollout.max_new_tokens": 6,
                    "task.max_operand": 9,
                    "task.eval_size": 20,
                    "trainer.lr": "1e-2",
                    "task.reward": "support.rewards:length_reward",
                }
            ),
            *sampling,
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = tmp_path / "runs" / "d0"
    recs = records(run_dir)
    assert len(recs) == 4
    for r in recs:  # depth 0: every token was sampled by the weights being trained
        assert abs(r["ratio_min"] - 1) < 1e-4 and abs(r["ratio_max"] - 1) < 1e-4, r
        assert set(r["lag_hist"]) == {"0"}
    assert (run_dir / "config.yaml").is_file()
    final = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    initial = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert not torch.equal(final.model.embed_tokens.weight, initial.model.embed_tokens.weight)
    # the saved weights know their policy_version, and serving them tags tokens with it
    (ckpt,) = list_checkpoints(run_dir / "checkpoints")
    assert saved_policy_version(run_dir / "final") == saved_policy_version(ckpt.model_dir) == 4
    if transport == "shm" and not sampling:
        assert saved_policy_version(tiny_dir) == 0
        health, versions = served_versions(run_dir / "final")
        assert health == 4 and versions and set(versions) == {4}, (health, versions)


def test_bad_dataset_rows_and_raising_reward_are_counted_not_fatal(tiny_dir, tmp_path):
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]
    lines = [json.dumps(r) for r in rows]
    lines.insert(3, json.dumps({"prompt": "1+1="}))  # no answer: line 4
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n")
    result = nonstop(
        [
            "train",
            *small_model_args(tiny_dir),
            *sets(
                {
                    "task.name": "jsonl",
                    "task.dataset_path": "data.jsonl",
                    "task.eval_size": 10,
                    "task.reward": "support.rewards:raising_reward",
                    "run.max_steps": 3,
                    "rollout.filter_uniform_reward": False,
                    "rollout.prompts_per_step": 4,
                    "run.name": "bad",
                }
            ),
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "data.jsonl:4: missing field(s) answer; row skipped" in result.stdout
    summary = json.loads((tmp_path / "runs" / "bad" / "summary.json").read_text())
    assert summary["dataset_rows_skipped"] == 1
    assert summary["reward_errors"]["reward_raised"] > 0
    assert summary["drops"]["reward_error"] > 0
    assert "reward server unavailable" in summary["last_reward_error"]
    assert "reward errors" in result.stdout


def test_reward_that_always_fails_stops_the_run_with_the_cause(tiny_dir, tmp_path):
    result = nonstop(
        [
            "train",
            *small_model_args(tiny_dir),
            *sets(
                {
                    "task.reward": "support.rewards:always_raising_reward",
                    "task.max_operand": 9,
                    "task.eval_size": 10,
                    "task.max_consecutive_reward_failures": 8,
                }
            ),
        ],
        cwd=tmp_path,
        timeout_s=300,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "failed on 8 groups in a row" in result.stdout and "reward server is down" in result.stdout


def test_engine_killed_past_its_restart_budget_ends_the_run_with_a_clear_message(tiny_dir, tmp_path):
    t0 = time.monotonic()
    result = nonstop(
        [
            "train",
            *small_model_args(tiny_dir),
            *sets(
                {
                    "task.reward": "support.fault_rewards:kill_engine_reward",
                    "run.max_steps": 50,
                    "task.max_operand": 9,
                    "task.eval_size": 10,
                    "runtime.max_engine_restarts": 1,
                }
            ),
        ],
        cwd=tmp_path,
        timeout_s=300,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "run failed" in result.stdout
    assert "actor 'engine'" in result.stdout and "killed by signal 9" in result.stdout
    assert "no restart left (runtime.max_engine_restarts=1)" in result.stdout
    assert "restarting (1 of at most 1)" in result.stdout
    assert time.monotonic() - t0 < 120


def test_misspelt_config_key_is_one_clear_error(tmp_path):
    (tmp_path / "c.yaml").write_text("buffer:\n  depht: 2\n")
    result = nonstop(["train", "c.yaml"], cwd=tmp_path)
    assert result.returncode == 2
    assert "buffer.depht: unknown field (did you mean 'depth'?)" in result.stdout
    assert not (tmp_path / "runs").exists()


def test_config_command_prints_resolved_yaml(tmp_path):
    result = nonstop(["config", *sets({"buffer.depth": 3, "buffer.max_lag": 4})], cwd=tmp_path)
    assert result.returncode == 0
    assert "depth: 3" in result.stdout and "max_lag: 4" in result.stdout


@pytest.mark.slow
def test_default_job_meets_the_acceptance_bar(tmp_path):
    """The default job's learning, step-bound: the shipped base and 450 trainer steps, about what
    the default 190 s of RL gives on a quiet 2-core machine (433-508 measured), must gain +30
    points. The time side of the bar (<= 300 s wall, run seeds 0-4) is measured by
    bench/seeds.py, not asserted: a test must not depend on the machine's speed. Evaluated every
    run.eval_every (25) steps as by default, and the run doctor stays silent over the whole job."""
    result = nonstop(
        [
            "train",
            *sets({"run.max_time_s": None, "run.max_steps": 450, "run.progress": "plain"}),
        ],
        cwd=tmp_path,
        timeout_s=1800,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(next((tmp_path / "runs").glob("*/summary.json")).read_text())
    assert summary["steps"] == 450
    assert summary["final_accuracy"] - summary["base_accuracy"] >= 0.30, summary
    assert summary["doctor"] == {"enabled": True, "findings": []}, summary["doctor"]
