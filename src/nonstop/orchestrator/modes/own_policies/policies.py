"""Separate policies per role (env.policies): each its own engines, trainer, transport, buffer and loop.

In an environment run every role plays the run's shared policy (self-play) unless `env.policies`
names it: such a role plays its own policy, a `PolicySide` here, which owns
- its engines (`<role>-engine`, behind their own RestartingEngine and EnginePool) and its
  trainer (`<role>-trainer`), started from `env.policies.<role>.path` or a copy of the run's
  base policy, connected by their own weight transport (so its `policy_version` counts its own
  steps);
- its buffer (own admission, max-lag rule, drops) and its learner loop (`learn_policy`, in
  mode.py, beside the shared policy's loop; both train through step.py's `train_step`).
They are built in policy_build.py; this module holds what a run keeps of them: `PolicySide`,
`PolicyTally` (what a policy trained) and `Policies` (all of them, with the split intake).

The flow, beside the shared policy's (pipeline.py, learn.py):
- the episode runner gets a `RoleEngines` (modes/environment/episodes.py): each role's turns go
  to its policy's engines, and each sample carries `policy` ('' the shared policy, else the role);
- the producer hands each group to `SplitIntake`, which admits a row only when every policy's
  buffer admits it, and splits the group into one part per policy (advantages were computed
  per role before): a part with no sample, or no signal, is dropped in its own buffer, counted
  and settled; so an episode stale for one policy is still fresh data for another;
- each policy's learner loop trains only its own part of each row and settles it through its
  part of the ledger (ledger.py): a row settles when every policy has settled its part;
- run.max_steps, run.max_time_s and Ctrl-C count and stop the shared policy's loop; the own
  policies' loops step whenever they have a batch and stop with the run. A batch an own policy
  had taken but not trained when the run stopped stays in flight in the ledger (counted).

Reports: `Policies.report()` (every step record and summary.json, key `policies`) per policy:
steps, policy_version, samples trained by role (each policy trains only its roles' samples),
drops, the mean reward of its trained samples so far and the lag histogram of its trained
episodes, and for an own policy the newest version seen in each of its engines' tokens
(`engine_versions`); an own policy also writes one line per step to
RUN_DIR/policies/<role>/metrics.jsonl, its final weights to RUN_DIR/policies/<role>/final and its
held-out score at the end (`final_accuracy`, measured like the shared policy's:
`OwnPoliciesMode.eval_own`, mode.py).

Checkpoints (recovery.py) hold every policy: while no own policy trains (`Policies.paused`),
each one's trainer state goes under policies/<role> and its counters into state.json, beside
the ledger's parts settled of rows still in flight; a resume starts each own policy from its
own weights, version and optimizer state, and a re-queued row goes only to the policies that
had not settled their part. With `lora: true` an own policy trains LoRA adapters on its start
weights (its engines keep them; only the adapters travel); by default an own policy trains
adapters exactly when the shared one does (model.lora). Every runtime, transport and engine kind
and several trainer ranks work per policy as for the shared one; a verifiers taskset (one role)
and a distillation teacher are refused (config/root.py). Not built yet: adapter slots on the
shared engines.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nonstop.clients import TrainerClient
from nonstop.envs.base import TurnEngine
from nonstop.orchestrator.buffer import RolloutBuffer
from nonstop.orchestrator.dispatch import EnginePool
from nonstop.orchestrator.ledger import SHARED, Ledger, policy_label
from nonstop.orchestrator.modes.environment.episodes import RoleEngines
from nonstop.orchestrator.modes.own_policies.split_intake import SplitIntake
from nonstop.runtime.restart import RestartingEngine
from nonstop.types import Group, TransportHandle


@dataclass
class PolicyTally:
    """What one policy trained: steps, samples by role, rewards, the lag of its episodes."""

    steps: int = 0
    policy_version: int = 0
    samples_by_role: Counter[str] = field(default_factory=Counter)
    reward_sum: float = 0.0
    episode_lag: Counter[int] = field(default_factory=Counter)

    def trained(self, groups: list[Group], policy_version: int) -> None:
        """A batch trained against `policy_version` (the version its lag is measured from)."""
        for g in groups:
            oldest: dict[int, int] = {}
            for s in g.samples:
                self.samples_by_role[s.role] += 1
                self.reward_sum += s.reward
                if s.min_version >= 0:
                    oldest[s.episode] = min(oldest.get(s.episode, s.min_version), s.min_version)
            self.episode_lag.update(policy_version - v for v in oldest.values())

    def stepped(self, groups: list[Group], trained_on: int, published: int) -> None:
        """A step trained `groups` against `trained_on` and published version `published`."""
        self.trained(groups, trained_on)
        self.steps += 1
        self.policy_version = published

    def state_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "policy_version": self.policy_version,
            "reward_sum": self.reward_sum,
            "samples_by_role": dict(self.samples_by_role),
            "episode_lag": {str(k): v for k, v in self.episode_lag.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps, self.policy_version, self.reward_sum = state["steps"], state["policy_version"], state["reward_sum"]
        self.samples_by_role = Counter(state["samples_by_role"])
        self.episode_lag = Counter({int(k): v for k, v in state["episode_lag"].items()})

    def report(self, buffer: RolloutBuffer) -> dict[str, Any]:
        n = sum(self.samples_by_role.values())
        return {
            "steps": self.steps,
            "policy_version": self.policy_version,
            "samples_by_role": dict(self.samples_by_role),
            "drops": dict(buffer.drops),
            "reward_mean": self.reward_sum / n if n else None,
            "episode_lag_hist": {str(k): v for k, v in sorted(self.episode_lag.items())},
        }


@dataclass
class PolicySide:
    """One role's own policy: its actors, transport, buffer and counters."""

    role: str
    engine: EnginePool  # of RestartingEngine
    engines: list[RestartingEngine]
    trainer: TrainerClient
    transport: TransportHandle
    buffer: RolloutBuffer
    tally: PolicyTally = field(default_factory=PolicyTally)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Held by its learner loop from a trainer step to its settlement, and by a checkpoint: the trainer's
    state and the policy's counters are saved at the same step."""


