"""Helpers shared by the tests, importable as `support.*` (pytest puts tests/ on sys.path for the
root conftest.py): classes spawned as actors (`actor_classes`), the engine side of the transport
tests (`weights`), reward functions named in configs by their dotted path
(`support.rewards:...`, `support.fault_rewards:...` which inject faults, `support.scoring_helpers:...`),
synthetic span logs (`timelines`), a two-role environment (`support.two_role_env:Duel`), an HTTP
server around an engine (`served`), the runner of the real CLI and the `--set` arguments it takes
(`cli`), and a Ray cluster of several nodes on loopback addresses (`cluster`, checked by `loopback`).

Processes that do not inherit this process's sys.path (subprocesses, Ray workers) find `support`
and this checkout's sources through `child_env()` / `PYTHONPATH`."""

from __future__ import annotations

import os
import sys
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parents[1]
ROOT = TESTS_DIR.parent
SRC_DIR = ROOT / "src"
EXAMPLES_DIR = ROOT / "examples"
PYTHONPATH = os.pathsep.join([str(SRC_DIR), str(TESTS_DIR)])


def child_env(**extra: str) -> dict[str, str]:
    """os.environ with PYTHONPATH = this checkout's src (first: the venv's editable install may point
    at another checkout) and tests/ (for `support.*` named in configs), plus `extra`."""
    return {**os.environ, "PYTHONPATH": PYTHONPATH, **extra}


def api_agent_command(run_dir: Path, groups_in_flight: int, eval_rows: int, max_s: float, wait_s: float) -> list[str]:
    """The command line of examples/api_agent/agent.py (the official openai client, nothing of
    nonstop) against the run in `run_dir`: it waits up to `wait_s` for the run's endpoint.json,
    trains for `max_s` at most, then prints its held-out score on `eval_rows` numbers."""
    return [
        sys.executable,
        str(EXAMPLES_DIR / "api_agent" / "agent.py"),
        *("--run-dir", str(run_dir), "--groups-in-flight", str(groups_in_flight)),
        *("--eval-rows", str(eval_rows), "--max-seconds", str(max_s), "--wait-s", str(wait_s)),
    ]
