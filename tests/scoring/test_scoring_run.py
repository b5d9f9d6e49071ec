"""Runs of the real CLI with faulty rewards: every fault counted, the run goes on, and the prompt
ledger settles every prompt exactly once."""

from __future__ import annotations

import json

import pytest

from support.cli import nonstop, records, sets, small_model_args


def _dataset(tmp_path, n=10):
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "difficulty": a % 3} for a in range(n) for b in range(4)]
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return rows


def _run(tmp_path, tiny_dir, name, *overrides):
    result = nonstop(
        [
            "train",
            *small_model_args(tiny_dir),
            *sets(
                {
                    "task.name": "jsonl",
                    "task.dataset_path": "data.jsonl",
                    "task.eval_size": 8,
                    "run.max_epochs": 1,
                    "run.max_steps": 100,
                    "rollout.filter_uniform_reward": False,
                    "rollout.prompts_per_step": 4,
                    "rollout.group_size": 2,
                    "checkpoint.every_steps": None,
                    "run.name": name,
                }
            ),
            *sets(overrides),
        ],
        cwd=tmp_path,
        timeout_s=400,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = tmp_path / "runs" / name
    return json.loads((run_dir / "summary.json").read_text()), records(run_dir)


def _settled_once(summary, train_size, dropped):
    prompts = summary["prompts"]
    assert prompts["settled"] == train_size and prompts["in_flight"] == 0, prompts
    assert prompts["duplicated"] == 0 and prompts["unknown"] == 0, prompts
    assert prompts["outcomes"].get("reward_error", 0) == dropped, prompts
    # groups admitted ahead of expected drops (rollout.refill_ahead) may lag past max_lag: counted too
    lagged = prompts["outcomes"].get("max_lag", 0)
    assert prompts["outcomes"]["trained"] + dropped + lagged == train_size, prompts


def test_sleeping_raising_and_hanging_rewards_in_a_run(tiny_dir, tmp_path):
    """support.scoring_helpers:faulty sleeps 20 ms, raises on answers ending in 1, hangs on those ending in 2."""
    rows = _dataset(tmp_path)
    summary, recs = _run(
        tmp_path,
        tiny_dir,
        "faulty",
        "task.reward=support.scoring_helpers:faulty",
        "scoring.timeout_s=0.5",
        "scoring.retries=0",
        "task.max_consecutive_reward_failures=1000",
    )
    train = len(rows) - 8
    errors = summary["reward_errors"]
    assert errors["reward_raised"] > 0 and errors["reward_timeout"] > 0, errors
    # raising groups count every sample (2 each); a timed-out call counts once per group
    dropped = errors["reward_raised"] // 2 + errors["reward_timeout"]
    assert summary["drops"]["reward_error"] == dropped
    _settled_once(summary, train, dropped)
    last = recs[-2] if recs[-1].get("final_eval") else recs[-1]
    for key in ("reward_latency_p50_s", "reward_latency_p99_s", "scoring_pending", "scoring_pending_peak"):
        assert key in last, key
    assert any(r.get("reward_latency_p50_s", 0) >= 0.02 for r in recs)


@pytest.mark.slow
def test_faults_in_worker_processes_during_a_run(tiny_dir, tmp_path, monkeypatch):
    """scoring.pool=process: hung workers are killed and replaced, the run trains on everything else."""
    rows = _dataset(tmp_path)
    summary, _ = _run(
        tmp_path,
        tiny_dir,
        "faulty-procs",
        "task.reward=support.scoring_helpers:faulty",
        "scoring.pool=process",
        "scoring.timeout_s=1",
        "scoring.retries=0",
        "task.max_consecutive_reward_failures=1000",
    )
    errors = summary["reward_errors"]
    assert errors["reward_raised"] > 0 and errors["reward_timeout"] > 0, errors
    dropped = errors["reward_raised"] // 2 + errors["reward_timeout"] + errors.get("reward_worker_died", 0)
    _settled_once(summary, len(rows) - 8, dropped)


@pytest.mark.slow
def test_distillation_run_records_teacher_kl_and_identity(tiny_dir, tmp_path):
    """A short run whose teacher is the base itself: the KL term starts at zero and the teacher's
    identity@version reaches the trainer with every sample."""
    _dataset(tmp_path)
    summary, recs = _run(
        tmp_path,
        tiny_dir,
        "distill",
        f"distill.teacher={tiny_dir}",
        "distill.version=v1",
        "distill.coef=0.5",
        "run.max_steps=3",
    )
    steps = [r for r in recs if not r.get("final_eval")]
    assert len(steps) == 3 and summary["steps"] == 3
    assert abs(steps[0]["teacher_kl"]) < 1e-3  # the student is the teacher at step 1
    assert all(r["teacher_samples"] == {f"{tiny_dir}@v1": r["samples_trained"]} for r in steps)
    assert "teacher_latency_p50_s" in steps[0]


@pytest.mark.slow
def test_reward_model_killed_mid_run(tiny_dir, tmp_path):
    """The reward-model actor is SIGKILLed during the run: restarted, its calls retried, the run
    finishes and every prompt is settled once."""
    from transformers import AutoModelForSequenceClassification, Qwen2Config

    from nonstop.models.tiny import make_char_tokenizer

    rm = tmp_path / "rm"
    AutoModelForSequenceClassification.from_config(
        Qwen2Config(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            num_labels=1,
            pad_token_id=0,
        )
    ).save_pretrained(rm)
    make_char_tokenizer().save_pretrained(rm)
    rows = _dataset(tmp_path)
    summary, recs = _run(
        tmp_path,
        tiny_dir,
        "rm-killed",
        "task.reward=support.scoring_helpers:kill_reward_model_once",
        f"scoring.reward_model.path={rm}",
        "scoring.retries=2",
    )
    assert (tmp_path / "reward-model-killed").exists()
    _settled_once(summary, len(rows) - 8, summary["drops"].get("reward_error", 0))
    last = recs[-2] if recs[-1].get("final_eval") else recs[-1]
    assert last["scoring_retries"].get("reward_model_worker_died", 0) >= 1, last
    assert not any(k.startswith("reward_model") for k in summary["reward_errors"]), summary["reward_errors"]
