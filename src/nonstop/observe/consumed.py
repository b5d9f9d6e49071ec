"""What the trainer consumed and what the buffer dropped, each written by the side that did it.

The orchestrator's prompt ledger is the run's own account of its prompts; a check that reads
only that account can only agree with it. These two append-only files are kept apart from it so
that `nonstop verify` (orchestrator/verify.py) can recount the run from what actually happened:

- `RUN_DIR/trained.jsonl`, written by trainer rank 0 (trainer/worker.py), one line per trainer
  step: `{"step", "version", "skipped", "samples": [[epoch, prompt_index, sample_id, min_version,
  max_version], ...]}`, where `version` is the policy_version after the step and the versions are
  those of the sample's model tokens (-1 when it has none);
- `RUN_DIR/dropped.jsonl`, written by the run's buffer (orchestrator/buffer.py), one line per
  group it dropped: `{"epoch", "prompt_index", "reason", "samples": [sample_id, ...]}`.

Each line is flushed when written. Both files are copied into every checkpoint (the trainer's
from the trainer, the buffer's with the ledger's snapshot), and a resume puts the checkpoint's
copy back (`restore`): the steps after the checkpoint are trained again, so their lines move to
`<name>.rolled_back.jsonl` as they were, and the live file holds each step once.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from nonstop.types import Group, Sample

TRAINED = "trained.jsonl"
DROPPED = "dropped.jsonl"


def model_versions(s: Sample) -> tuple[int, int]:
    """(oldest, newest) policy_version of the sample's model tokens; (-1, -1) when it has none."""
    versions = [v for v, m in zip(s.versions, s.loss_mask) if m]
    return (min(versions), max(versions)) if versions else (-1, -1)


def trained_line(step: int, version: int, skipped: bool, groups: Iterable[Group]) -> dict[str, Any]:
    """The record of one trainer step over `groups`."""
    samples = [[g.epoch, g.prompt_index, s.sample_id, *model_versions(s)] for g in groups for s in g.samples]
    return {"step": step, "version": version, "skipped": skipped, "samples": samples}


def dropped_line(group: Group, reason: str) -> dict[str, Any]:
    """The record of one group (or of some of its episodes) the buffer will not hand to the trainer."""
    return {
        "epoch": group.epoch,
        "prompt_index": group.prompt_index,
        "reason": reason,
        "samples": [s.sample_id for s in group.samples],
    }


def append(path: Path | None, line: dict[str, Any]) -> None:
    """Append one JSON line and flush it; the file is opened per line, so a resume that replaces it
    under a live writer's feet never leaves that writer on the old file. `path` None: no record."""
    if path is None:
        return
    with path.open("a") as f:
        f.write(json.dumps(line, separators=(",", ":")) + "\n")
        f.flush()


def snapshot(path: Path, into: Path) -> None:
    """Copy the record at `path` into the checkpoint folder `into` (an empty file when there is
    none yet: a checkpoint before the first line holds an empty record, not a missing one)."""
    target = into / path.name
    if path.is_file():
        shutil.copyfile(path, target)
    else:
        target.write_text("")


def lines_of(path: Path) -> list[str]:
    """The record's lines (a line cut short by a crash included), without blank ones."""
    if not path.is_file():
        return []
    return [line for line in path.read_text().splitlines() if line.strip()]


def rolled_back_name(name: str) -> str:
    return name.removesuffix(".jsonl") + ".rolled_back.jsonl"


def restore(run_dir: Path, ckpt_dir: Path, name: str) -> int | None:
    """Make RUN_DIR/`name` the checkpoint's copy again; the live file's lines past it move to the
    rolled-back file, appended as they were (all of them when the live file does not start with
    the copy). Returns how many moved, or None when the checkpoint holds no copy (a checkpoint
    written before these records existed): the live file is then left as it is. The side file is
    written and synced before the live file is replaced, so a crash repeats lines, never loses one."""
    saved = ckpt_dir / name
    if not saved.is_file():
        return None
    kept = lines_of(saved)
    live = run_dir / name
    now = lines_of(live)
    moved = now[len(kept) :] if now[: len(kept)] == kept else now
    if moved:
        with (run_dir / rolled_back_name(name)).open("a") as f:
            f.writelines(line + "\n" for line in moved)
            f.flush()
            os.fsync(f.fileno())
    tmp = live.with_name(f".{name}.tmp")
    with tmp.open("w") as f:
        f.writelines(line + "\n" for line in kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, live)
    return len(moved)
