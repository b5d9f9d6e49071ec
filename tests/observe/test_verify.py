"""`nonstop verify` on real runs of the default model: it passes on what the run did, and fails,
naming the sample, on a record doctored to train one sample twice or to lose one.

One short run (4 steps, a checkpoint every 2) is shared by the tests; each one that edits a record
or resumes works on its own copy of the run folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from support.cli import nonstop, sets


@pytest.fixture(scope="module")
def short_run(tmp_path_factory) -> Path:
    cwd = tmp_path_factory.mktemp("verify")
    args = sets(
        {
            "run.max_steps": 4,
            "run.max_time_s": None,
            "task.max_operand": 9,
            "task.eval_size": 20,
            "rollout.prompts_per_step": 4,
            "checkpoint.every_steps": 2,
            "run.eval_every": 100,
            "run.progress": "plain",
            "run.name": "v",
        }
    )
    result = nonstop(["train", *args], cwd=cwd, timeout_s=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return cwd / "runs" / "v"


def copy_of(run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(run, out, ignore=shutil.ignore_patterns("run.lock"))
    return out


def steps_of(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "trained.jsonl").read_text().splitlines()]


def write_steps(run: Path, steps: list[dict]) -> None:
    (run / "trained.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))


def verify(run: Path):
    return nonstop(["verify", str(run)], cwd=run.parent, timeout_s=120)


def row(stdout: str, name: str) -> int:
    """The value of the table row `name`."""
    line = next(line for line in stdout.splitlines() if line.startswith(name + "  "))
    return int(line[len(name) :].split()[0])


def test_verify_passes_on_a_short_run(short_run):
    result = verify(short_run)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert out.strip().endswith("verify: OK"), out
    assert row(out, "lost") == 0 and row(out, "duplicated") == 0, out
    assert row(out, "steps") == 4, out
    trained = {(e, i) for s in steps_of(short_run) for e, i, *_ in s["samples"]}
    assert row(out, "prompts trained") == len(trained) == 16, out  # 4 prompts a step
    assert row(out, "samples trained") == 16 * 8, out  # rollout.group_size 8
    summary = json.loads((short_run / "summary.json").read_text())
    assert row(out, "prompts drawn") >= len(trained) + sum(summary["drops"].values()) - row(out, "in flight at the end")


def test_verify_fails_naming_a_sample_trained_twice(short_run, tmp_path):
    run = copy_of(short_run, tmp_path)
    steps = steps_of(run)
    e, i, sid, *_ = twice = steps[0]["samples"][3]
    steps[2]["samples"].append(twice)
    write_steps(run, steps)
    result = verify(run)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"duplicated: epoch {e} prompt {i} sample {sid} recorded 2 times: step 1, step 3" in result.stdout
    assert row(result.stdout, "duplicated") == 1 and row(result.stdout, "lost") == 0, result.stdout


def test_verify_fails_naming_a_lost_sample(short_run, tmp_path):
    run = copy_of(short_run, tmp_path)
    steps = steps_of(run)
    e, i, sid, *_ = steps[1]["samples"].pop(5)
    write_steps(run, steps)
    result = verify(run)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"lost: epoch {e} prompt {i} sample {sid}: missing from its group's records" in result.stdout
    assert row(result.stdout, "lost") == 1 and row(result.stdout, "duplicated") == 0, result.stdout


def test_verify_fails_naming_a_lost_prompt(short_run, tmp_path):
    run = copy_of(short_run, tmp_path)
    steps = steps_of(run)
    e, i = steps[3]["samples"][0][:2]
    steps[3]["samples"] = [s for s in steps[3]["samples"] if s[:2] != [e, i]]
    write_steps(run, steps)
    result = verify(run)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"lost: epoch {e} prompt {i}: drawn, never trained or dropped" in result.stdout


def test_a_record_that_cannot_be_read_fails_and_is_never_a_zero(short_run, tmp_path):
    run = copy_of(short_run, tmp_path)
    (run / "dropped.jsonl").unlink()
    result = verify(run)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "dropped.jsonl is missing" in result.stderr and result.stdout == ""


def test_a_resume_that_falls_back_trains_the_later_steps_again_and_verifies(short_run, tmp_path):
    """The newest checkpoint (step 4) is corrupted: the resume falls back to step 2, its copies of
    the records become the live ones, the first session's steps 3 and 4 move to the rolled-back
    file, and the resumed run's steps 3 and 4 take their place."""
    run = copy_of(short_run, tmp_path)
    before = steps_of(run)
    state = run / "checkpoints" / "step_00000004" / "state.json"
    state.write_text(state.read_text().replace('"step": 4', '"step": 5'))
    result = nonstop(["train", "--resume", str(run)], cwd=tmp_path, timeout_s=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "trained.jsonl: 2 lines after step 2 moved to trained.rolled_back.jsonl" in result.stdout
    rolled = [json.loads(line) for line in (run / "trained.rolled_back.jsonl").read_text().splitlines()]
    assert rolled == before[2:]
    after = steps_of(run)
    assert after[:2] == before[:2] and [s["step"] for s in after] == [1, 2, 3, 4]
    result = verify(run)
    assert result.returncode == 0, result.stdout + result.stderr
    assert row(result.stdout, "steps") == 4
