"""The long-rollout workload: its rows, its BPE tokenizer, its shipped base, its example config, a run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from nonstop.config import ConfigError, TaskConfig, load_config
from nonstop.models.base_policy import choose_base, prepare_base_model
from nonstop.models.bpe import merged_tokens, train_bpe
from nonstop.models.shipped import ASSETS, TASK_BASES, sha256_file, verify
from nonstop.scoring.rewards import exact_match
from nonstop.tasks import long_rollout as task
from nonstop.tasks.data import load_task
from support.cli import sets

ROOT = Path(__file__).resolve().parents[2]
BASE = ASSETS / TASK_BASES[task.NAME]
EXAMPLE = ROOT / "examples" / "long_rollout.yaml"


@pytest.fixture(scope="module")
def rows():
    return task.long_rollout_rows()


@pytest.fixture(scope="module")
def shipped_tokenizer():
    return AutoTokenizer.from_pretrained(BASE)


def quantile(values: list[int], p: float) -> int:
    s = sorted(values)
    return s[min(len(s) - 1, int(p * len(s)))]


def test_rows_are_deterministic_distinct_and_their_solutions_are_right(rows):
    assert task.long_rollout_rows(500, seed=7) == task.long_rollout_rows(500, seed=7)
    assert task.long_rollout_rows(500, seed=7) != task.long_rollout_rows(500, seed=8)
    assert rows[:500] == task.long_rollout_rows(500)  # a prefix of the task's rows: the draw is sequential
    assert len(rows) == task.ROWS and len({p for p, _ in rows}) == task.ROWS
    prompt, solution = task.prompt_text(995, 7, 3), task.worked_solution(995, 7, 3)
    assert prompt == "Add 7 each step and keep the last three digits. Steps: 03. Start: 995\n"
    assert solution == "03: 995 + 7 = 002\n02: 002 + 7 = 009\n01: 009 + 7 = 016\n#### 016"
    for p, s in rows[:200]:  # every line follows from the one before; the final answer is the last result
        start, add, steps = int(p[-4:-1]), int(p[4]), int(p.split("Steps: ")[1][:2])
        lines = s.splitlines()
        assert len(lines) - 1 == steps and task.K_MIN <= steps <= task.K_MAX and 1 <= add <= task.MAX_ADD
        x = start
        for left, line in zip(range(steps, 0, -1), lines[:-1]):
            assert line == f"{left:02d}: {x:03d} + {add} = {(x + add) % 1000:03d}"
            x = (x + add) % 1000
        assert lines[-1] == f"#### {x:03d}"


def test_steps_follow_the_power_law_without_floats():
    weights = task.step_weights()
    assert all(isinstance(w, int) for w in weights) and len(weights) == task.K_MAX - task.K_MIN + 1
    assert abs(weights[0] - 4 * weights[3]) <= 4  # P(k) proportional to 1/k^2: k=3 is 4x as likely as k=6


def test_reward_is_exact_match_on_the_marked_final_answer():
    solution = task.worked_solution(995, 7, 3)
    assert exact_match(solution, solution) == 1.0
    assert exact_match("03: 995 + 7 = 002\nwrong working\n#### 016", solution) == 1.0  # only the final answer counts
    assert exact_match(solution.replace("#### 016", "#### 017"), solution) == 0.0
    assert exact_match("016", solution) == 0.0  # an unmarked answer does not count
    assert exact_match(solution[:-8], solution) == 0.0  # cut before the marker (max_new_tokens)
    assert exact_match(" 52 ", "52") == 1.0 and exact_match("#### 52", "52") == 0.0  # addition unchanged


def test_completion_lengths_are_heavy_tailed_in_the_shipped_tokenizer(rows, shipped_tokenizer):
    lengths = [len(shipped_tokenizer(s)["input_ids"]) for _, s in rows]
    median, p99 = quantile(lengths, 0.5), quantile(lengths, 0.99)
    assert median >= 64 and p99 >= 8 * median, (median, p99)
    prov = verify(BASE)
    assert max(lengths) < prov["max_new_tokens"] and prov["max_new_tokens"] >= 512
    assert prov["completion_tokens"]["median"] == median


def test_bpe_round_trips_and_has_multi_character_tokens(rows, tmp_path, shipped_tokenizer):
    tok = train_bpe(task.corpus(rows[:2000]), vocab_size=400)
    merged = merged_tokens(tok)
    assert merged and "####" in tok.get_vocab() and "Ġdigits" in tok.get_vocab()
    for text in [rows[0][0] + rows[0][1], "Unseen: ünïcode & tabs\t{}", task.worked_solution(5, 95, 12)]:
        ids = tok(text)["input_ids"]
        assert tok.decode(ids) == text
    text = rows[1][0] + rows[1][1]
    assert len(tok(text)["input_ids"]) < len(text)  # merges make tokens span several characters
    # saved beside a Qwen2 model, AutoTokenizer rebuilds the same tokenizer
    tok.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text((BASE / "config.json").read_text())
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again(text)["input_ids"] == tok(text)["input_ids"]
    # the shipped tokenizer is such a BPE
    ids = shipped_tokenizer(text)["input_ids"]
    assert shipped_tokenizer.decode(ids) == text and len(ids) < len(text)
    assert [shipped_tokenizer.pad_token_id, shipped_tokenizer.bos_token_id, shipped_tokenizer.eos_token_id] == [0, 1, 2]


def test_shipped_base_is_the_recorded_bytes_and_fits_its_tokenizer(shipped_tokenizer):
    prov = verify(BASE)
    assert sha256_file(BASE / "model.safetensors") == prov["sha256"]
    assert prov["command"].startswith("python bench/make_long_base.py")
    assert 0.15 <= prov["heldout_accuracy"] <= 0.45, prov["heldout_accuracy"]
    model = AutoModelForCausalLM.from_pretrained(BASE)
    params = sum(p.numel() for p in model.parameters())
    assert params == prov["model"]["parameters"] and model.config.vocab_size == len(shipped_tokenizer)
    assert model.config.max_position_embeddings >= prov["max_new_tokens"] + 25  # the longest prompt fits


def test_the_task_selects_its_shipped_base(tmp_path):
    cfg = load_config(overrides=["task.name=long_rollout", "task.eval_size=100"])
    assert choose_base(cfg) == "builtin"
    assert prepare_base_model(cfg, load_task(cfg.task), log=lambda m: None) == BASE
    with pytest.raises(ConfigError, match="task 'long_rollout' starts from its shipped base"):
        choose_base(load_config(overrides=["task.name=long_rollout", "model.base=warmup"]))
    with pytest.raises(ConfigError, match="task.split_seed is 3"):
        choose_base(load_config(overrides=["task.name=long_rollout", "task.split_seed=3"]))
    with pytest.raises(ConfigError, match="task.eval_size must be at most"):
        choose_base(load_config(overrides=["task.name=long_rollout", "task.eval_size=5000"]))


def test_example_config_validates_and_sets_long_rollouts():
    cfg = load_config(EXAMPLE)
    assert cfg.task.name == task.NAME and cfg.rollout.max_new_tokens >= 512
    assert cfg.rollout.max_new_tokens == verify(BASE)["max_new_tokens"]
    data = load_task(TaskConfig(name=task.NAME, eval_size=cfg.task.eval_size))
    assert len(data.eval) == cfg.task.eval_size and not {e.prompt for e in data.eval} & {e.prompt for e in data.train}


# a real run: engine and trainer processes, 1024-token rollouts (26 s here; more on a loaded machine)
def test_a_short_run_of_the_example_trains_end_to_end(tmp_path):
    from support.cli import nonstop

    result = nonstop(
        [
            "train",
            str(EXAMPLE),
            *sets(
                {
                    "run.name": "long",
                    "run.max_steps": 3,
                    "run.max_time_s": None,
                    "run.eval_every": 3,
                    "task.eval_size": 16,
                    "rollout.prompts_per_step": 4,
                    "rollout.group_size": 4,
                    "checkpoint.every_steps": None,
                    "run.progress": "plain",
                }
            ),
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "base policy: shipped 'builtin'" in result.stdout
    run_dir = tmp_path / "runs" / "long"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["samples_generated"] >= 3 * 4 * 4
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in recs if "step" in r and "final_eval" not in r] == [1, 2, 3]
    assert summary["pools"]["engine"]["cpus"] == [0] and summary["pools"]["trainer"]["cpus"] == [1]
