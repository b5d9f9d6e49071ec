"""A real `nonstop train` with agents over the API (agents.enabled) and a real agent process, the
example's (examples/api_agent/agent.py: the official openai client, nothing of nonstop), over
127.0.0.1: training steps happen, and the tokens trained are exactly the tokens the endpoint
recorded (each step's completions_crc32 against RUN_DIR/agents/groups.jsonl)."""

import json
import subprocess
import zlib

import pytest

from support import api_agent_command, child_env
from support.cli import NONSTOP, records, sets, small_model_args


def _crc(groups: list[dict]) -> int:
    """completions_crc32 (orchestrator/records.py) of recorded groups, from the recorder's log."""
    crc = 0
    for g in groups:
        crc = zlib.crc32(f"0,{g['index']}:".encode(), crc)
        for e in g["episodes"]:
            crc = zlib.crc32((",".join(map(str, e["completion_ids"])) + ";").encode(), crc)
    return crc


@pytest.mark.slow  # two processes plus the run's actors: ~1 min on an idle machine, minutes on a loaded one
def test_agent_over_the_api_trains_on_exactly_the_recorded_tokens(tiny_dir, tmp_path):
    run_dir = tmp_path / "runs" / "agents"
    overrides = [
        "agents.enabled=true",
        "agents.linger_s=2",
        "rollout.group_size=4",
        "rollout.prompts_per_step=2",
        "rollout.filter_uniform_reward=false",  # the untrained tiny model mostly scores 0: train anyway
        "run.max_steps=3",
        "run.eval_every=100",
        "run.max_time_s=300",
        "run.name=agents",
        "checkpoint.every_steps=null",
        "env.name=guess_number",
        "env.max_turns=3",
        "env.turn_max_tokens=2",
        "env.max_episode_tokens=32",
        "env.eval_rows=8",
    ]
    args = [NONSTOP, "train", *small_model_args(tiny_dir), *sets(overrides)]
    env = child_env(COLUMNS="200", OMP_NUM_THREADS="1")
    train = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    agent = subprocess.run(
        api_agent_command(run_dir, groups_in_flight=2, eval_rows=7, max_s=110, wait_s=120),
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out, _ = train.communicate(timeout=900)
    assert train.returncode == 0, out[-3000:]
    assert agent.returncode == 0, agent.stderr[-3000:]
    assert "agents endpoint: http://127.0.0.1:" in out
    result = json.loads(next(line for line in agent.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["stopped_by"] == "run finished training" and result["groups"] >= 6

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3
    assert summary["agents"]["groups_delivered"] >= 6 and summary["agents"]["open_episodes"] == 0
    assert not (run_dir / "endpoint.json").exists()  # removed when the endpoint stopped
    recorded = {g["index"]: g for g in map(json.loads, (run_dir / "agents" / "groups.jsonl").read_text().splitlines())}
    steps = [r for r in records(run_dir) if "completions_crc32" in r]
    assert len(steps) == 3
    for r in steps:
        groups = [recorded[index] for epoch, index in r["prompts"]]
        assert len(groups) == 2 and all(len(g["episodes"]) == 4 for g in groups)
        assert r["completions_crc32"] == _crc(groups), f"step {r['step']} trained other tokens than recorded"
        assert "agents" in r and r["samples_trained"] == 8
    # every recorded episode is the engine's tokens (mask 1) and the agent's answers (mask 0) in turns
    for g in recorded.values():
        for e in g["episodes"]:
            assert e["loss_mask"][0] == 1 and len(e["loss_mask"]) == len(e["completion_ids"]) == len(e["versions"])
            assert all(v == -1 for v, m in zip(e["versions"], e["loss_mask"]) if not m)
            assert all(v >= 0 for v, m in zip(e["versions"], e["loss_mask"]) if m)