class Policies:
    """The run's policies: the shared one (Run.buffer, trained by learn.py) and each role's own."""

    def __init__(
        self, shared_buffer: RolloutBuffer, sides: dict[str, PolicySide], filter_uniform: bool, ledger: Ledger
    ) -> None:
        self.sides = sides
        self.shared_tally = PolicyTally()
        self.shared_buffer = shared_buffer
        self.intake = SplitIntake(
            {SHARED: shared_buffer, **{r: s.buffer for r, s in sides.items()}}, filter_uniform, ledger
        )

    def engines(self, shared: TurnEngine) -> RoleEngines:
        return RoleEngines(shared, {role: side.engine for role, side in self.sides.items()})

    @property
    def actors(self) -> list[RestartingEngine]:
        return [e for side in self.sides.values() for e in side.engines]

    def shared_trained(self, groups: list[Group], trained_on: int, published: int) -> None:
        """The shared policy's loop (learn.py) finished a step."""
        self.shared_tally.stepped(groups, trained_on, published)

    def report(self) -> dict[str, Any]:
        out = {policy_label(SHARED): self.shared_tally.report(self.shared_buffer)}
        out.update(
            {
                role: {**side.tally.report(side.buffer), "engine_versions": list(side.engine.versions)}
                for role, side in self.sides.items()
            }
        )
        return out

    async def save_final(self, run_dir: Path) -> dict[str, str]:
        """Each own policy's final weights, in RUN_DIR/policies/<role>/final; returns the folders."""
        out = {}
        for role, side in self.sides.items():
            path = run_dir / "policies" / role / "final"
            await side.trainer.save(str(path))
            out[role] = str(path)
        return out

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """No own policy trains or settles inside (each finishes the step under way first)."""
        async with contextlib.AsyncExitStack() as stack:
            for side in self.sides.values():
                await stack.enter_async_context(side.lock)
            yield

    async def save_checkpoints(self, folder: Path, tokenizer: Any) -> None:
        """Each own policy's trainer state under folder/policies/<role> (call it `paused`)."""
        for role, side in self.sides.items():
            await side.trainer.save_checkpoint(str(folder / "policies" / role))
            tokenizer.save_pretrained(folder / "policies" / role / "model")

    def state_dict(self) -> dict[str, Any]:
        return {
            "shared": self.shared_tally.state_dict(),
            "own": {
                role: {**side.tally.state_dict(), "drops": dict(side.buffer.drops)} for role, side in self.sides.items()
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.shared_tally.load_state_dict(state["shared"])
        for role, side in self.sides.items():
            side.tally.load_state_dict(state["own"][role])
            side.buffer.policy_version = side.tally.policy_version
            side.buffer.drops.update(state["own"][role]["drops"])

    def transports(self) -> list[TransportHandle]:
        return [side.transport for side in self.sides.values()]
