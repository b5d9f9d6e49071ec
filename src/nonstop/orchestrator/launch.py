"""From a validated config to a finished run: the one path shared by `nonstop train` and `nonstop.train()`.

`run_training(cfg, console)` makes the run folder (config.yaml), loads the task, prepares the
base policy, runs the pipeline (pipeline.train) under the progress display (run.progress) and
writes summary.json; it returns the typed `RunSummary`. With `resume_dir` it continues that
run from its newest intact checkpoint instead. The Python API (nonstop/api.py) passes its own
`data` (rows given in Python, already split) and `reward` (a Python callable); the CLI passes
neither and the task section of the config decides both. Errors propagate: the caller decides
how to show them (the CLI prints one line and exits; the API raises).

Before the run folder is made, `preflight` checks what can be checked cheaply (model.path,
task.reward), and `fit_run` (orchestrator/fit.py) resolves the defaults that follow from the run's
need and refuses a run whose memory plan does not fit, so a mistake leaves nothing behind. The
plan is printed at start-up and written to the run folder (memory_plan.json). A run that fails
later leaves a FAILED file in its folder saying why and whether it can be resumed (removed when
it is resumed).

A run holds its folder's lock (`run.lock`, an flock) from the moment the folder is made or chosen
for a resume until it returns, so a second run into the same folder (a resume of a run still
going, two resumes at once) is refused with one line naming the holder's pid; the kernel drops the
lock when the process ends, however it ends, so a crash leaves no stale lock.

`sigterm_as_ctrl_c` is the command line's SIGTERM handler (`nonstop train`, and `nonstop serve`
while it loads): a killed run stops the way an interrupted one does.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from nonstop.checkpoint import latest_valid
from nonstop.config import Config, ConfigError, dump_config
from nonstop.config.preflight import resolve_model_path
from nonstop.envs.registry import builtin_task, env_factory
from nonstop.observe.consumed import DROPPED, TRAINED, rolled_back_name
from nonstop.observe.consumed import restore as restore_record
from nonstop.orchestrator.progress import Progress
from nonstop.runtime.oom import remember_plan
from nonstop.scoring.rewards import RewardFn, check_reward
from nonstop.tasks.data import TaskData, load_task

if TYPE_CHECKING:
    from rich.console import Console

    from nonstop.orchestrator.fit import Fitted
    from nonstop.orchestrator.records import RunSummary


def make_run_dir(cfg: Config) -> Path:
    """A new, empty run folder under run.out_dir (named run.name, or a timestamp)."""
    name = cfg.run.name or datetime.now().strftime("%Y%m%d-%H%M%S")
    path = Path(cfg.run.out_dir) / name
    if path.exists() and any(path.iterdir()):
        raise ConfigError(f"run.name: run folder {path} already exists and is not empty; pick another name")
    path.mkdir(parents=True, exist_ok=True)
    return path


FAILED = "FAILED"
LOCK = "run.lock"


@contextlib.contextmanager
def run_dir_lock(run_dir: Path) -> Iterator[None]:
    """Hold `run_dir`'s lock while the body runs; ConfigError when another process holds it."""
    fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by the actors (O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise ConfigError(
                f"run folder {run_dir} is in use by another nonstop run (pid {holder}); wait for it to end "
                "or stop it, then resume"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def preflight(cfg: Config, reward: RewardFn | None) -> None:
    """ConfigError naming the field for a model path or a reward that cannot work."""
    if cfg.model.path is not None:
        resolve_model_path(cfg.model.path)
    if reward is None:
        check_reward(cfg.task.reward)
    if cfg.task.eval_reward is not None:
        check_reward(cfg.task.eval_reward, "task.eval_reward")
    if cfg.env is not None and cfg.env.policies:
        # start-up: the pipeline's modules load torch; the command line and nonstop.train() import this one first
        from nonstop.orchestrator.policy_build import check_roles

        check_roles(cfg, tuple(env_factory(cfg.env.name, "env.name", cfg.env)().roles))
        for role, own in cfg.env.policies.items():
            if own.path is not None:
                resolve_model_path(own.path, field=f"env.policies.{role}.path")


def record_failure(run_dir: Path, error: BaseException) -> None:
    """Say in the run folder why the run stopped and whether it can be resumed."""
    # start-up: the pipeline's modules load torch; the command line and nonstop.train() import this one first
    from nonstop.orchestrator.recovery import RunInterrupted

    what = (
        "was interrupted"
        if isinstance(error, (KeyboardInterrupt, RunInterrupted))
        else f"failed: {type(error).__name__}: {error}"
    )
    has_ckpt = (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir())
    hint = (
        f"resume with `nonstop train --resume {run_dir}`" if has_ckpt else "no checkpoint was written: start it again"
    )
    (run_dir / FAILED).write_text(f"this run {what}\n{hint}\n")


def sigterm_as_ctrl_c(signum: int, frame: FrameType | None) -> None:
    """SIGTERM (kill, a scheduler) takes the Ctrl-C path, which stops the actors and frees what the
    run holds, whether or not SIGINT is ignored (a background job's is)."""
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler) and handler is not signal.default_int_handler:
        handler(signal.SIGINT, frame)  # asyncio.run's: cancel the run's task, its cleanup runs
    else:
        raise KeyboardInterrupt


def run_rows(cfg: Config, data: TaskData | None = None) -> TaskData:
    """The rows a run trains and evaluates on: `data` when given, else a built-in environment's
    own rows, else the task's (a custom environment plays the task's rows)."""
    if data is None and cfg.env is not None:
        data = builtin_task(cfg.env)
    return data if data is not None else load_task(cfg.task)


def run_training(
    cfg: Config,
    console: Console,
    resume_dir: Path | None = None,
    *,
    data: TaskData | None = None,
    reward: RewardFn | None = None,
) -> RunSummary:
    """Everything `nonstop train` does after parsing: data, base policy, pipeline, summary.

    `data` replaces the task the config names (its report's problems are shown like a JSONL
    file's); `reward` replaces task.reward. Neither may come with `resume_dir`: a resumed run
    reads its task from its own config.yaml."""
    if cfg.engine.kind == "vllm":
        # start-up: the pipeline's modules load torch; the command line and nonstop.train() import this one first
        from nonstop.engine.vllm.setup import preflight as vllm_preflight

        vllm_preflight(cfg.model.path, cfg.engine.vllm)  # before the warm-up, not after it
    if resume_dir is not None and (data is not None or reward is not None):
        raise ConfigError("resume: a resumed run uses the task and reward of its own config.yaml")
    t0 = time.perf_counter()
    # start-up: the pipeline's modules load torch; the command line and nonstop.train() import this one first
    from nonstop.orchestrator.fit import fit_run

    if resume_dir is None:
        preflight(cfg, reward)
        rows = run_rows(cfg, data)
        fitted = fit_run(cfg, rows)  # a run that cannot fit is refused here, before its folder exists
        run_dir = make_run_dir(cfg).resolve()  # absolute: actors on other nodes do not share our cwd
    else:
        run_dir = resume_dir.resolve()
    with run_dir_lock(run_dir):  # before anything is written into the folder
        if resume_dir is None:
            (run_dir / "config.yaml").write_text(dump_config(cfg))  # unresolved: a resume resolves again
        else:
            (run_dir / FAILED).unlink(missing_ok=True)
            rows = run_rows(cfg, data)
            fitted = fit_run(cfg, rows)
        try:
            return _run(fitted, console, run_dir, resume_dir, rows, reward, t0)
        except BaseException as e:
            record_failure(run_dir, e)
            raise


def _run(
    fitted: Fitted,
    console: Console,
    run_dir: Path,
    resume_dir: Path | None,
    data: TaskData,
    reward: RewardFn | None,
    t0: float,
) -> RunSummary:
    # start-up: the pipeline's modules load torch; the command line and nonstop.train() import this one first
    from nonstop.models.base_policy import prepare_base_model
    from nonstop.orchestrator.pipeline import train
    from nonstop.orchestrator.recovery import ROLLED_BACK, set_aside_rolled_back

    cfg = fitted.cfg  # need-dependent defaults resolved (sizing/defaults.py)
    with Progress(cfg.run.progress, cfg.run.max_steps, console) as progress:
        for line in (*fitted.plan.notes, *fitted.plan.table()):
            progress.log(line)
        (run_dir / "memory_plan.json").write_text(json.dumps(fitted.plan.to_dict(), indent=2))
        remember_plan(fitted.plan.planned)
        for problem in data.report.problems:
            progress.log(f"[yellow]dataset:[/] {problem}; row skipped")
        if data.report.rows_skipped:
            progress.log(f"dataset: {data.report.rows_skipped} of {data.report.rows_read} rows skipped")
        if data.report.held_out:
            progress.log(f"dataset: {data.report.held_out}")
        progress.log(f"run folder: {run_dir}; {len(data.train)} train / {len(data.eval)} held-out prompts")
        ckpt = None
        if resume_dir is None:
            base = prepare_base_model(cfg, data, progress.log)
        else:
            ckpt = latest_valid(run_dir / "checkpoints", report=lambda m: progress.log(f"[yellow]{m}[/]"))
            base = Path(ckpt.state["base_model"])
            moved = set_aside_rolled_back(run_dir, ckpt.step)
            if moved:
                progress.log(
                    f"metrics.jsonl: {moved} lines after step {ckpt.step} (those steps are trained again) "
                    f"moved to {ROLLED_BACK}"
                )
            for name in (TRAINED, DROPPED):
                moved_lines = restore_record(run_dir, ckpt.path, name)
                if moved_lines:
                    progress.log(
                        f"{name}: {moved_lines} lines after step {ckpt.step} moved to {rolled_back_name(name)}"
                    )
        base = base.resolve()  # every path an actor opens is absolute: a Ray worker's cwd is its node's
        warmup_s = time.perf_counter() - t0
        try:
            summary = asyncio.run(train(cfg, base, data, run_dir, progress, resume=ckpt, reward=reward, started_s=t0))
        except asyncio.CancelledError:  # a second Ctrl-C cancelled the run's task
            raise KeyboardInterrupt from None
        finally:
            remember_plan(None)
    summary = replace(
        summary, wall_s=time.perf_counter() - t0, warmup_s=warmup_s, dataset_rows_skipped=data.report.rows_skipped
    )
    (run_dir / "summary.json").write_text(json.dumps(summary.to_dict(), indent=2))
    return summary
