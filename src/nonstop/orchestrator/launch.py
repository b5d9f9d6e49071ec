"""From a validated config to a finished run: the one path shared by `nonstop train` and `nonstop.train()`.

`run_training(cfg, console)` makes the run folder (config.yaml), loads the task, and hands the
run to session.py, which prepares the base policy, runs the pipeline (pipeline.train) under the
progress display (run.progress) and writes summary.json; it returns the typed `RunSummary`. This
module stays light (the command line imports it): session.py, which loads torch, is imported
only once a run starts. With `resume_dir` it continues that
run from its newest intact checkpoint instead. The Python API (nonstop/api.py) passes its own
`data` (rows given in Python, already split) and `reward` (a Python callable); the CLI passes
neither and the task section of the config decides both. Errors propagate: the caller decides
how to show them (the CLI prints one line and exits; the API raises).

Before the run folder is made, `session.preflight` checks what can be checked cheaply (model.path,
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

import contextlib
import fcntl
import os
import signal
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from nonstop.config import Config, ConfigError, dump_config
from nonstop.envs.registry import builtin_task
from nonstop.errors import RunInterrupted
from nonstop.scoring.rewards import RewardFn
from nonstop.tasks.data import TaskData, load_task

if TYPE_CHECKING:
    from rich.console import Console

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


def record_failure(run_dir: Path, error: BaseException) -> None:
    """Say in the run folder why the run stopped and whether it can be resumed."""
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
    # start-up: the pipeline's modules load torch; the command line and nonstop.train() import this one first
    from nonstop.orchestrator import fit, session

    session.check_engine(cfg)  # before the warm-up, not after it
    if resume_dir is not None and (data is not None or reward is not None):
        raise ConfigError("resume: a resumed run uses the task and reward of its own config.yaml")
    t0 = time.perf_counter()
    if resume_dir is None:
        session.preflight(cfg, reward)
        rows = run_rows(cfg, data)
        fitted = fit.fit_run(cfg, rows)  # a run that cannot fit is refused here, before its folder exists
        run_dir = make_run_dir(cfg).resolve()  # absolute: actors on other nodes do not share our cwd
    else:
        run_dir = resume_dir.resolve()
    with run_dir_lock(run_dir):  # before anything is written into the folder
        if resume_dir is None:
            (run_dir / "config.yaml").write_text(dump_config(cfg))  # unresolved: a resume resolves again
        else:
            (run_dir / FAILED).unlink(missing_ok=True)
            rows = run_rows(cfg, data)
            fitted = fit.fit_run(cfg, rows)
        try:
            return session.run_session(fitted, console, run_dir, resume_dir, rows, reward, t0)
        except BaseException as e:
            record_failure(run_dir, e)
            raise
