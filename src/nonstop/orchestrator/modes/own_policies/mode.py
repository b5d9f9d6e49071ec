"""Episodes from an environment with roles on policies of their own (config `env.policies`).

`OwnPoliciesMode` is `EnvMode` whose producer hands each group to the split intake (one part per
policy's buffer) and plays each role's turns on its policy's engines (policies.py `Policies`,
built in policy_build.py). Beside the shared policy's learning loop it runs each own policy's
engine heartbeats and learner loop (`learn_policy`). It adds to the core:
- evaluation: each own policy's held-out score at the end (`eval_own`, measured like the shared
  policy's, on its own engines);
- records: `policies` (every policy's counters) in every step record and summary.json, with each
  own policy's final weights and score in the summary;
- checkpoints: each own policy's trainer state under policies/<role>, taken while none of them
  trains (`paused`), and their counters in state.json (`policies`);
- the final save: each own policy's weights in RUN_DIR/policies/<role>/final;
- its engines (their faults count in the summary) and its transports (released at the end).

`learn_policy(side, run)` steps whenever its buffer has a batch, under the policy's lock (so a
checkpoint saves its trainer state and counters at one step), and writes one record per step to
RUN_DIR/policies/<role>/metrics.jsonl; it ends with the run.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

from nonstop.envs.base import TurnEngine
from nonstop.orchestrator.buffer import Intake
from nonstop.orchestrator.modes.environment.episode_flow import EnvRun
from nonstop.orchestrator.modes.environment.mode import EnvMode
from nonstop.orchestrator.modes.own_policies.policies import Policies, PolicySide
from nonstop.orchestrator.run import Run
from nonstop.orchestrator.step import Trained, take_batch, train_step
from nonstop.runtime import Supervisor
from nonstop.runtime.restart import RestartingEngine
from nonstop.types import Group, TransportHandle


class OwnPoliciesMode(EnvMode):
    """An environment's episodes, the roles of env.policies each on its own policy."""

    def __init__(self, env: EnvRun, policies: Policies) -> None:
        super().__init__(env)
        self.policies = policies
        self.final_dirs: dict[str, str] = {}  # each own policy's final weights (save_final)

    async def eval_own(self, run: Run) -> dict[str, float]:
        return {role: await self.eval_on(run, side.engine) for role, side in self.policies.sides.items()}

    def intake(self, run: Run) -> Intake:
        return self.policies.intake

    def turn_engine(self, run: Run) -> TurnEngine:
        return self.policies.engines(run.engine)

    def start(self, run: Run, supervisor: Supervisor) -> None:
        super().start(run, supervisor)
        for e in self.policies.actors:
            supervisor.spawn(e.heartbeat(), name=f"{e.name}-heartbeat")
        for role, side in self.policies.sides.items():
            supervisor.spawn(learn_policy(side, run), name=f"learn-{role}")

    def trained(self, groups: list[Group], trained_on: int, published: int) -> None:
        super().trained(groups, trained_on, published)
        self.policies.shared_trained(groups, trained_on, published)

    def paused(self) -> AbstractAsyncContextManager[None]:
        return self.policies.paused()

    async def save_checkpoint(self, folder: Path, tokenizer: Any) -> None:
        await self.policies.save_checkpoints(folder, tokenizer)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "policies": self.policies.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.policies.load_state_dict(state["policies"])  # build_policies checked it holds every own policy

    async def save_final(self, run: Run) -> None:
        self.final_dirs = await self.policies.save_final(run.run_dir)

    def report(self) -> dict[str, Any]:
        return {**super().report(), "policies": self.policies.report()}

    async def summary(self, run: Run) -> dict[str, Any]:
        out = self.report()
        for role, accuracy in (await self.eval_own(run)).items():
            out["policies"][role].update(final_dir=self.final_dirs[role], final_accuracy=accuracy)
        return out

    def engines(self) -> list[RestartingEngine]:
        return self.policies.actors

    def transports(self) -> list[TransportHandle]:
        return self.policies.transports()


async def learn_policy(side: PolicySide, run: Run) -> None:
    """An own policy's learner loop: take its part of the rows, train, publish, settle, record; until the
    run ends (its supervisor cancels the loop) or the stream ran out and its buffer is empty."""
    path = run.run_dir / "policies" / side.role / "metrics.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as records:
        while True:
            groups = await take_batch(side.buffer, run.state.stop)
            if not groups:
                return
            async with side.lock:
                t0 = time.perf_counter()
                done = await train_step(run, side.trainer, side.buffer, groups, side.tally.steps + 1, side.role)
                side.tally.stepped(groups, done.trained_on, done.published.policy_version)
            records.write(json.dumps(policy_record(side, run, done, time.perf_counter() - t0)) + "\n")
            records.flush()


def policy_record(side: PolicySide, run: Run, done: Trained, train_s: float) -> dict[str, Any]:
    """One line of RUN_DIR/policies/<role>/metrics.jsonl: the step, its batch and the trainer's metrics."""
    rewards = [s.reward for g in done.groups for s in g.samples]
    metrics = {k: v for k, v in done.result.metrics.items() if k != "samples"}
    return {
        "policy": side.role,
        "step": side.tally.steps,
        "policy_version": done.published.policy_version,
        "shared_policy_version": run.buffer.policy_version,
        "train_s": round(train_s, 3),
        "reward_mean": sum(rewards) / max(len(rewards), 1),
        "prompts": [[g.epoch, g.prompt_index] for g in done.groups],
        "samples_trained": done.result.metrics["samples"],
        "roles": dict(Counter(s.role for g in done.groups for s in g.samples)),
        **metrics,
        "publish_s": done.published.publish_s,
        "publish_bytes": done.published.publish_bytes,
        "drops": dict(side.buffer.drops),
    }
