"""Orchestrator side of checkpoint and resume: what a run's state is, and how it comes back.

`write_checkpoint(run, step)` has the trainer write its weights and optimizer/RNG state into a
staging folder, adds the orchestrator's state (data cursor, prompt ledger, counters, clock), what
the run's mode keeps (its files and state.json entries: run.py `RunMode`), each engine's sampling
generator state, and a copy of the buffer's record of drops
(observe/consumed.py; the trainer copies its own record of what it trained), and commits it
atomically (checkpoint.py).
The snapshot is taken between two trainer steps:
every group of step <= `step` is settled in the ledger, and every prompt drawn but not yet
settled (generating, or waiting in the buffer) is listed as in flight.

`restore(run, ckpt)` puts that state back into the run's stages and its RunState: the stream
continues from the saved cursor, the in-flight prompts are re-queued ahead of it (so nothing
drawn is lost, and nothing settled is drawn again), counters and the RL clock continue, and the
learning loop starts at step + 1. `restore_engines(run, ckpt)` hands each engine its saved
sampling generator state, so the random stream continues instead of replaying the run's first
draws (token-for-token repetition needs rollout.seed_per_prompt: the noise a completion gets
from a shared stream depends on how requests happened to share decode passes).

`set_aside_rolled_back(run_dir, step)`, before a resumed run opens metrics.jsonl, moves the
records of the steps after its checkpoint (trained again from there) to metrics.rolled_back.jsonl,
so metrics.jsonl holds each step once, the one that counts, and nothing is lost.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import time
from pathlib import Path

from nonstop.checkpoint import Checkpoint, commit, staging_dir
from nonstop.errors import RunError
from nonstop.observe.clock import Clock
from nonstop.observe.consumed import snapshot
from nonstop.orchestrator.run import Run
from nonstop.tasks.data import Draw


class RunFailed(RunError, RuntimeError):
    """The run cannot go on; the message says why and how to resume."""


async def write_checkpoint(run: Run, step: int) -> None:
    """Taken while nothing of the run's mode trains (`RunMode.paused`), so the mode's files and
    counters, and the ledger's parts, match its weights."""
    async with run.mode.paused():
        await _write_checkpoint(run, step)


async def _write_checkpoint(run: Run, step: int) -> None:
    root = run.run_dir / "checkpoints"
    tmp = staging_dir(root, step)
    version = await run.trainer.save_checkpoint(str(tmp))
    run.codec.tokenizer.save_pretrained(tmp / "model")
    await run.mode.save_checkpoint(tmp, run.codec.tokenizer)
    if run.buffer.record is not None:  # with no await before the ledger's state: the same moment
        snapshot(run.buffer.record, tmp)
    state = {
        "step": step,
        "policy_version": version,
        "base_model": str(run.base_model),
        "base_accuracy": run.state.base_accuracy,
        "train_size": len(run.data.train),
        "stream": run.stream.state_dict(),
        "ledger": run.ledger.state_dict(),
        "stats": run.stats.counters(),
        "drops": dict(run.buffer.drops),
        "reward_errors": dict(run.scorer.errors),
        "clock": {"wall_s": run.state.clock.wall(), "busy_s": dict(run.state.clock.busy_s)},
        **run.mode.state_dict(),
        "engine_rng": [
            {k: base64.b64encode(v).decode() for k, v in st.items()} for st in await run.engine.sampling_states()
        ],
    }
    await asyncio.to_thread(commit, root, tmp, step, state, run.cfg.checkpoint.keep)
    run.state.last_checkpoint = step


def restore(run: Run, ckpt: Checkpoint) -> None:
    state = ckpt.state
    if state["train_size"] != len(run.data.train):
        raise RunFailed(
            f"task: this config gives {len(run.data.train)} train prompts, the checkpoint's run had "
            f"{state['train_size']}; resume with the run's own task settings and seed"
        )
    by_index = {ex.index: ex for ex in run.data.train}
    pending = [Draw(int(e), by_index[int(i)]) for e, i in state["ledger"]["in_flight"]]
    run.stream.load_state_dict(state["stream"])
    run.ledger.load_state_dict(state["ledger"])
    run.stream.requeue(pending)
    run.ledger.requeued += len(pending)
    for name, value in state["stats"].items():
        setattr(run.stats, name, value)
    run.buffer.drops.update(state["drops"])
    run.buffer.policy_version = state["policy_version"]
    run.scorer.errors.update(state["reward_errors"])
    run.state.clock = Clock(start=time.perf_counter() - state["clock"]["wall_s"], busy_s=dict(state["clock"]["busy_s"]))
    run.mode.load_state_dict(state)
    run.state.base_accuracy = state["base_accuracy"]
    run.state.first_step = state["step"] + 1
    run.state.last_checkpoint = state["step"]
    run.progress.log(
        f"resumed from {ckpt.path} (step {state['step']}, policy_version {state['policy_version']}); "
        f"{len(pending)} in-flight prompts re-queued"
    )


async def restore_engines(run: Run, ckpt: Checkpoint) -> None:
    """Give engine i the sampling generator state engine i had at the checkpoint."""
    saved = ckpt.state.get("engine_rng")
    if saved is None:  # written before checkpoints kept it
        return
    states = [{k: base64.b64decode(v) for k, v in st.items()} for st in saved]
    if len(states) > len(run.engines) and run.join is not None:  # engines that had joined join again later
        states = states[: len(run.engines)]
    if len(states) != len(run.engines):
        run.progress.log(
            f"engine sampling state not restored: the checkpoint has {len(states)} engine(s), "
            f"this run {len(run.engines)}"
        )
        return
    await run.engine.load_sampling_states(states)


ROLLED_BACK = "metrics.rolled_back.jsonl"


def set_aside_rolled_back(run_dir: Path, step: int) -> int:
    """Move metrics.jsonl's lines of steps after `step` (a resume's checkpoint: those steps are
    trained again) to ROLLED_BACK, appended as they were; returns how many moved. A line cut short
    by a crash moves too: the next record would be appended onto it. The side file is written and
    synced before metrics.jsonl is replaced, so a crash in between repeats lines, never loses one."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    keep: list[str] = []
    moved: list[str] = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            r = None
        counts = isinstance(r, dict) and isinstance(r.get("step"), int) and r["step"] <= step
        (keep if counts else moved).append(line + "\n")
    if not moved:
        return 0
    with (run_dir / ROLLED_BACK).open("a") as f:
        f.writelines(moved)
        f.flush()
        os.fsync(f.fileno())
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        f.writelines(keep)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(moved)
