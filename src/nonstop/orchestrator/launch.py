"""From a validated config to a finished run: the one path shared by `nonstop train` and `nonstop.train()`.

`run_training(cfg, console)` makes the run folder (config.yaml), loads the task, prepares the
base policy, runs the pipeline (pipeline.train) under the progress display (run.progress) and
writes summary.json; it returns the typed `RunSummary`. With `resume_dir` it continues that
run from its newest intact checkpoint instead. The Python API (nonstop/api.py) passes its own
`data` (rows given in Python, already split) and `reward` (a Python callable); the CLI passes
neither and the task section of the config decides both. Errors propagate: the caller decides
how to show them (the CLI prints one line and exits; the API raises).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from nonstop.config import Config, ConfigError, dump_config

if TYPE_CHECKING:
    from rich.console import Console

    from nonstop.orchestrator.records import RunSummary
    from nonstop.orchestrator.score import RewardFn
    from nonstop.tasks.data import TaskData


def make_run_dir(cfg: Config) -> Path:
    """A new, empty run folder under run.out_dir (named run.name, or a timestamp)."""
    name = cfg.run.name or datetime.now().strftime("%Y%m%d-%H%M%S")
    path = Path(cfg.run.out_dir) / name
    if path.exists() and any(path.iterdir()):
        raise ConfigError(f"run.name: run folder {path} already exists and is not empty; pick another name")
    path.mkdir(parents=True, exist_ok=True)
    return path


def run_training(cfg: Config, console: Console, resume_dir: Path | None = None, *,
                 data: TaskData | None = None, reward: RewardFn | None = None) -> RunSummary:
    """Everything `nonstop train` does after parsing: data, base policy, pipeline, summary.

    `data` replaces the task the config names (its report's problems are shown like a JSONL
    file's); `reward` replaces task.reward. Neither may come with `resume_dir`: a resumed run
    reads its task from its own config.yaml."""
    from nonstop.checkpoint import latest_valid
    from nonstop.orchestrator.pipeline import train
    from nonstop.progress import Progress
    from nonstop.tasks.data import load_task
    from nonstop.tasks.base import prepare_base_model

    if resume_dir is not None and (data is not None or reward is not None):
        raise ConfigError("resume: a resumed run uses the task and reward of its own config.yaml")
    t0 = time.perf_counter()
    if resume_dir is None:
        run_dir = make_run_dir(cfg)
        (run_dir / "config.yaml").write_text(dump_config(cfg))
    else:
        run_dir = resume_dir
    if data is None and cfg.env is not None:
        from nonstop.envs.registry import builtin_task

        data = builtin_task(cfg.env)
    if data is None:
        data = load_task(cfg.task)
    with Progress(cfg.run.progress, cfg.run.max_steps, console) as progress:
        for problem in data.report.problems:
            progress.log(f"[yellow]dataset:[/] {problem}")
        if data.report.rows_skipped:
            progress.log(f"dataset: {data.report.rows_skipped} of {data.report.rows_read} rows skipped")
        progress.log(f"run folder: {run_dir}; {len(data.train)} train / {len(data.eval)} held-out prompts")
        ckpt = None
        if resume_dir is None:
            if cfg.env is not None and cfg.model.path is None:
                from nonstop.envs.warmup import env_base

                base = env_base(cfg, progress.log)
            else:
                base = prepare_base_model(cfg, data, progress.log)
        else:
            ckpt = latest_valid(run_dir / "checkpoints", report=lambda m: progress.log(f"[yellow]{m}[/]"))
            base = Path(ckpt.state["base_model"])
        warmup_s = time.perf_counter() - t0
        summary = asyncio.run(train(cfg, base, data, run_dir, progress, resume=ckpt, reward=reward))
    summary = replace(summary, wall_s=time.perf_counter() - t0, warmup_s=warmup_s,
                      dataset_rows_skipped=data.report.rows_skipped)
    (run_dir / "summary.json").write_text(json.dumps(summary.to_dict(), indent=2))
    return summary
