"""The real CLI (`nonstop ...`) run as a subprocess on this checkout's sources, its run records, and
`sets()`, which writes config overrides as the CLI's `--set` arguments (benches import it too)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

from support import child_env

NONSTOP = str(Path(sys.executable).parent / "nonstop")


def sets(overrides: Mapping[str, object] | Iterable[str]) -> list[str]:
    """`["--set", "key=value", ...]` for each override, in order. A mapping's str value is the text
    after `=` as a user types it (the config loader reads it as YAML: "[0,1]" is a list, "1e-4" a
    float; spaces and commas stay, since each argument reaches the CLI whole). True and False are
    written `true` and `false`, None `null`, anything else with str(). An iterable of strings is
    taken as "key=value" texts already written (overrides a bench passes on)."""
    if isinstance(overrides, str):
        raise TypeError(f"sets() takes a mapping or a list of 'key=value' texts, not the string {overrides!r}")
    if isinstance(overrides, Mapping):
        items = [f"{key}={_text(value)}" for key, value in overrides.items()]
    else:
        items = list(overrides)
    return [arg for item in items for arg in ("--set", item)]


def _text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return str(value)


def nonstop(args: list[str], cwd: Path, timeout_s: float = 600) -> subprocess.CompletedProcess:
    """Run `nonstop *args` in `cwd` with PYTHONPATH = this checkout's src and tests/ (`support.*`)."""
    env = child_env(COLUMNS="200")
    return subprocess.run([NONSTOP, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)


def small_model_args(tiny_dir: Path) -> list[str]:
    return sets({"model.path": tiny_dir, "warmup.enabled": False, "run.progress": "plain"})


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
