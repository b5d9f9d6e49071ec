"""examples/from_trl: the TRL script and its nonstop version train on the same rows with the same
rewards. Both run whole (one pass over 8 rows, on a tiny Llama with SmolLM2's chat template) and
record every reward call; the records are compared. That run takes about 100 s on two loaded cores
(TRL about 40, nonstop about 60), so it is in the slow tier; the mapping of the example's
GRPOConfig is checked in the default tier."""

from __future__ import annotations

import functools
import importlib.util
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import nonstop
from nonstop.config.trl import TrlMappingWarning
from support import EXAMPLES_DIR, child_env
from support.tiny_chat import save_tiny_chat

EXAMPLE = EXAMPLES_DIR / "from_trl"
TRAIN_ROWS, HELD_OUT_ROWS = set(range(8)), set(range(100, 104))


@functools.cache
def _common():
    """examples/from_trl/common.py, imported under a name of its own (the scripts import it as `common`)."""
    spec = importlib.util.spec_from_file_location("from_trl_common", EXAMPLE / "common.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_examples_grpo_config_maps_to_the_same_run(tmp_path):
    common = _common()
    args = common.grpo_config(str(tmp_path))
    with pytest.warns(TrlMappingWarning) as caught:
        cfg = nonstop.from_trl(args, model="m")
    assert [line.split(":")[0].strip() for line in str(caught[0].message).splitlines()[1:]] == ["logging_steps"]
    assert (cfg.rollout.group_size, cfg.rollout.prompts_per_step, cfg.rollout.max_new_tokens) == (4, 2, 16)
    assert (cfg.run.max_epochs, cfg.run.seed, cfg.trainer.lr, cfg.trainer.loss) == (1, 0, 1e-5, "dapo")
    assert cfg.checkpoint.every_steps is None and cfg.trainer.activation_checkpointing is False
    assert args.reward_weights == [1.0, 0.2]
    rows = common.make_dataset(8)
    assert [r["task"] for r in rows] == ["sum", "sum", "sum", "open"] * 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert common.correct(
            [rows[0]["prompt"]] * 2,
            [[{"role": "assistant", "content": "0 + 0 = 0"}], [{"role": "assistant", "content": "1"}]],
            ["0", "0"],
            ["sum", "open"],
        ) == [1.0, None]


def _run(script: str, model: Path, out: Path, log: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = child_env(FROM_TRL_REWARD_LOG=str(log), TRL_EXPERIMENTAL_SILENCE="1")
    cmd = [sys.executable, str(EXAMPLE / script), str(model), str(out)]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=400)


def _calls(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


@pytest.mark.slow
def test_trl_and_nonstop_train_on_the_same_rows_with_the_same_rewards(smollm2_dir, tmp_path):
    model = save_tiny_chat(tmp_path / "model", smollm2_dir)
    logs = {"trl": tmp_path / "trl.jsonl", "nonstop": tmp_path / "nonstop.jsonl"}
    for name, script in (("trl", "train_trl.py"), ("nonstop", "train_nonstop.py")):
        result = _run(script, model, tmp_path / name, logs[name], tmp_path)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    trl, ours = _calls(logs["trl"]), _calls(logs["nonstop"])
    (summary,) = (tmp_path / "nonstop").glob("*/summary.json")
    assert json.loads(summary.read_text())["steps"] == 4  # 8 rows / 2 a step, as TRL's 4 steps
    seen = {name: {i for c in calls for i in c["row_ids"]} for name, calls in (("trl", trl), ("nonstop", ours))}
    assert seen["trl"] == TRAIN_ROWS
    assert seen["nonstop"] == TRAIN_ROWS | HELD_OUT_ROWS  # nonstop also scores its held-out rows
    on_train = [c for c in ours if set(c["row_ids"]) <= TRAIN_ROWS]  # nonstop's held-out calls left aside
    for reward in ("correct", "brief"):
        columns = [{tuple(c["columns"]) for c in calls if c["reward"] == reward} for calls in (trl, on_train)]
        assert columns[0] == columns[1] and len(columns[0]) == 1, (reward, columns)
    for calls in (trl, ours):
        assert all(c["chat"] for c in calls)  # conversational completions, as messages, on both sides
        for c in (c for c in calls if c["reward"] == "correct"):
            for text, answer, value, row in zip(c["completions"], c["answers"], c["values"], c["row_ids"]):
                assert value == (None if row % 4 == 3 else _correct(text, answer)), (row, text, value)
        for c in (c for c in calls if c["reward"] == "brief"):
            assert all(v is not None and 0.0 <= v <= 1.0 for v in c["values"])


def _correct(text: str, answer: str) -> float:
    found = _common().NUMBER.findall(text)
    return float(bool(found) and found[-1] == answer)
