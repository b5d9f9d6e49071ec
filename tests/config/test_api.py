"""The Python API: nonstop.train() runs real engine and trainer processes from this process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import yaml

import nonstop
from nonstop.config import ConfigError
from nonstop.scoring.rewards import RewardError
from nonstop.tasks.data import DatasetError
from support import EXAMPLES_DIR, child_env


def fast(tiny_dir: Path, out_dir: Path, steps: int = 3) -> list[str]:
    """A given tiny model (no warm-up), a few short steps, every group trained."""
    return [
        f"model.path={tiny_dir}",
        "warmup.enabled=false",
        f"run.out_dir={out_dir}",
        f"run.max_steps={steps}",
        "rollout.prompts_per_step=4",
        "rollout.max_new_tokens=3",
        "rollout.filter_uniform_reward=false",
        "checkpoint.every_steps=null",
    ]


def sums(n: int = 100, prompt: str = "prompt", answer: str = "answer") -> list[dict[str, str]]:
    return [{prompt: f"{i // 10}+{i % 10}=", answer: str(i // 10 + i % 10)} for i in range(n)]


def test_list_of_dicts_with_a_lambda_reward_scored_in_this_process(tiny_dir, tmp_path, capsys):
    rows = sums()
    rows.insert(7, {"prompt": "1+1="})  # no answer: reported and skipped, as in a JSONL file
    seen: list[tuple[str, str]] = []

    def length(completion: str, answer: str) -> float:
        seen.append((completion, answer))
        return float(len(completion))

    summary = nonstop.train(
        overrides=fast(tiny_dir, tmp_path),
        dataset=rows,
        eval_fraction=0.1,
        progress="plain",
        reward=lambda completion, answer: length(completion, answer),
    )
    assert isinstance(summary, nonstop.RunSummary)
    assert summary.steps == 3 and summary.policy_version == 3
    assert seen and {a for _, a in seen} <= {r["answer"] for r in sums()}  # the closure ran here, on our answers
    assert (Path(summary.final_dir) / "config.json").is_file()
    assert summary.dataset_rows_skipped == 1
    out = capsys.readouterr().out
    assert "dataset row 7: missing field(s) answer" in out and "90 train / 10 held-out prompts" in out
    run_dir = Path(summary.run_dir)
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 3
    recorded = yaml.safe_load((run_dir / "config.yaml").read_text())["task"]["reward"]
    assert recorded.startswith("python:") and recorded.endswith("<locals>.<lambda>")


def test_yaml_path_and_overrides_with_a_datasets_dataset_a_column_mapping_and_summed_rewards(tiny_dir, tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"trainer": {"lr": 1e-3}, "run": {"max_steps": 50, "name": "from-yaml"}}))
    train = datasets.Dataset.from_list(sums(80, "question", "solution"))
    held = datasets.Dataset.from_list(sums(100, "question", "solution")[80:])

    def flaky(completion: str, answer: str) -> float:
        if int(answer) % 2 == 0:
            raise RuntimeError("judge unavailable")
        return 0.0

    summary = nonstop.train(
        path,
        overrides=[*fast(tiny_dir, tmp_path), "trainer.lr=3e-4"],
        progress="off",
        dataset=train,
        eval_dataset=held,
        columns={"prompt": "question", "answer": "solution"},
        reward=["support.rewards:length_reward", flaky],
        reward_weights=[0.5, 1.0],
    )
    assert summary.steps == 3 and summary.run_dir == str(tmp_path / "from-yaml")
    assert summary.reward_errors["reward_raised"] > 0 and summary.drops["reward_error"] > 0  # counted, survived
    assert "judge unavailable" in (summary.last_reward_error or "")
    recorded = yaml.safe_load((tmp_path / "from-yaml" / "config.yaml").read_text())
    assert recorded["trainer"]["lr"] == 3e-4 and recorded["run"]["max_steps"] == 3
    assert recorded["task"]["reward"] == (
        "0.5*support.rewards:length_reward + 1*python:"
        "test_yaml_path_and_overrides_with_a_datasets_dataset_a_column_mapping_and_summed_rewards.<locals>.flaky"
    )


def test_missing_columns_and_bad_rows_fail_before_any_process_starts(tmp_path):
    out = [f"run.out_dir={tmp_path}"]
    ds = datasets.Dataset.from_list(sums(20, "q", "a"))
    with pytest.raises(
        DatasetError,
        match=r"dataset: column\(s\) 'question' not found \(columns: prompt <- 'question', "
        r"answer <- 'a'\); the dataset has \['q', 'a'\]",
    ):
        nonstop.train(overrides=out, dataset=ds, columns={"prompt": "question", "answer": "a"})
    with pytest.raises(DatasetError, match=r"dataset: column\(s\) 'answer' not found"):
        nonstop.train(overrides=out, dataset=[{"prompt": "1+1="}])
    with pytest.raises(DatasetError, match="columns: unknown field 'query'"):
        nonstop.train(overrides=out, dataset=sums(20), columns={"query": "q"})
    with pytest.raises(DatasetError, match="DatasetDict"):
        nonstop.train(overrides=out, dataset=datasets.DatasetDict({"train": ds}))
    rows = [*sums(20), {"prompt": "1+1=", "answer": 2}]
    with pytest.raises(DatasetError, match=r"dataset row 20: 'prompt' and 'answer' must be strings"):
        nonstop.train(overrides=[*out, "task.on_bad_row=error"], dataset=rows)
    with pytest.raises(DatasetError, match="eval_fraction: must be between 0 and 1"):
        nonstop.train(overrides=out, dataset=sums(20), eval_fraction=1.5)
    assert list(tmp_path.iterdir()) == []  # no run folder was made


def test_bad_reward_and_config_arguments_name_the_argument(tmp_path):
    out = [f"run.out_dir={tmp_path}"]
    with pytest.raises(RewardError, match="reward: expected a callable .* got int"):
        nonstop.train(overrides=out, dataset=sums(20), reward=42)  # type: ignore[arg-type]
    with pytest.raises(RewardError, match=r"reward: unknown reward 'nope'"):
        nonstop.train(overrides=out, dataset=sums(20), reward="nope")
    with pytest.raises(RewardError, match=r"reward\[1\]: cannot import 'no_such_module:fn'"):
        nonstop.train(overrides=out, dataset=sums(20), reward=["exact_match", "no_such_module:fn"])
    with pytest.raises(RewardError, match=r"reward: .* cannot be called as fn\(completion, answer\)"):
        nonstop.train(overrides=out, dataset=sums(20), reward=lambda completion: 1.0)  # type: ignore[arg-type]
    with pytest.raises(RewardError, match="reward_weights: 1 weights for 2 rewards"):
        nonstop.train(overrides=out, dataset=sums(20), reward=["exact_match", "partial_credit"], reward_weights=[1.0])
    with pytest.raises(ConfigError, match="trainer.lrr: unknown field"):
        nonstop.train(overrides=[*out, "trainer.lrr=1"], dataset=sums(20))
    with pytest.raises(ConfigError, match="config file not found"):
        nonstop.train(tmp_path / "missing.yaml")
    assert list(tmp_path.iterdir()) == []


def test_the_example_script_runs(tiny_dir, tmp_path):
    env = child_env()
    result = subprocess.run(
        [sys.executable, str(EXAMPLES_DIR / "python_api.py"), *fast(tiny_dir, tmp_path / "runs", steps=2)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 steps: held-out accuracy" in result.stdout
    assert "80 train / 20 held-out prompts" in result.stdout


def test_a_config_object_takes_overrides_and_round_trips():
    cfg = nonstop.load_config(None, ["trainer.lr=1e-4", "buffer.depth=2", "run.progress=off"])
    assert nonstop.load_config(cfg) == cfg
    changed = nonstop.load_config(cfg, ["trainer.lr=3e-4"])
    assert changed.trainer.lr == 3e-4 and changed.buffer.depth == 2 and changed.run.progress == "off"
    with pytest.raises(ConfigError, match="buffer.depht: unknown field"):
        nonstop.load_config(cfg, ["buffer.depht=1"])


def test_the_warm_up_cache_of_python_rows_is_keyed_by_their_content():
    from nonstop.api import rows_hash
    from nonstop.tasks.data import DatasetReport, TaskData, split_examples

    def data(rows: list[dict[str, str]]) -> TaskData:
        return split_examples([(r["prompt"], r["answer"]) for r in rows], 5, 0, DatasetReport())

    assert rows_hash(data(sums(20))) == rows_hash(data(sums(20)))
    other = sums(20)
    other[3] = {"prompt": other[3]["prompt"], "answer": "x"}
    assert rows_hash(data(other)) != rows_hash(data(sums(20)))
