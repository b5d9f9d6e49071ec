"""A run folder takes one run at a time (orchestrator/launch.py `run_dir_lock`): a second
`nonstop train --resume DIR` while one runs is refused with one line, and a crashed holder leaves
no stale lock."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from nonstop.config import ConfigError, dump_config, load_config
from nonstop.orchestrator.launch import LOCK, run_dir_lock
from support import child_env
from support.cli import NONSTOP, nonstop, records, sets, small_model_args

HOLD = """
import sys, time
from pathlib import Path
from nonstop.orchestrator.launch import run_dir_lock
with run_dir_lock(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_resume_into_a_folder_in_use_is_refused_and_a_crash_releases_it(tiny_dir, tmp_path):
    run_dir = tmp_path / "runs" / "busy"
    run_dir.mkdir(parents=True)
    config = dump_config(load_config(None, [f"model.path={tiny_dir}", "run.name=busy"]))
    (run_dir / "config.yaml").write_text(config)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True, env=child_env()
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        result = nonstop(["train", "--resume", str(run_dir)], cwd=tmp_path, timeout_s=120)
        out = result.stdout + result.stderr
        assert result.returncode == 2, out
        assert f"is in use by another nonstop run (pid {holder.pid})" in out and "Traceback" not in out, out
        assert not (run_dir / "FAILED").exists() and (run_dir / "config.yaml").read_text() == config
        with pytest.raises(ConfigError, match="in use"):  # in this process too (the Python API's path)
            with run_dir_lock(run_dir):
                pass
        holder.send_signal(signal.SIGKILL)  # a crash: no cleanup code runs
        holder.wait(30)
    finally:
        if holder.poll() is None:
            holder.kill()
    with run_dir_lock(run_dir):  # the kernel dropped the dead holder's lock
        assert (run_dir / LOCK).read_text().strip() == str(os.getpid())


@pytest.mark.slow  # a real run, then two real resumes of it at once (1-3 min)
def test_two_resumes_at_once_one_runs_one_is_refused(tiny_dir, tmp_path):
    args = [*small_model_args(tiny_dir), *sets({"task.eval_size": 10, "rollout.filter_uniform_reward": False})]
    first = nonstop(["train", *args, *sets({"run.name": "twice", "run.max_steps": 2})], cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    run_dir = tmp_path / "runs" / "twice"
    resume = [NONSTOP, "train", "--resume", str(run_dir), *sets({"run.max_steps": 6, "run.progress": "plain"})]
    procs = [
        subprocess.Popen(
            resume,
            cwd=tmp_path,
            env=child_env(COLUMNS="200"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], outs
    refused = outs[[p.returncode for p in procs].index(2)]
    assert "is in use by another nonstop run" in refused and "Traceback" not in refused, refused
    steps = [r["step"] for r in records(run_dir)]
    assert steps == list(range(1, 7)), steps  # each step recorded once
    assert json.loads((run_dir / "summary.json").read_text())["prompts"]["duplicated"] == 0
