"""The real CLI (`nonstop ...`) run as a subprocess on this checkout's sources, and its run records."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from support import child_env

NONSTOP = str(Path(sys.executable).parent / "nonstop")


def nonstop(args: list[str], cwd: Path, timeout_s: float = 600) -> subprocess.CompletedProcess:
    """Run `nonstop *args` in `cwd` with PYTHONPATH = this checkout's src and tests/ (`support.*`)."""
    env = child_env(COLUMNS="200")
    return subprocess.run([NONSTOP, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)


def small_model_args(tiny_dir: Path) -> list[str]:
    return ["--set", f"model.path={tiny_dir}", "--set", "warmup.enabled=false", "--set", "run.progress=plain"]


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
