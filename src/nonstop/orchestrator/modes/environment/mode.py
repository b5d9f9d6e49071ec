"""Episodes from an environment (config `env`), every role on the run's shared policy.

`EnvMode` starts episode_flow.py's producer with the run's `EnvRun` (what to play, limits,
per-role baselines, episode counters) and measures a policy by the success rate of one sampled
episode per held-out row (eval_metric 'success'). Its episode counters and baselines go into
every step record and summary.json (`episodes`) and into checkpoints (state.json `envs`); the
lag of each trained episode is counted when the shared policy's loop trains it. At the end it
stops what its players started (a verifiers agent player's servers).
"""

from __future__ import annotations

from typing import Any

from nonstop.envs.base import TurnEngine
from nonstop.orchestrator.buffer import Intake
from nonstop.orchestrator.modes.environment.episode_flow import EnvRun, produce_episodes
from nonstop.orchestrator.modes.single_turn import TaskMode, production
from nonstop.orchestrator.run import Run
from nonstop.runtime import Supervisor
from nonstop.types import Group, SamplingParams


class EnvMode(TaskMode):
    """Groups of an environment's episodes; the held-out score is their success rate."""

    def __init__(self, env: EnvRun) -> None:
        self.env = env

    def eval_metric(self, run: Run) -> str:
        return "success"

    async def eval(self, run: Run) -> float:
        return await self.eval_on(run, run.engine)

    async def eval_on(self, run: Run, engine: TurnEngine) -> float:
        """The success rate of one sampled episode per held-out row, its turns on `engine`."""
        r = run.cfg.rollout
        params = SamplingParams(
            self.env.limits.turn_max_tokens, r.temperature, top_k=r.top_k, top_p=r.top_p, min_p=r.min_p
        )
        return await self.env.evaluate(engine, run.data.eval, run.codec, params)

    def intake(self, run: Run) -> Intake:
        """Where the producer hands groups: the run's buffer."""
        return run.buffer

    def turn_engine(self, run: Run) -> TurnEngine:
        """What plays the episodes' turns: the run's engine pool."""
        return run.engine

    def start(self, run: Run, supervisor: Supervisor) -> None:
        engine = self.turn_engine(run)
        supervisor.spawn(produce_episodes(production(run, self.intake(run)), engine, self.env), name="episode-producer")

    def trained(self, groups: list[Group], trained_on: int, published: int) -> None:
        self.env.stats.trained(groups, trained_on)  # lag against the version trained on

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "envs": self.env.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("envs") is not None:  # episode counters and per-role baselines
            self.env.load_state_dict(state["envs"])

    def report(self) -> dict[str, Any]:
        return {"episodes": self.env.report()}

    async def close(self) -> None:
        await self.env.close()
