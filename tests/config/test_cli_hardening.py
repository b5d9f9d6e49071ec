"""`nonstop train` and friends against a new user's mistakes and a hard stop, with real processes:
each mistake is one clear line, fast, with nothing left behind; SIGTERM and a killed trainer
leave no actor process and no shared memory behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from nonstop.config import TaskConfig
from nonstop.tasks.data import DatasetError, load_task
from support import child_env
from support.cli import NONSTOP, nonstop, sets, small_model_args


def _children(pid: int) -> list[int]:
    """Every live descendant of `pid`, from /proc."""
    parent_of = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent_of[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent_of.items() if pp == p]
        found += kids
        frontier += kids
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_version():
    out = subprocess.run(
        [NONSTOP, "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
    )
    assert out.returncode == 0 and out.stdout.startswith("nonstop 0.")


@pytest.mark.parametrize(
    "model, words",
    [
        ("does/not/exist", "model.path: no such folder: does/not/exist"),
        ("EMPTY", "holds no config.json (empty)"),
        ("someorg/some-model", "offline mode is on"),
    ],
)
def test_bad_model_paths_fail_fast_with_one_line_and_no_run_folder(tmp_path, model, words):
    if model == "EMPTY":
        model = str(tmp_path / "empty")
        (tmp_path / "empty").mkdir()
    t0 = time.perf_counter()
    env_offline = {"HF_HUB_OFFLINE": "1"}
    os.environ.update(env_offline)
    try:
        result = nonstop(["train", *sets({"model.path": model, "run.progress": "plain"})], cwd=tmp_path, timeout_s=120)
    finally:
        for k in env_offline:
            os.environ.pop(k)
    took_s = time.perf_counter() - t0
    assert result.returncode == 2 and words in result.stdout and "Traceback" not in result.stdout + result.stderr, (
        result
    )
    assert took_s < 60, took_s  # imports only, on a loaded machine; nothing is spawned
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_hub_id_without_network_stops_on_ctrl_c(tmp_path):
    env = child_env(HF_HUB_OFFLINE="0")
    proc = subprocess.Popen(
        [NONSTOP, "train", *sets({"model.path": "someorg/some-model", "run.progress": "plain"})],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    time.sleep(8)  # imports, then the hub lookup retrying against no network
    proc.send_signal(signal.SIGINT)
    t0 = time.perf_counter()
    out = proc.communicate(timeout=30)[0]
    assert time.perf_counter() - t0 < 10, out
    assert proc.returncode in (1, 2, 130), out  # interrupted, or the lookup already failed with its message
    assert "Traceback" not in out, out


@pytest.mark.parametrize(
    "reward, words",
    [
        ("exact_matc", "task.reward: unknown reward 'exact_matc'"),
        ("my_pkg.rewards:score", "task.reward: cannot import 'my_pkg.rewards:score'"),
    ],
)
def test_bad_reward_is_refused_before_any_actor_starts(tiny_dir, tmp_path, reward, words):
    t0 = time.perf_counter()
    result = nonstop(
        ["train", *small_model_args(tiny_dir), *sets({"task.reward": reward})], cwd=tmp_path, timeout_s=120
    )
    assert result.returncode == 2 and words in result.stdout, result
    assert "starting" not in result.stdout and time.perf_counter() - t0 < 60
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_on_bad_row_error_does_not_say_skipped(tmp_path):
    rows = [json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) for i in range(20)]
    rows.insert(2, json.dumps({"prompt": "1+1="}))
    (tmp_path / "d.jsonl").write_text("\n".join(rows) + "\n")
    with pytest.raises(DatasetError) as e:
        load_task(TaskConfig(name="jsonl", dataset_path=str(tmp_path / "d.jsonl"), on_bad_row="error"))
    assert "d.jsonl:3: missing field(s) answer" in str(e.value) and "skipped" not in str(e.value)


def test_a_failure_message_with_brackets_is_printed_as_it_is(tmp_path):
    """An error naming a path or a C++ source location in brackets (gloo's '[/.../pair.cc:537]')
    is shown as one line, not turned into a traceback by the console's markup."""
    missing = tmp_path / "[/oops]" / "d.jsonl"
    result = nonstop(
        ["train", *sets({"task.name": "jsonl", "task.dataset_path": missing, "run.progress": "plain"})],
        cwd=tmp_path,
        timeout_s=120,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"run failed: dataset file not found: {missing}" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr


def test_a_config_error_is_one_line(tmp_path):
    """A config error is one line naming the field, exit status 2, no traceback."""
    result = nonstop(["train", *sets({"buffer.depht": 2})], cwd=tmp_path, timeout_s=120)
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert result.returncode == 2, result
    assert lines == ["invalid config: buffer.depht: unknown field (did you mean 'depth'?)"], result


def test_an_error_no_command_handles_is_one_line(tmp_path):
    """`nonstop warmup` leaves a DatasetError to the command group, which catches NonstopError:
    one line on stderr, exit status 1, no traceback, no output folder."""
    args = ["warmup", *sets({"task.name": "jsonl", "task.dataset_path": "missing.jsonl"}), "--out", "out"]
    result = nonstop(args, cwd=tmp_path, timeout_s=120)
    assert result.returncode == 1 and not result.stdout, result
    assert result.stderr.strip().splitlines() == ["nonstop warmup: dataset file not found: missing.jsonl"], result
    assert not (tmp_path / "out").exists()


def test_held_out_split_is_explicit_and_said(tmp_path):
    rows = [json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) for i in range(201)]
    (tmp_path / "d.jsonl").write_text("\n".join(rows) + "\n")
    (tmp_path / "e.jsonl").write_text("\n".join(rows[:7]) + "\n")
    path = str(tmp_path / "d.jsonl")
    data = load_task(TaskConfig(name="jsonl", dataset_path=path))
    assert (
        len(data.eval) == 100 and "held out 100 of 201 rows (task.eval_size=500, capped at half" in data.report.held_out
    )
    data = load_task(TaskConfig(name="jsonl", dataset_path=path, eval_size=20))
    assert (len(data.train), len(data.eval)) == (181, 20) and "capped" not in data.report.held_out
    data = load_task(TaskConfig(name="jsonl", dataset_path=path, eval_fraction=0.05))
    assert len(data.eval) == 10 and "task.eval_fraction=0.05" in data.report.held_out
    data = load_task(TaskConfig(name="jsonl", dataset_path=path, eval_path=str(tmp_path / "e.jsonl")))
    assert (len(data.train), len(data.eval)) == (201, 7) and "all 201 dataset rows train" in data.report.held_out
    assert len({ex.index for ex in data.train + data.eval}) == 208
    with pytest.raises(ValueError, match="eval_path"):
        TaskConfig(name="addition", eval_path=str(tmp_path / "e.jsonl"))


def _start_run(tiny_dir, tmp_path, name, *extra):
    env = child_env(PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [
            NONSTOP,
            "train",
            *small_model_args(tiny_dir),
            *sets(
                {
                    "run.name": name,
                    "run.max_steps": 100000,
                    "run.max_time_s": None,
                    "task.eval_size": 10,
                    "rollout.filter_uniform_reward": False,
                }
            ),
            *extra,
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_for_line(proc, words, timeout_s=240):
    lines, deadline = [], time.monotonic() + timeout_s
    for line in proc.stdout:
        lines.append(line)
        if words in line or time.monotonic() > deadline:
            break
    assert any(words in line for line in lines), "".join(lines)
    return lines


def _segments(pids: list[int]) -> set[str]:
    """The nonstop shared-memory segments these processes have mapped (other runs may share /dev/shm)."""
    names = set()
    for pid in pids:
        try:
            names |= {
                line.split("/dev/shm/")[1].split()[0]
                for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
                if "/dev/shm/nonstop_" in line
            }
        except OSError:
            continue
    return names


def _gone(segments: set[str]) -> bool:
    return not any((Path("/dev/shm") / name).exists() for name in segments)


@pytest.mark.slow  # a real training run (1-4 min on a loaded 2-core machine)
def test_sigterm_stops_every_actor_and_actors_are_named_by_role(tiny_dir, tmp_path):
    proc = _start_run(tiny_dir, tmp_path, "term")
    try:
        _wait_for_line(proc, "base policy held-out ")
        time.sleep(2)  # training under way
        kids = [p for p in _children(proc.pid) if _alive(p)]
        segments = _segments(kids)
        assert segments  # the shm transport's segment, mapped by the trainer and the engine
        names = {Path(f"/proc/{p}/comm").read_text().strip() for p in kids}
        assert {"nonstop-engine", "nonstop-trainer"} <= names, names  # what top shows
        cmdlines = {Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip() for p in kids}
        try:
            import setproctitle  # noqa: F401  # optional: the whole command line too (ps)

            assert {"nonstop: engine", "nonstop: trainer"} <= cmdlines, cmdlines
        except ImportError:
            pass
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in kids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in kids if _alive(p)], "actors outlived the orchestrator"
    assert "leaked shared_memory" not in out and _gone(segments), out
    assert "was interrupted" in (tmp_path / "runs" / "term" / "FAILED").read_text()


@pytest.mark.slow  # a real training run (1-4 min on a loaded 2-core machine)
def test_killed_orchestrator_takes_its_actors_along(tiny_dir, tmp_path):
    proc = _start_run(tiny_dir, tmp_path, "kill9")
    try:
        _wait_for_line(proc, "base policy held-out ")
        kids = [p for p in _children(proc.pid) if _alive(p)]
        assert kids
        proc.kill()  # SIGKILL: no cleanup code runs in the orchestrator
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in kids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in kids if _alive(p)], "actors outlived a SIGKILLed orchestrator"


@pytest.mark.slow  # a real training run (1-4 min on a loaded 2-core machine)
def test_killed_trainer_leaves_no_segment_and_a_failed_marker(tiny_dir, tmp_path):
    proc = _start_run(
        tiny_dir,
        tmp_path,
        "tk",
        *sets({"task.reward": "support.fault_rewards:kill_trainer_reward", "checkpoint.every_steps": None}),
    )
    try:
        _wait_for_line(proc, "base policy held-out ")
        segments = _segments(_children(proc.pid))
        out = proc.communicate(timeout=400)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert segments and proc.returncode == 1 and "the trainer failed" in out, out
    assert "leaked shared_memory" not in out and _gone(segments), out
    assert "no checkpoint was written" in (tmp_path / "runs" / "tk" / "FAILED").read_text()


@pytest.mark.slow  # a real training run (1-4 min on a loaded 2-core machine)
def test_ctrl_c_writes_a_checkpoint_that_resumes_and_a_second_stops_at_once(tiny_dir, tmp_path):
    proc = _start_run(tiny_dir, tmp_path, "cc", *sets({"checkpoint.every_steps": 100000}))
    try:
        _wait_for_line(proc, "step    1")  # plain progress prints the first step at once
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=180)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "interrupted: stopped at step" in out and "checkpoint step" in out, out
    step = int(out.split("interrupted: stopped at step ")[1].split()[0])
    run_dir = tmp_path / "runs" / "cc"
    assert (run_dir / "checkpoints").is_dir() and "resume with" in (run_dir / "FAILED").read_text()
    result = nonstop(
        ["train", "--resume", str(run_dir), *sets({"run.max_steps": step + 2})], cwd=tmp_path, timeout_s=400
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == step + 2 and summary["prompts"]["duplicated"] == 0, summary
    assert not (run_dir / "FAILED").exists()
    assert "this session (resumed" in result.stdout and "over all sessions" in result.stdout, result.stdout

    proc = _start_run(tiny_dir, tmp_path, "cc2")
    try:
        _wait_for_line(proc, "step    1")
        proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        t0 = time.perf_counter()
        out = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "Traceback" not in out, out
    assert time.perf_counter() - t0 < 60, out


def test_time_budget_ends_a_run_in_which_no_batch_ever_arrives(tiny_dir, tmp_path):
    """Every group has all-equal rewards, so every group is dropped and no batch reaches the trainer:
    `run.max_time_s` still ends the run (it used to wait for a batch forever), with zero steps and
    the drops counted."""
    # max_consecutive_uniform out of reach: the time budget, not the no-signal rule, must end it
    out = nonstop(
        [
            "train",
            *sets(
                {
                    "task.reward": "support.rewards:zero_reward",
                    "run.max_time_s": 4,
                    "run.max_steps": 1000,
                    "checkpoint.every_steps": None,
                    "rollout.max_consecutive_uniform": 100000000,
                    "run.out_dir": tmp_path,
                    "run.name": "flat",
                }
            ),
            *small_model_args(tiny_dir),
        ],
        tmp_path,
        timeout_s=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    s = json.loads((tmp_path / "flat" / "summary.json").read_text())
    assert s["steps"] == 0 and s["drops"]["uniform_reward"] > 0
