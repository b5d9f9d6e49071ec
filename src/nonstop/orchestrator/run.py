"""One training run's wiring (`Run`) and its small mutable state (`RunState`).

`Run` is what build.py made: the config, the data, the engine pool and the trainer rank group
as typed clients, the buffer, scorer, prompt stream and ledger, the metrics sink, and (in an
environment run) the environment side and the roles with their own policy. It never changes
during the run; the stages keep their own counters. `RunState` is what does change besides
them (the RL clock, the base accuracy, the first step, the last checkpoint, the stop request):
resume (recovery.py) sets it and the learning loop (learn.py) advances it.

Evaluation lives here because every part that measures a policy measures it the same way:
the task's reward on greedy (or mean@k sampled) completions of the held-out prompts
(`held_out`, tasks/codec.py HeldOut), or in an environment run the success rate of one
sampled episode per held-out row, for the shared policy (`eval`) and for each role's own
(`eval_own`).

This module sits below everything in the orchestrator that takes a run (build, step, learn,
recovery, pipeline): it imports only the stages it holds, never those.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from nonstop.clients import TrainerClient
from nonstop.config import Config
from nonstop.envs.base import TurnEngine
from nonstop.observe.clock import Clock
from nonstop.observe.doctor import Doctor
from nonstop.observe.flops import FlopTally
from nonstop.observe.spans import SpanLog
from nonstop.observe.tracking import MetricsSink
from nonstop.orchestrator.agents import AgentEndpoint
from nonstop.orchestrator.buffer import RolloutBuffer
from nonstop.orchestrator.dispatch import EnginePool
from nonstop.orchestrator.episode_flow import EnvRun
from nonstop.orchestrator.generate import RolloutStats, evaluate
from nonstop.orchestrator.ledger import Ledger
from nonstop.orchestrator.policies import Policies
from nonstop.orchestrator.progress import Progress
from nonstop.runtime.restart import RestartingEngine
from nonstop.scoring.base import Scorer
from nonstop.scoring.rewards import exact_match
from nonstop.tasks.codec import Codec, HeldOut
from nonstop.tasks.data import PromptStream, TaskData
from nonstop.types import SamplingParams, TransportHandle


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
    spans: SpanLog = field(default_factory=lambda: SpanLog(None))  # the orchestrator's span file
    transport: TransportHandle | None = None
    envs: EnvRun | None = None  # an environment run (cfg.env): episodes instead of single-turn groups
    policies: Policies | None = None  # roles with their own policy (cfg.env.policies; orchestrator/policies.py)
    agents: AgentEndpoint | None = None  # agents over the API (cfg.agents; orchestrator/agents.py)
    join: Callable[[int], Awaitable[RestartingEngine]] | None = None
    """Starts engine i past runtime.num_engines (runtime.max_engines; grow.py adds it to the pool)."""
    held_out: HeldOut | None = None
    """How held-out completions are scored (the task's reward, under its name); None: exact match."""

    @property
    def eval_metric(self) -> str:
        """The name the held-out score goes by in progress lines, summary.json and the report."""
        if self.envs is not None:
            return "success"
        return self.held_out.metric if self.held_out is not None else "exact_match"

    async def eval(self) -> float:
        """The held-out score by the task's reward; in an environment run, the success rate of sampled episodes."""
        if self.envs is not None:
            return await self._eval_episodes(self.engine)
        held_out = self.held_out or HeldOut(exact_match, "exact_match")
        return await evaluate(self.engine, self.data.eval, self.codec, self.cfg.rollout.max_new_tokens, held_out)

    async def eval_own(self) -> dict[str, float]:
        """Each own policy's held-out score (env.policies), measured like the shared policy's on its
        own engines; {} when no role has its own policy."""
        if self.policies is None:
            return {}
        return {role: await self._eval_episodes(side.engine) for role, side in self.policies.sides.items()}

    async def _eval_episodes(self, engine: TurnEngine) -> float:
        assert self.envs is not None
        r = self.cfg.rollout
        params = SamplingParams(
            self.envs.limits.turn_max_tokens, r.temperature, top_k=r.top_k, top_p=r.top_p, min_p=r.min_p
        )
        return await self.envs.evaluate(engine, self.data.eval, self.codec, params)
