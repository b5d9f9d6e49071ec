"""The example tasks (examples/tasks/), the task matrix of bench/tasks.py among them: their configs
load, their data is clean and matches the generator, every answer fits in rollout.max_new_tokens
with its end of sequence, their rewards score right answers 1 and wrong ones below 1 (0 for an
empty one), and the default base choice warms up for them (the shipped base is for addition only)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nonstop.config import load_config
from nonstop.models.base_policy import choose_base
from nonstop.scoring.rewards import resolve_reward
from nonstop.tasks.data import load_task
from support import ROOT

TASKS = ROOT / "examples" / "tasks"


@pytest.fixture(autouse=True)
def _reward_module_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(TASKS))


MATRIX = {
    "compare": 10_000,
    "subtraction": 5050,
    "multiply": 7920,
    "reverse": 4096,
    "sort": 4096,
    "repeat": 2336,
    "opsum": 10_000,
    "sumdiff": 5050,
}
"""The task matrix (bench/tasks.py's default list) and the rows of each."""


def test_every_example_task_config_validates_and_the_matrix_is_bench_tasks_default(monkeypatch):
    monkeypatch.chdir(ROOT)
    configs = sorted(TASKS.glob("*.yaml"))
    assert {p.stem for p in configs} >= set(MATRIX) | {"cipher"}
    for path in configs:
        load_config(path)
    bench = (ROOT / "bench" / "tasks.py").read_text()
    assert f'MATRIX = "{",".join(MATRIX)}"' in bench


@pytest.mark.parametrize("task,rows", list(MATRIX.items()))
def test_example_task_config_data_and_reward(task, rows, monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = load_config(TASKS / f"{task}.yaml")
    data = load_task(cfg.task)
    assert data.report.rows_read == rows and data.report.rows_skipped == 0
    assert len(data.train) + len(data.eval) == rows and len(data.eval) == min(cfg.task.eval_size, rows // 2)
    assert choose_base(cfg) == "warmup"
    # the character tokenizer: one token a character, and the end of sequence after the answer
    assert max(len(ex.answer) for ex in data.train + data.eval) + 1 <= cfg.rollout.max_new_tokens
    reward = resolve_reward(cfg.task.reward)
    for ex in data.eval[:50]:
        assert reward(ex.answer, ex.answer) == 1.0 and reward(" " + ex.answer + " ", ex.answer) == 1.0
        assert reward(ex.answer + "1", ex.answer) < 0.5 and reward("", ex.answer) == 0.0


def test_example_task_files_are_what_the_generator_writes(tmp_path):
    for f in ("make_tasks.py",):
        (tmp_path / f).write_text((TASKS / f).read_text())
    subprocess.run([sys.executable, str(tmp_path / "make_tasks.py")], check=True)
    for task in [*MATRIX, "cipher"]:
        assert (tmp_path / f"{task}.jsonl").read_text() == (TASKS / f"{task}.jsonl").read_text()


def test_cipher_task_ships_its_student_and_teacher_for_distillation(monkeypatch):
    """examples/tasks/cipher.yaml: twelve-letter answers, a shipped student and teacher whose
    weights are the bytes their provenance records, the teacher far stronger, both with the
    task's tokenizer, and room for the whole answer and its end of sequence."""
    from nonstop.models.shipped import verify
    from nonstop.scoring.teacher import check_tokenizers

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


def test_partial_credits_pay_less_than_a_right_answer_and_the_right_length_pays_for_any_digits():
    from task_rewards import digit_credit, right_length_credit, same_lines

    assert digit_credit("59", "59") == 1.0 and digit_credit("49", "59") == 0.25 and digit_credit("5", "59") == 0.0
    assert digit_credit("159", "59") == pytest.approx(1 / 3) and digit_credit("x9", "59") == 0.0
    assert right_length_credit("12", "59") == 0.2 and right_length_credit("5", "59") == 0.0
    assert same_lines("101 \n 45\n", "101\n45") == 1.0 and same_lines("101\n46", "101\n45") == 0.0


def test_each_task_warms_up_into_its_own_cached_base(monkeypatch):
    """The warm-up cache key covers the task: two tasks with the same model and warm-up settings
    must not share a cached base (one task's base scores 0% on another)."""
    from nonstop.models.warmup import _cache_key

    monkeypatch.chdir(ROOT)
    keys = {task: _cache_key(load_config(TASKS / f"{task}.yaml")) for task in MATRIX}
    assert len(set(keys.values())) == len(MATRIX), keys
    cfg = load_config(TASKS / "reverse.yaml")
    assert _cache_key(cfg) == _cache_key(load_config(TASKS / "reverse.yaml", ["task.reward=exact_match"]))
    assert _cache_key(cfg) != _cache_key(load_config(TASKS / "reverse.yaml", ["task.eval_size=100"]))
