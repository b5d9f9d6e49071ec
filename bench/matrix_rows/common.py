"""What every row of the real-model matrix shares: the recipe's files, the small run's overrides,
the `nonstop` command line, a run's records, and the evidence every training row checks (weights
equal between the trainer and its engines)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from support import PYTHONPATH
from support.cli import sets

ROOT = Path(__file__).resolve().parents[2]

RECIPE = ROOT / "examples" / "smollm2" / "recipe.yaml"
TRAIN_ROWS = ROOT / "examples" / "smollm2" / "train.jsonl"
HELDOUT_ROWS = ROOT / "examples" / "smollm2" / "heldout.jsonl"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
STEPS = 3
HELDOUT = 4
"""Held-out rows each run evaluates (base and final): the bench checks paths, not accuracy."""
SMALL = {
    "rollout.prompts_per_step": 4,
    "rollout.group_size": 4,
    "rollout.max_new_tokens": 32,
    "rollout.filter_uniform_reward": "false",
    "run.max_steps": STEPS,
    "run.max_total_s": "null",
    "run.eval_every": 100,
    "checkpoint.every_steps": "null",
    "transport.checksum": "true",
}


class RowFailed(Exception):
    """A command of the row failed: the row is ok=no with this reason."""


@dataclass
class Row:
    path: str
    ok: bool
    evidence: str
    keys: dict[str, object] = field(default_factory=dict)


@dataclass
class Ctx:
    folder: Path
    model: Path
    heldout: Path
    cache: dict[str, object] = field(default_factory=dict)


def cli(
    args: list[str],
    cwd: Path,
    python: Path | None = None,
    watch: Callable[[subprocess.Popen], None] | None = None,
    log: Path | None = None,
) -> tuple[int, str]:
    """`python -m nonstop.cli *args` in `cwd` on this checkout's sources; (exit code, output).
    `watch(proc)` runs in a thread while the command runs (to signal it)."""
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
    exe = str(python or sys.executable)
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(
            [exe, "-m", "nonstop.cli", *args], cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT
        )
        watcher = threading.Thread(target=watch, args=(proc,), daemon=True) if watch else None
        if watcher:
            watcher.start()
        rc = proc.wait()
        if watcher:
            watcher.join(timeout=30)
        out.seek(0)
        text = out.read()
    if log is not None:
        log.write_text(text)
    return rc, text


def train(ctx: Ctx, name: str, extra: dict[str, object], python: Path | None = None, **kw) -> tuple[dict, Path, str]:
    """One small run of the recipe with `extra` on top; (summary, run folder, output). Fails the row
    on a non-zero exit."""
    overrides = {
        "model.path": ctx.model,
        "task.dataset_path": TRAIN_ROWS,
        "task.eval_path": ctx.heldout,
        "run.out_dir": ctx.folder / "runs",
        "run.name": name,
        "run.progress": "plain",
        **SMALL,
        **extra,
    }
    rc, out = cli(["train", str(RECIPE), *sets(overrides)], ctx.folder, python, log=ctx.folder / f"{name}.log", **kw)
    run_dir = ctx.folder / "runs" / name
    if rc != 0:
        raise RowFailed(f"`nonstop train` exited {rc}: {tail(out)}")
    return json.loads((run_dir / "summary.json").read_text()), run_dir, out


def tail(text: str, lines: int = 3) -> str:
    kept = [line.strip() for line in text.strip().splitlines() if line.strip()][-lines:]
    return " / ".join(kept)[-400:]


def records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def steps_of(run_dir: Path) -> list[dict]:
    return [r for r in records(run_dir) if "completions_crc32" in r]


def spans(run_dir: Path, actor: str) -> list[dict]:
    path = run_dir / "spans" / f"{actor}.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def weights_equal(summary: dict) -> tuple[bool, str]:
    """Every engine's weights crc equals the trainer's, at the run's last policy version."""
    w = summary.get("weights_crc32")
    if not w:
        return False, "no weights_crc32 in summary.json"
    trainer, engines = w["trainer"], w["engines"]
    ok = bool(engines) and all(e == trainer for e in engines) and trainer[0] == summary["policy_version"]
    return ok, f"weights crc trainer v{trainer[0]} {trainer[1]:08x} {'==' if ok else '!='} {len(engines)} engine(s)"


def mixed_groups(run_dir: Path) -> tuple[int, int]:
    """(groups whose tokens span two policy versions, groups) from the orchestrator's span log."""
    vs = [tuple(e["v"]) for e in spans(run_dir, "orchestrator") if e.get("ev") == "group" and e.get("v")]
    return sum(a != b for a, b in vs), len(vs)


def lag_range(run_dir: Path) -> tuple[int, int]:
    lags = [int(k) for r in steps_of(run_dir) for k in r["lag_hist"]]
    return min(lags), max(lags)


def base_row(path: str, summary: dict, run_dir: Path, extra_ok: bool, extra: str, **keys) -> Row:
    w_ok, w_text = weights_equal(summary)
    ok = w_ok and extra_ok and summary["steps"] == keys.pop("steps", STEPS)
    return Row(path, ok, f"{summary['steps']} steps; {w_text}; {extra}", {"crc_equal": int(w_ok), **keys})
