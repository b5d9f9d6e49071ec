"""TRL rewards and TRL datasets trained unchanged: a `datasets.Dataset` in TRL's conversational format
through nonstop.train(), a JSONL file of conversational rows through the CLI, on a tiny random Llama
with SmolLM2's chat template (real engine and trainer processes)."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
from safetensors.torch import load_file

import nonstop
from support.cli import nonstop as nonstop_cli
from support.tiny_chat import save_tiny_chat
from support.trl_rewards import says_yes


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory, smollm2_dir) -> Path:
    return save_tiny_chat(tmp_path_factory.mktemp("tiny-chat"), smollm2_dir)


def _rows(n: int, log: Path, kinds=("plain", "half", "none")) -> list[dict]:
    return [
        {
            "prompt": [{"role": "user", "content": f"Is {i} even? Say yes or no."}],
            "answer": "yes" if i % 2 == 0 else "no",
            "kind": kinds[i % len(kinds)],
            "row_id": i,
            "log": str(log),
        }
        for i in range(n)
    ]


def _fast(model: Path, out: Path, steps: int) -> list[str]:
    return [
        f"model.path={model}",
        f"run.out_dir={out}",
        f"run.max_steps={steps}",
        "run.eval_every=100",
        "rollout.prompts_per_step=3",
        "rollout.group_size=3",
        "rollout.max_new_tokens=4",
        "rollout.filter_uniform_reward=false",
        "checkpoint.every_steps=null",
    ]


def _calls(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_a_conversational_dataset_and_trl_rewards_through_the_python_api(chat_model, tmp_path):
    log = tmp_path / "calls.jsonl"
    rows = [{**{k: v for k, v in r.items() if k != "answer"}, "solution": r["answer"]} for r in _rows(15, log)]
    train, held = rows[:12], rows[12:]
    summary = nonstop.train(
        overrides=_fast(chat_model, tmp_path, 3),
        dataset=datasets.Dataset.from_list(train),
        eval_dataset=datasets.Dataset.from_list(held),
        columns={"answer": "solution"},
        reward=["support.trl_rewards:recorded", says_yes],
        reward_weights=[1.0, 2.0],
        progress="off",
    )
    assert summary.steps == 3
    calls = _calls(log)
    trained = [c for c in calls if c["row_ids"][0] < 12]
    assert trained and {c["row_ids"][0] for c in calls} > {c["row_ids"][0] for c in trained}  # held-out rows too
    for call in trained:
        row = train[call["row_ids"][0]]
        assert call["prompts"] == [row["prompt"]] * 3  # the row's messages, not the rendered text
        assert all(c[0]["role"] == "assistant" and len(c) == 1 for c in call["completions"])
        # every other column by its name, the one mapped to `answer` under its own name too
        assert call["columns"] == ["answer", "kind", "log", "row_id", "solution"]
        assert all(1 <= len(ids) <= 4 for ids in call["completion_ids"])
    # kind 'none': both rewards None -> counted, one per sample of each such group scored in training. A
    # group whose scoring is under way when the run stops has its call logged by the reward's thread but is
    # never counted (its scoring is cancelled; it happened once in a CI run: 12 counted of 15 logged), so
    # the count is whole groups of 3, at least one group's, at most every logged group's
    none_groups = sum(1 for c in trained if train[c["row_ids"][0]]["kind"] == "none")
    counted = summary.reward_errors.get("reward_all_none", 0)
    assert set(summary.reward_errors) == {"reward_all_none"}
    assert counted % 3 == 0 and 3 <= counted <= 3 * none_groups, (counted, none_groups)
    record = json.loads((Path(summary.run_dir) / "summary.json").read_text())
    assert record["reward_errors"]["reward_all_none"] == counted


def test_samples_no_reward_applies_to_are_not_trained(chat_model, tmp_path):
    """Every reward None: every sample left out, so the weights end as they began. The same rows in
    TRL's standard format (string prompts), scored by a list of TRL rewards, move them (the check
    can fail), and the rewards get strings."""
    log = tmp_path / "calls.jsonl"
    chat = _rows(6, log, kinds=("plain",))
    standard = [{**r, "prompt": r["prompt"][0]["content"]} for r in chat]
    before = load_file(str(chat_model / "model.safetensors"))

    def final_weights(rows: list[dict], reward, name: str) -> tuple:
        summary = nonstop.train(
            overrides=[*_fast(chat_model, tmp_path, 2), f"run.name={name}", "trainer.lr=1e-2"],
            dataset=rows,
            eval_size=2,
            reward=reward,
            progress="off",
        )
        assert summary.steps == 2
        return summary, load_file(str(Path(summary.final_dir) / "model.safetensors"))

    untouched, weights = final_weights(chat, "support.trl_rewards:never", "never")
    left_out = untouched.reward_errors["reward_all_none"]  # generated ahead (buffer.depth 1) counts too
    assert left_out >= 2 * 3 * 3 and left_out % 3 == 0
    assert weights.keys() == before.keys() and all(weights[k].equal(before[k]) for k in before)
    reward = ["support.trl_rewards:parity", "support.trl_rewards:recorded"]
    _, moved = final_weights(standard, reward, "parity")
    assert any(not moved[k].equal(before[k]) for k in before)
    calls = _calls(log)
    assert calls and all(c["prompts"][0] == standard[c["row_ids"][0]]["prompt"] for c in calls)
    assert all(isinstance(text, str) for c in calls for text in c["completions"])


def test_the_cli_takes_a_trl_reward_by_name_and_conversational_jsonl(chat_model, tmp_path):
    log = tmp_path / "calls.jsonl"
    rows = _rows(8, log, kinds=("plain",))
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [f"--set={o}" for o in _fast(chat_model, tmp_path, 2)]
    result = nonstop_cli(
        [
            "train",
            *args,
            "--set=task.name=jsonl",
            "--set=task.dataset_path=data.jsonl",
            "--set=task.eval_size=2",
            "--set=task.reward=support.trl_rewards:recorded",
            "--set=run.name=cli",
            "--set=run.progress=plain",
        ],
        cwd=tmp_path,
        timeout_s=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((tmp_path / "cli" / "summary.json").read_text())
    assert summary["steps"] == 2 and not summary["reward_errors"]
    calls = _calls(log)
    assert calls and all(c["prompts"][0] == rows[c["row_ids"][0]]["prompt"] for c in calls)
    assert all(c["completions"][0][0]["role"] == "assistant" for c in calls)
    assert all(c["values"] == [float(min(len(ids), 3)) for ids in c["completion_ids"]] for c in calls)
