"""One `nonstop train` run as a user types it, for the benchmarks that compare whole jobs.

`train(name, folder, overrides, config=...)` runs the real CLI in a child process (its own
interpreter, so each run starts cold like a user's), writes the run under `folder/runs/<name>`,
and returns the run's `summary.json` with the command's wall time added as `cli_wall_s`. A failed
run stops the benchmark with the tail of its output: a table with a silently missing row would
read as a result.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from support.cli import sets  # noqa: E402


def train(
    name: str,
    folder: Path,
    overrides: list[str],
    config: Path | None = None,
    pythonpath: tuple[Path, ...] = (),
    timeout_s: float | None = None,
) -> dict:
    """Run `nonstop train [config] --set ...` in `folder`; `pythonpath` adds folders a user's reward lives in."""
    paths = [str(ROOT / "src"), *map(str, pythonpath), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    out_dir = folder / "runs"
    args = [
        sys.executable,
        "-m",
        "nonstop.cli",
        "train",
        *([str(config)] if config else []),
        *sets({"run.name": name, "run.out_dir": out_dir, "run.progress": "plain"}),
        *sets(overrides),
    ]
    t0 = time.perf_counter()
    result = subprocess.run(args, cwd=folder, env=env, capture_output=True, text=True, timeout=timeout_s)
    wall_s = time.perf_counter() - t0
    if result.returncode != 0:
        raise SystemExit(
            f"run {name} failed (exit {result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    summary = json.loads((out_dir / name / "summary.json").read_text())
    return {**summary, "cli_wall_s": wall_s}
