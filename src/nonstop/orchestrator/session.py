"""One session of a run in this process, torch and all: the checks before its folder exists, then
the run itself (orchestrator/launch.py's `run_training` makes the folder, holds its lock and
records a failure; it imports this module only once a run starts, so the command line starts
without torch).

- `check_engine(cfg)`: vLLM's own checks (`engine.kind: vllm`), before any warm-up;
- `preflight(cfg, reward)`: a model path, a reward or an environment's roles that cannot work is
  a ConfigError naming the field, before the run folder is made;
- `run_session(...)`: the memory plan and the dataset's report logged, the base policy prepared
  (models/base_policy.py) or, on resume, the newest intact checkpoint found and the records after
  it set aside; the pipeline (pipeline.train) under the progress display; summary.json written.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace
from pathlib import Path

from rich.console import Console

from nonstop.checkpoint import latest_valid
from nonstop.config import Config
from nonstop.config.preflight import resolve_model_path
from nonstop.engine.vllm.setup import preflight as vllm_preflight
from nonstop.envs.registry import env_factory
from nonstop.models.base_policy import prepare_base_model
from nonstop.observe.consumed import DROPPED, TRAINED, rolled_back_name
from nonstop.observe.consumed import restore as restore_record
from nonstop.orchestrator.fit import Fitted
from nonstop.orchestrator.modes.own_policies.policy_build import check_roles
from nonstop.orchestrator.pipeline import train
from nonstop.orchestrator.progress import Progress
from nonstop.orchestrator.records import RunSummary
from nonstop.orchestrator.recovery import ROLLED_BACK, set_aside_rolled_back
from nonstop.runtime.oom import remember_plan
from nonstop.scoring.rewards import RewardFn, check_reward
from nonstop.tasks.data import TaskData


def check_engine(cfg: Config) -> None:
    """vLLM's checks (installed, memory, the model's architecture) for `engine.kind: vllm`."""
    if cfg.engine.kind == "vllm":
        vllm_preflight(cfg.model.path, cfg.engine.vllm)


def preflight(cfg: Config, reward: RewardFn | None) -> None:
    """ConfigError naming the field for a model path or a reward that cannot work."""
    if cfg.model.path is not None:
        resolve_model_path(cfg.model.path)
    if reward is None:
        check_reward(cfg.task.reward)
    if cfg.task.eval_reward is not None:
        check_reward(cfg.task.eval_reward, "task.eval_reward")
    if cfg.env is not None and cfg.env.policies:
        check_roles(cfg, tuple(env_factory(cfg.env.name, "env.name", cfg.env)().roles))
        for role, own in cfg.env.policies.items():
            if own.path is not None:
                resolve_model_path(own.path, field=f"env.policies.{role}.path")


def run_session(
    fitted: Fitted,
    console: Console,
    run_dir: Path,
    resume_dir: Path | None,
    data: TaskData,
    reward: RewardFn | None,
    t0: float,
) -> RunSummary:
    """The run in its folder, its config fitted: the plan and the dataset's report logged, the base
    policy prepared (or, on resume, the newest intact checkpoint and the records after it set
    aside), the pipeline run under the progress display, summary.json written."""
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
