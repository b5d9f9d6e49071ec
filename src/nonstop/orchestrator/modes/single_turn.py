"""Groups from a task (the default run mode): `rollout.group_size` completions of each prompt.

`TaskMode` starts generate.py's producer over the run's engine pool and scorer, and measures a
policy by the task's reward on greedy (or mean@k sampled) completions of the held-out prompts
(`Run.held_out`, tasks/codec.py HeldOut). It adds nothing to checkpoints, records or the final
save; the other modes build on its defaults. `production(run, intake)` is the `Production`
every producer takes, built from the run.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

from nonstop.orchestrator.buffer import Intake
from nonstop.orchestrator.generate import Production, evaluate, produce
from nonstop.orchestrator.run import Run
from nonstop.runtime import Supervisor
from nonstop.runtime.restart import RestartingEngine
from nonstop.scoring.rewards import exact_match
from nonstop.sizing.defaults import engine_calls_bound
from nonstop.tasks.codec import HeldOut
from nonstop.types import Group, TransportHandle


def production(run: Run, intake: Intake | None = None) -> Production:
    """What a producer shares with the run: its stream, ledger and counters; groups go to `intake`
    (None: the run's buffer)."""
    return Production(
        run.buffer if intake is None else intake,
        run.stream,
        run.ledger,
        run.codec,
        run.cfg.rollout,
        run.state.clock,  # the RL clock as begin() started or restored it
        run.stats,
        run.spans,
        max_in_flight=engine_calls_bound(run.cfg),
    )


class TaskMode:
    """Groups of completions of the task's prompts; the held-out score by the task's reward."""

    def eval_metric(self, run: Run) -> str:
        return run.held_out.metric if run.held_out is not None else "exact_match"

    async def eval(self, run: Run) -> float:
        held_out = run.held_out or HeldOut(exact_match, "exact_match")
        return await evaluate(run.engine, run.data.eval, run.codec, run.cfg.rollout.max_new_tokens, held_out)

    async def eval_own(self, run: Run) -> dict[str, float]:
        return {}

    async def open(self, run: Run) -> None:
        """Nothing to serve."""

    def start(self, run: Run, supervisor: Supervisor) -> None:
        cfg = run.cfg
        seed = cfg.run.seed if cfg.rollout.seed_per_prompt else None
        supervisor.spawn(
            produce(production(run), run.engine, run.scorer, cfg.task.max_consecutive_reward_failures, seed),
            name="producer",
        )

    def trained(self, groups: list[Group], trained_on: int, published: int) -> None:
        """The run's own counters (RolloutStats, the buffer's) say it all."""

    def paused(self) -> AbstractAsyncContextManager[None]:
        return contextlib.nullcontext()

    async def save_checkpoint(self, folder: Path, tokenizer: Any) -> None:
        """No files of its own."""

    def state_dict(self) -> dict[str, Any]:
        # state.json has held both entries since it first had either, null where the run has none
        return {"envs": None, "policies": None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing of its own to restore."""

    async def finish(self) -> None:
        """Nothing to end."""

    async def save_final(self, run: Run) -> None:
        """No weights of its own."""

    def report(self) -> dict[str, Any]:
        return {}

    async def summary(self, run: Run) -> dict[str, Any]:
        return self.report()

    def engines(self) -> list[RestartingEngine]:
        return []

    def transports(self) -> list[TransportHandle]:
        return []

    async def close(self) -> None:
        """Nothing started."""
