"""Episodes from agents over the API (config `agents`): the agents' rewarded groups are the run's
only training data.

`AgentsMode` wraps the mode the run would have without agents (the task's, or an environment's
with `env`: a run with agents still picks its warm-up base and its held-out evaluation from it)
and takes its evaluation, checkpoint entries and report fields from it. It adds the endpoint:
opened after the base evaluation (so agents see the policy the run trains; agents.py
`AgentEndpoint`), its producer (`produce_agent_groups`) instead of the wrapped mode's, its
`agents` report fields, the linger on the final policy once training ended (`finish`), and its
shutdown.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

from nonstop.hf import max_positions
from nonstop.orchestrator.modes.api_agents.agents import AgentEndpoint, produce_agent_groups
from nonstop.orchestrator.modes.single_turn import production
from nonstop.orchestrator.run import Run, RunMode
from nonstop.runtime import Supervisor
from nonstop.runtime.restart import RestartingEngine
from nonstop.types import Group, TransportHandle


def agent_endpoint(run: Run) -> AgentEndpoint:
    """The run's agents endpoint over its engine pool (not started)."""
    limit = run.cfg.engine.max_seq_len or max_positions(run.base_model)
    return AgentEndpoint(
        run.cfg, run.engine, run.codec.tokenizer, run.run_dir, lambda: run.buffer.policy_version, limit
    )


class AgentsMode:
    """Agents' groups over the API; the rest as `evaluated`, the mode it wraps, does it."""

    def __init__(self, evaluated: RunMode) -> None:
        self.evaluated = evaluated
        self.endpoint: AgentEndpoint | None = None  # made once the run is measured (open)

    def eval_metric(self, run: Run) -> str:
        return self.evaluated.eval_metric(run)

    async def eval(self, run: Run) -> float:
        return await self.evaluated.eval(run)

    async def eval_own(self, run: Run) -> dict[str, float]:
        return await self.evaluated.eval_own(run)

    async def open(self, run: Run) -> None:
        self.endpoint = agent_endpoint(run)
        await self.endpoint.start(run.progress.log)

    def start(self, run: Run, supervisor: Supervisor) -> None:
        assert self.endpoint is not None, "open() first"
        supervisor.spawn(produce_agent_groups(production(run), self.endpoint), name="agent-producer")

    def trained(self, groups: list[Group], trained_on: int, published: int) -> None:
        self.evaluated.trained(groups, trained_on, published)

    def paused(self) -> AbstractAsyncContextManager[None]:
        return self.evaluated.paused()

    async def save_checkpoint(self, folder: Path, tokenizer: Any) -> None:
        await self.evaluated.save_checkpoint(folder, tokenizer)

    def state_dict(self) -> dict[str, Any]:
        return self.evaluated.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.evaluated.load_state_dict(state)

    async def finish(self) -> None:
        if self.endpoint is not None:
            await self.endpoint.finish()
        await self.evaluated.finish()

    async def save_final(self, run: Run) -> None:
        await self.evaluated.save_final(run)

    def report(self) -> dict[str, Any]:
        return {**self.evaluated.report(), **self._agents()}

    async def summary(self, run: Run) -> dict[str, Any]:
        return {**await self.evaluated.summary(run), **self._agents()}

    def _agents(self) -> dict[str, Any]:
        return {"agents": self.endpoint.report()} if self.endpoint is not None else {}

    def engines(self) -> list[RestartingEngine]:
        return self.evaluated.engines()

    def transports(self) -> list[TransportHandle]:
        return self.evaluated.transports()

    async def close(self) -> None:
        if self.endpoint is not None:
            await self.endpoint.stop()
        await self.evaluated.close()
