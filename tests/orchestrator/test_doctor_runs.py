"""The run doctor on real runs (orchestrator + engine process + trainer process, the real CLI).

A run built to show the reward-rising/held-out-flat pattern: the default job (the shipped
addition base) with a reward that pays for three characters, right or wrong, and held-out
evaluation by exact match (task.eval_reward; by default it scores with the run's own reward). The
shipped base writes three for about half the prompts, so the reward climbs quickly while held-out
exact match does not (it falls: the two-digit sums get a third digit). The doctor names the
pattern once, in the progress output, summary.json, the end-of-run table and `nonstop report`,
with the reward as its cause. That the default job stays silent is asserted on the default job's
own runs (tests/orchestrator/test_e2e.py: the 60-step run, and the slow full one).
"""

from __future__ import annotations

import json
import shutil

import pytest

from support.cli import nonstop, records, sets


@pytest.fixture(scope="module")
def hacked(tmp_path_factory):
    out = tmp_path_factory.mktemp("doctor")
    overrides = {
        "run.name": "hack",
        "task.reward": "support.rewards:three_chars_reward",
        "task.eval_reward": "exact_match",  # held-out measures the task, not what the reward pays for
        "rollout.filter_uniform_reward": "false",  # once all completions earn it, steps still come
        "rollout.prompts_per_step": "16",
        "run.max_steps": "40",
        "run.max_time_s": "null",
        "run.eval_every": "10",
        "run.progress": "plain",
        "checkpoint.every_steps": "null",
        "doctor.window_steps": "10",  # a short run: trends over 10 steps, findings from step 30
        "doctor.min_steps": "30",
    }
    r = nonstop(["train", *sets(overrides)], cwd=out)
    assert r.returncode == 0, r.stdout + r.stderr
    return out / "runs" / "hack", r.stdout


def test_doctor_flags_a_reward_that_pays_for_a_length(hacked):
    run_dir, stdout = hacked
    summary = json.loads((run_dir / "summary.json").read_text())
    found = {f["code"]: f for f in summary["doctor"]["findings"]}
    assert "reward_not_heldout" in found, summary["doctor"]
    f = found["reward_not_heldout"]
    assert 30 <= f["step"] <= 40 and "three_chars_reward" in f["cause"] and "task.reward=exact_match" in f["try"]
    recs = records(run_dir)
    # a step record carries the rollout fields only when groups were scored since the previous one
    # (records.Vitals.take): the last step may train groups that were all scored before it
    scored = [r["rollout_reward_mean"] for r in recs if "rollout_reward_mean" in r]
    assert len(scored) >= 30 and scored[-1] > scored[0] + 0.1  # what it saw, in the records
    assert max(r["eval_accuracy"] for r in recs if "eval_accuracy" in r) < summary["base_accuracy"] + 0.03
    assert stdout.count("doctor [reward_not_heldout]") == 1  # the progress output, once
    assert "three_chars_reward" in stdout.split("nonstop: end of run")[1]  # and the end-of-run table


def test_report_shows_the_doctors_findings(hacked, tmp_path):
    pytest.importorskip("matplotlib")
    run_dir, _ = hacked
    r = nonstop(["report", str(run_dir), "--out", str(tmp_path / "page.html")], cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    page = (tmp_path / "page.html").read_text()
    assert "<h2>doctor</h2>" in page and "<b>reward_not_heldout</b>" in page and "three_chars_reward" in page
    # a run folder without the doctor's summary (a run still going): diagnosed from metrics.jsonl
    from nonstop.observe.report import doctor_findings

    going = tmp_path / "going"
    shutil.copytree(run_dir, going)
    (going / "summary.json").unlink()
    assert "reward_not_heldout" in [f["code"] for f in doctor_findings(going) or []]
