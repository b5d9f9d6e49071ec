"""The example tasks (examples/tasks/): their configs load, their data is clean and matches the
generator, their rewards score right answers 1 and wrong ones 0, and the default base choice
warms up for them (the shipped base is for addition only)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nonstop.config import load_config
from nonstop.scoring.rewards import resolve_reward
from nonstop.tasks.base import choose_base
from nonstop.tasks.data import load_task
from support import ROOT

TASKS = ROOT / "examples" / "tasks"


@pytest.fixture(autouse=True)
def _reward_module_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(TASKS))


@pytest.mark.parametrize("task,rows", [("subtraction", 5050), ("reverse", 4096), ("multiply", 720)])
def test_example_task_config_data_and_reward(task, rows, monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = load_config(TASKS / f"{task}.yaml")
    data = load_task(cfg.task)
    assert data.report.rows_read == rows and data.report.rows_skipped == 0
    assert len(data.train) + len(data.eval) == rows and len(data.eval) == min(cfg.task.eval_size, rows // 2)
    assert choose_base(cfg) == "warmup"
    reward = resolve_reward(cfg.task.reward)
    for ex in data.eval[:50]:
        assert reward(ex.answer, ex.answer) == 1.0 and reward(" " + ex.answer + " ", ex.answer) == 1.0
        assert reward(ex.answer + "1", ex.answer) == 0.0 and reward("", ex.answer) == 0.0


def test_example_task_files_are_what_the_generator_writes(tmp_path):
    for f in ("make_tasks.py",):
        (tmp_path / f).write_text((TASKS / f).read_text())
    subprocess.run([sys.executable, str(tmp_path / "make_tasks.py")], check=True)
    for task in ("subtraction", "reverse", "multiply", "cipher"):
        assert (tmp_path / f"{task}.jsonl").read_text() == (TASKS / f"{task}.jsonl").read_text()


def test_cipher_task_ships_its_student_and_teacher_for_distillation(monkeypatch):
    """examples/tasks/cipher.yaml: twelve-letter answers, a shipped student and teacher whose
    weights are the bytes their provenance records, the teacher far stronger, both with the
    task's tokenizer, and room for the whole answer and its end of sequence."""
    from nonstop.scoring.teacher import check_tokenizers
    from nonstop.tasks.base import verify

    monkeypatch.chdir(ROOT)
    cfg = load_config(TASKS / "cipher.yaml")
    data = load_task(cfg.task)
    assert data.report.rows_read == 10_000 and data.report.rows_skipped == 0 and len(data.eval) == 500
    assert {len(ex.answer) for ex in data.eval} == {12} and cfg.rollout.max_new_tokens == 13
    assert cfg.model.path is not None and cfg.distill.teacher is not None
    student, teacher = verify(cfg.model.path), verify(cfg.distill.teacher)
    assert student["heldout_accuracy"] < 0.2 and teacher["heldout_accuracy"] >= 0.99
    assert student["warmup"]["seed"] == teacher["warmup"]["seed"] and student["steps"] < teacher["steps"]
    check_tokenizers(cfg.model.path, cfg.distill.teacher)
    assert not cfg.distill.task_reward and not cfg.rollout.filter_uniform_reward


def test_each_task_warms_up_into_its_own_cached_base(monkeypatch):
    """The warm-up cache key covers the task: two tasks with the same model and warm-up settings
    must not share a cached base (one task's base scores 0% on another)."""
    from nonstop.tasks.warmup import _cache_key

    monkeypatch.chdir(ROOT)
    keys = {task: _cache_key(load_config(TASKS / f"{task}.yaml")) for task in ("subtraction", "reverse", "multiply")}
    assert len(set(keys.values())) == 3, keys
    cfg = load_config(TASKS / "reverse.yaml")
    assert _cache_key(cfg) == _cache_key(load_config(TASKS / "reverse.yaml", ["task.reward=exact_match"]))
    assert _cache_key(cfg) != _cache_key(load_config(TASKS / "reverse.yaml", ["task.eval_size=100"]))
