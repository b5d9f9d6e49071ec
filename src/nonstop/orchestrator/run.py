"""One training run's wiring (`Run`), its small mutable state (`RunState`) and its mode's seam (`RunMode`).

`Run` is what build.py made: the config, the data, the engine pool and the trainer rank group
as typed clients, the buffer, scorer, prompt stream and ledger, the metrics sink, and the run's
mode. It never changes during the run; the stages keep their own counters. `RunState` is what
does change besides them (the RL clock, the base accuracy, the first step, the last checkpoint,
the stop request): resume (recovery.py) sets it and the learning loop (learn.py) advances it.

`RunMode` is the one seam between the core of a run (pipeline.py, learn.py, recovery.py) and
where its groups come from: groups of completions of a task's prompts, episodes from an
environment (each role on the shared policy or on its own), or agents' episodes over the API.
build.py chooses the mode once (`build_mode`); its implementations live in orchestrator/modes/.
A mode says how its groups are produced (the producer tasks it starts), how a policy is measured
(`eval`, `eval_own`, `eval_metric`), what a trained step adds to its counters, what it adds to a
checkpoint and the final save, the fields it adds to step records and summary.json, the engines
and transports it holds besides the run's, and what it starts, finishes and closes.

Evaluation is the mode's, so every part that measures a policy measures it the same way:
`Run.eval()` asks the mode (the task's reward on held-out completions, or an environment's
success rate over sampled episodes).

This module sits below everything in the orchestrator that takes a run (build, step, learn,
recovery, pipeline, the modes): it imports only the stages it holds, never those.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from nonstop.clients import TrainerClient
from nonstop.config import Config
from nonstop.observe.clock import Clock
from nonstop.observe.doctor import Doctor
from nonstop.observe.flops import FlopTally
from nonstop.observe.spans import SpanLog
from nonstop.observe.tracking import MetricsSink
from nonstop.orchestrator.buffer import RolloutBuffer
from nonstop.orchestrator.dispatch import EnginePool
from nonstop.orchestrator.generate import RolloutStats
from nonstop.orchestrator.ledger import Ledger
from nonstop.orchestrator.progress import Progress
from nonstop.runtime import Supervisor
from nonstop.runtime.restart import RestartingEngine
from nonstop.scoring.base import Scorer
from nonstop.tasks.codec import Codec, HeldOut
from nonstop.tasks.data import PromptStream, TaskData
from nonstop.types import Group, TransportHandle


@dataclass
class RunState:
    """What changes during a run besides the stages' own counters; a checkpoint saves it."""

    clock: Clock = field(default_factory=Clock)  # RL wall time and busy seconds per side
    base_accuracy: float = 0.0
    first_step: int = 1
    last_checkpoint: int | None = None
    flops: FlopTally = field(default_factory=FlopTally)  # achieved FLOP/s (not checkpointed: counts from a resume)
    max_rl_s: float | None = None
    """The RL clock's limit: run.max_time_s, or less where run.max_total_s leaves less (begin() sets it)."""
    doctor: Doctor | None = None
    """The run doctor (observe/doctor.py), made once the base accuracy is known; on resume it reads
    the run's metrics.jsonl up to the checkpoint again instead of being checkpointed."""
    joins: list[dict] = field(default_factory=list)  # engines that joined mid-run: name, wall-clock time
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    """Set by the first Ctrl-C (or SIGTERM): the learning loop ends after the current step and
    writes a checkpoint."""


class RunMode(Protocol):
    """Where a run's groups come from, and what that adds to the core of the run (module docstring).
    Implementations: orchestrator/modes/; build.py's `build_mode` chooses one from the config."""

    def eval_metric(self, run: Run) -> str:
        """The name the held-out score goes by in progress lines, summary.json and the report."""
        ...

    async def eval(self, run: Run) -> float:
        """The shared policy's held-out score on the run's engines as they are now."""
        ...

    async def eval_own(self, run: Run) -> dict[str, float]:
        """The held-out score of each other policy the mode trains, measured like the shared policy's; {} if none."""
        ...

    async def open(self, run: Run) -> None:
        """After the base evaluation, before the producer starts: what the mode serves to others."""
        ...

    def start(self, run: Run, supervisor: Supervisor) -> None:
        """Spawn under `supervisor` what produces the run's groups, and whatever else of the mode runs
        beside the shared policy's learning loop (its engines' heartbeats, its own learner loops)."""
        ...

    def trained(self, groups: list[Group], trained_on: int, published: int) -> None:
        """The shared policy's loop trained `groups` against version `trained_on` and published `published`."""
        ...

    def paused(self) -> AbstractAsyncContextManager[None]:
        """Inside it, nothing of the mode trains (a checkpoint is taken there)."""
        ...

    async def save_checkpoint(self, folder: Path, tokenizer: Any) -> None:
        """The mode's own files in a checkpoint's staging folder (called `paused`)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The mode's entries of a checkpoint's state.json (JSON-ready)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from a checkpoint's whole state.json."""
        ...

    async def finish(self) -> None:
        """Training ended normally (not stopped): what the mode does before the final save."""
        ...

    async def save_final(self, run: Run) -> None:
        """The mode's own final weights, beside the shared policy's RUN_DIR/final."""
        ...

    def report(self) -> dict[str, Any]:
        """The mode's fields of every step record (StepRecord keyword arguments)."""
        ...

    async def summary(self, run: Run) -> dict[str, Any]:
        """The mode's fields of summary.json (RunSummary keyword arguments), after `save_final`."""
        ...

    def engines(self) -> list[RestartingEngine]:
        """The engines the mode holds besides the run's (their faults count in the summary)."""
        ...

    def transports(self) -> list[TransportHandle]:
        """The weight transports the mode holds besides the run's (released at the end)."""
        ...

    async def close(self) -> None:
        """Stop what the mode started; called once at the end however the run ended."""
        ...


@dataclass(frozen=True)
class Run:
    cfg: Config
    data: TaskData
    codec: Codec
    engine: EnginePool  # of RestartingEngine
    engines: list[RestartingEngine]  # the pool's members, for their fault counters
    trainer: TrainerClient
    buffer: RolloutBuffer
    scorer: Scorer
    stats: RolloutStats
    stream: PromptStream
    ledger: Ledger
    sink: MetricsSink  # metrics.jsonl and the trackers of cfg.tracking
    progress: Progress
    run_dir: Path
    base_model: Path
    state: RunState
    mode: RunMode  # where the groups come from (orchestrator/modes/; build.py chooses it)
    spans: SpanLog = field(default_factory=lambda: SpanLog(None))  # the orchestrator's span file
    transport: TransportHandle | None = None
    join: Callable[[int], Awaitable[RestartingEngine]] | None = None
    """Starts engine i past runtime.num_engines (runtime.max_engines; grow.py adds it to the pool)."""
    held_out: HeldOut | None = None
    """How held-out completions are scored (the task's reward, under its name); None: exact match."""

    @property
    def eval_metric(self) -> str:
        """The name the held-out score goes by in progress lines, summary.json and the report."""
        return self.mode.eval_metric(self)

    async def eval(self) -> float:
        """The shared policy's held-out score, as the run's mode measures it."""
        return await self.mode.eval(self)
