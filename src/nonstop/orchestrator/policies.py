"""Separate policies per role (env.policies): each its own engines, trainer, transport, buffer and loop.

In an environment run every role plays the run's shared policy (self-play) unless `env.policies`
names it: such a role plays its own policy, a `PolicySide` here, which owns
- its engines (`<role>-engine`, behind their own RestartingEngine and EnginePool) and its
  trainer (`<role>-trainer`), started from `env.policies.<role>.path` or a copy of the run's
  base policy, connected by their own weight transport (so its `policy_version` counts its own
  steps);
- its buffer (own admission, max-lag rule, drops) and its learner loop (`learn_policy`).

The flow, beside the shared policy's (pipeline.py, learn.py):
- the episode runner gets a `RoleEngines` (episodes.py): each role's turns go to its policy's
  engines, and each sample carries `policy` ('' the shared policy, else the role);
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
episodes; an own policy also writes one line per step to RUN_DIR/policies/<role>/metrics.jsonl,
its final weights to RUN_DIR/policies/<role>/final and its held-out score at the end
(`final_accuracy`, measured like the shared policy's).

Checkpoints (recovery.py) hold every policy: while no own policy trains (`Policies.paused`),
each one's trainer state goes under policies/<role> and its counters into state.json, beside
the ledger's parts settled of rows still in flight; a resume starts each own policy from its
own weights, version and optimizer state, and a re-queued row goes only to the policies that
had not settled their part. With `lora: true` an own policy trains LoRA adapters on its start
weights (its engines keep them; only the adapters travel). Not built yet: adapter slots on the
shared engines, other runtimes and transports, several trainer ranks per policy (refused in
config.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nonstop.checkpoint import Checkpoint
from nonstop.clients import TrainerClient
from nonstop.config import Config, ConfigError, PolicyConfig
from nonstop.observe.spans import SpanLog
from nonstop.orchestrator.buffer import RolloutBuffer, make_buffer
from nonstop.orchestrator.build import connect_transport, engine_restarter, spawn_engine, spawn_trainers
from nonstop.orchestrator.dispatch import EnginePool
from nonstop.orchestrator.episodes import RoleEngines, TurnEngine
from nonstop.orchestrator.ledger import Ledger, policy_label
from nonstop.orchestrator.recovery import RunFailed
from nonstop.orchestrator.split_intake import SplitIntake
from nonstop.runtime import ActorBackend, ActorCallError, ActorDied, Supervisor
from nonstop.runtime.restart import RestartingEngine
from nonstop.types import Group, TransportHandle

if TYPE_CHECKING:
    from nonstop.observe.progress import Progress
    from nonstop.orchestrator.build import Run

SHARED = ""  # the policy name of the run's shared policy


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


def policy_config(cfg: Config, own: PolicyConfig, k: int) -> Config:
    """The run's config as policy k's actors see it: its learning rate, LoRA or not, its engine count,
    its own seeds."""
    return cfg.model_copy(
        update={
            "trainer": cfg.trainer.model_copy(update={"lr": own.lr if own.lr is not None else cfg.trainer.lr}),
            "model": cfg.model.model_copy(update={"lora": cfg.model.lora.model_copy(update={"enabled": own.lora})}),
            "runtime": cfg.runtime.model_copy(update={"num_engines": own.num_engines}),
            "run": cfg.run.model_copy(update={"seed": cfg.run.seed + 1000 * (k + 1)}),
        }
    )


def check_roles(cfg: Config, roles: tuple[str, ...]) -> None:
    """ConfigError naming env.policies.<role> for a role the environment lacks, or when no role is left
    to the shared policy (its loop is the one run.max_steps counts)."""
    assert cfg.env is not None
    for role in cfg.env.policies:
        if role not in roles:
            raise ConfigError(
                f"env.policies.{role}: environment {cfg.env.name!r} has no role {role!r}; its roles: {', '.join(roles)}"
            )
    if set(roles) <= set(cfg.env.policies):
        raise ConfigError(
            f"env.policies: every role of {cfg.env.name!r} has its own policy; leave at least one "
            "role to the shared policy (run.max_steps counts its steps)"
        )


def check_tokenizer(role: str, path: Path, tok: Any) -> None:
    """A policy's model must read and write the run's token ids (episodes are shared token sequences)."""
    from nonstop.hf import load_tokenizer

    if load_tokenizer(str(path)).get_vocab() != tok.get_vocab():
        raise ConfigError(
            f"env.policies.{role}.path: {path} has another tokenizer than the run's base policy; "
            "every policy of an episode must share one tokenizer"
        )


def _saved(resume: Checkpoint, role: str) -> tuple[Path, int]:
    """Where a checkpoint keeps policy `role` (its trainer's folder) and the version it had."""
    saved = (resume.state.get("policies") or {}).get("own", {})
    if role not in saved:
        raise RunFailed(
            f"env.policies.{role}: the checkpoint {resume.path} holds no policy {role!r} "
            f"(it has: {', '.join(saved) or 'none'}); resume with the run's own env.policies"
        )
    return resume.path / "policies" / role, int(saved[role]["policy_version"])


async def build_side(
    cfg: Config,
    k: int,
    role: str,
    backend: ActorBackend,
    base_model: Path,
    tok: Any,
    ledger: Ledger,
    run_dir: Path,
    spans: SpanLog,
    progress: Progress,
    resume: Checkpoint | None = None,
) -> PolicySide:
    own = cfg.env.policies[role] if cfg.env is not None else PolicyConfig()
    start = base_model
    if own.path is not None:
        from nonstop.config.preflight import resolve_model_path

        start = resolve_model_path(own.path, field=f"env.policies.{role}.path")
        check_tokenizer(role, start, tok)
    weights, version0, folder = start, 0, None
    if resume is not None:
        folder, version0 = _saved(resume, role)
        weights = folder / "model"  # with LoRA: the adapters, on top of `start`
    model_weights = start if own.lora else weights  # LoRA: engines and trainer hold the start weights
    pcfg = policy_config(cfg, own, k)
    progress.log(
        f"policy {role!r}: {own.num_engines} engine and 1 trainer actor from {weights}"
        + (" (LoRA adapters)" if own.lora else "")
    )
    first, trainer = await asyncio.gather(
        asyncio.gather(
            *(
                spawn_engine(backend, pcfg, model_weights, tok, i, version0, run_dir, f"{role}-engine")
                for i in range(own.num_engines)
            )
        ),
        spawn_trainers(
            backend,
            pcfg,
            model_weights,
            tok,
            str(start) if resume is not None else None,
            adapter_path=str(weights) if folder is not None and own.lora else None,
            run_dir=run_dir,
            prefix=f"{role}-trainer",
        ),
    )
    if folder is not None:
        await trainer.load_checkpoint(str(folder))
    handle = await connect_transport(pcfg, trainer, list(first), backend.host)
    engines = [
        RestartingEngine(
            e.name,
            engine_restarter(
                backend, pcfg, model_weights, tok, i, version0, handle, trainer, run_dir, f"{role}-engine"
            ),
            cfg.engine_restarts,
            cfg.runtime.heartbeat_interval_s,
            cfg.runtime.heartbeat_timeout_s,
            log=progress.log,
            engine=e,
        )
        for i, e in enumerate(first)
    ]
    buffer = make_buffer(cfg, ledger.part(role), spans)
    return PolicySide(role, EnginePool(list(engines)), engines, trainer, handle, buffer)


async def build_policies(
    cfg: Config,
    backend: ActorBackend,
    base_model: Path,
    tok: Any,
    ledger: Ledger,
    run_dir: Path,
    spans: SpanLog,
    progress: Progress,
    resume: Checkpoint | None = None,
) -> dict[str, PolicySide]:
    """Spawn and connect every own policy of cfg.env.policies (the roles were checked in check_roles);
    with `resume`, each from its weights and trainer state in the checkpoint."""
    assert cfg.env is not None
    if resume is not None:
        extra = set((resume.state.get("policies") or {}).get("own", {})) - set(cfg.env.policies)
        if extra:
            raise RunFailed(
                f"env.policies: the checkpoint {resume.path} has own policies {sorted(extra)} this config "
                "does not name; resume with the run's own env.policies"
            )
    sides = await asyncio.gather(
        *(
            build_side(cfg, k, role, backend, base_model, tok, ledger, run_dir, spans, progress, resume)
            for k, role in enumerate(sorted(cfg.env.policies))
        )
    )
    return {s.role: s for s in sides}


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
        self.shared_tally.trained(groups, trained_on)
        self.shared_tally.steps += 1
        self.shared_tally.policy_version = published

    def start(self, supervisor: Supervisor, run: Run) -> None:
        """Heartbeats of the own policies' engines and their learner loops, beside the shared one's."""
        for e in self.actors:
            supervisor.spawn(e.heartbeat(), name=f"{e.name}-heartbeat")
        for role, side in self.sides.items():
            supervisor.spawn(learn_policy(side, run), name=f"learn-{role}")

    def report(self) -> dict[str, Any]:
        out = {policy_label(SHARED): self.shared_tally.report(self.shared_buffer)}
        out.update({role: side.tally.report(side.buffer) for role, side in self.sides.items()})
        return out

    async def save_final(self, run_dir: Path) -> dict[str, str]:
        """Each own policy's final weights, in RUN_DIR/policies/<role>/final; returns the folders."""
        out = {}
        for role, side in self.sides.items():
            path = run_dir / "policies" / role / "final"
            await side.trainer.save(str(path))
            out[role] = str(path)
        return out

    async def evaluate(self, run: Run) -> dict[str, float]:
        """Each own policy's held-out score, measured like the shared policy's (Run.eval) on its own engines."""
        from nonstop.types import SamplingParams

        assert run.envs is not None
        r, limits = run.cfg.rollout, run.envs.limits
        params = SamplingParams(limits.turn_max_tokens, r.temperature, top_k=r.top_k, top_p=r.top_p, min_p=r.min_p)
        return {
            role: await run.envs.evaluate(side.engine, run.data.eval, run.codec, params)
            for role, side in self.sides.items()
        }

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


async def learn_policy(side: PolicySide, run: Run) -> None:
    """An own policy's learner loop: take its part of the rows, train, publish, settle, record; until the
    run ends (its supervisor cancels the loop) or the stream ran out and its buffer is empty."""
    from nonstop.orchestrator.learn import until_stopped

    path = run.run_dir / "policies" / side.role / "metrics.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    tally = side.tally
    with path.open("a") as records:
        while True:
            groups = await until_stopped(side.buffer.take(), run.state.stop)
            if not groups:
                return
            groups.sort(key=lambda g: (g.epoch, g.prompt_index))
            async with side.lock:
                t0 = time.perf_counter()
                try:
                    result = await side.trainer.step(groups)
                    published = await side.trainer.publish()
                except (ActorDied, ActorCallError) as e:
                    raise RunFailed(
                        f"the trainer of policy {side.role!r} failed at its step {tally.steps + 1}: {e}\n"
                        f"resume with `nonstop train --resume {run.run_dir}`"
                    ) from e
                outcome = "skipped_step" if result.metrics["skipped"] else "trained"
                for g in groups:
                    side.buffer.settle(g, outcome)
                tally.trained(groups, side.buffer.policy_version)
                tally.steps += 1
                tally.policy_version = published.policy_version
                await side.buffer.step_done(published.policy_version)
            rewards = [s.reward for g in groups for s in g.samples]
            metrics = {k: v for k, v in result.metrics.items() if k != "samples"}
            records.write(
                json.dumps(
                    {
                        "policy": side.role,
                        "step": tally.steps,
                        "policy_version": published.policy_version,
                        "shared_policy_version": run.buffer.policy_version,
                        "train_s": round(time.perf_counter() - t0, 3),
                        "reward_mean": sum(rewards) / max(len(rewards), 1),
                        "prompts": [[g.epoch, g.prompt_index] for g in groups],
                        "samples_trained": result.metrics["samples"],
                        "roles": dict(Counter(s.role for g in groups for s in g.samples)),
                        **metrics,
                        "publish_s": published.publish_s,
                        "publish_bytes": published.publish_bytes,
                        "drops": dict(side.buffer.drops),
                    }
                )
                + "\n"
            )
            records.flush()
