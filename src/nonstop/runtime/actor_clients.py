"""Typed clients of one actor: the client Protocols of nonstop.clients (engine, trainer, scoring) over an ActorHandle.

These adapters and the runtime internals are the only code that names an actor method by a
string. They add nothing to a call: errors, timeouts and ordering are the backend's (a dead
actor raises ActorDied naming it, a remote exception ActorCallError, a late answer
TimeoutError), so an `EngineActor` behaves the same on the local and the Ray backend.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from nonstop.clients import EngineStats, SamplingState, TokenSequence
from nonstop.config import TransportConfig
from nonstop.runtime.base import ActorHandle
from nonstop.types import (
    AheadResult,
    GenerationRequest,
    Group,
    Outcome,
    PublishResult,
    RewardKind,
    RewardRow,
    Sample,
    StepResult,
    TransportHandle,
)


class _OneActor:
    def __init__(self, actor: ActorHandle) -> None:
        self.actor = actor
        self.name = actor.name

    def is_alive(self) -> bool:
        return self.actor.is_alive()

    async def stop(self, timeout_s: float = 10.0) -> None:
        await self.actor.stop(timeout_s)

    async def kill(self) -> None:
        await self.actor.kill()


class EngineService(Protocol):
    """The object inside an engine actor: what EngineActor calls by name. Implemented by
    engine/worker.py EngineWorker (engine.kind builtin) and engine/vllm/engine.py VllmEngineWorker."""

    def connect_transport(self, handle: TransportHandle, rank: int = 1) -> None: ...

    async def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]: ...

    async def ping(self) -> int: ...

    async def stats(self) -> dict[str, float | int]: ...

    async def sampling_state(self) -> dict[str, bytes]: ...

    async def load_sampling_state(self, state: dict[str, bytes]) -> None: ...

    async def weights_crc32(self) -> tuple[int, int]: ...

    async def close(self) -> None: ...


class EngineActor(_OneActor):
    """An EngineClient over one engine actor (an EngineService in its own process)."""

    async def generate(self, requests: list[GenerationRequest], timeout_s: float | None = None) -> list[list[Sample]]:
        return await self.actor.call("generate", requests, timeout_s=timeout_s)

    async def stats(self) -> list[EngineStats]:
        return [await self.actor.call("stats")]

    async def ping(self, timeout_s: float | None = None) -> int:
        return await self.actor.call("ping", timeout_s=timeout_s)

    async def connect_transport(self, handle: TransportHandle, rank: int) -> None:
        await self.actor.call("connect_transport", handle, rank)

    async def sampling_states(self) -> list[SamplingState]:
        return [await self.actor.call("sampling_state")]

    async def load_sampling_states(self, states: list[SamplingState]) -> None:
        (state,) = states
        await self.actor.call("load_sampling_state", state)

    async def weights_crc32(self) -> list[tuple[int, int]]:
        version, crc = await self.actor.call("weights_crc32")  # a tuple may travel as a list
        return [(version, crc)]


class TrainerActor(_OneActor):
    """A TrainerClient over one trainer rank actor (trainer/worker.py TrainerWorker), plus the
    calls that form a group of ranks (trainer/parallel.py)."""

    async def step(self, groups: list[Group]) -> StepResult:
        return await self.actor.call("step", groups)

    async def forward_ahead(self, groups: list[Group]) -> AheadResult:
        return await self.actor.call("forward_ahead", groups)

    async def publish(self, resend: bool = False) -> PublishResult:
        return await self.actor.call("publish", resend)

    async def save(self, path: str) -> str:
        return await self.actor.call("save", path)

    async def save_checkpoint(self, path: str) -> int:
        return await self.actor.call("save_checkpoint", path)

    async def load_checkpoint(self, path: str) -> int:
        return await self.actor.call("load_checkpoint", path)

    async def published(self) -> PublishResult:
        return await self.actor.call("published")

    async def plan_transport(
        self, cfg: TransportConfig, num_engines: int, host: str | None, first_engines: int | None = None
    ) -> TransportHandle:
        return await self.actor.call("plan_transport", cfg, num_engines, host, first_engines)

    async def weights_crc32(self) -> tuple[int, int]:
        version, crc = await self.actor.call("weights_crc32")
        return version, crc

    async def connect_transport(self) -> None:
        await self.actor.call("connect_transport")

    async def rendezvous(self, host: str | None) -> tuple[str, int]:
        """Rank 0 only: open the group's store; returns its address and port."""
        return await self.actor.call("rendezvous", host)

    async def join_group(self, host: str, port: int, rank: int, world: int, timeout_s: float) -> None:
        await self.actor.call("join_group", host, port, rank, world, timeout_s)


class RewardModelService(Protocol):
    """The object inside a reward model actor: scoring/reward_model.py RewardModelWorker."""

    def score(self, texts: list[str]) -> list[float]: ...


class TeacherService(Protocol):
    """The object inside a distillation teacher actor: scoring/teacher.py TeacherWorker."""

    def logprobs(self, seqs: list[TokenSequence]) -> list[list[float]]: ...


class RewardWorkerService(Protocol):
    """The object inside a reward worker actor (scoring.pool process/auto): scoring/pool.py RewardWorker."""

    async def evaluate(
        self, kind: RewardKind, spec: str | Callable[..., Any], rows: list[RewardRow]
    ) -> list[Outcome]: ...

    def close(self) -> None: ...


class RewardModelActor(_OneActor):
    """A RewardModelClient over one reward model actor (a RewardModelService)."""

    async def score(self, texts: list[str], timeout_s: float) -> list[float]:
        return await self.actor.call("score", texts, timeout_s=timeout_s)


class TeacherActor(_OneActor):
    """A TeacherClient over one teacher actor (a TeacherService)."""

    async def logprobs(self, seqs: list[TokenSequence], timeout_s: float) -> list[list[float]]:
        return await self.actor.call("logprobs", seqs, timeout_s=timeout_s)


class RewardWorkerActor(_OneActor):
    """A RewardWorkerClient over one reward worker actor (a RewardWorkerService)."""

    async def evaluate(
        self, kind: RewardKind, spec: str | Callable[..., Any], rows: list[RewardRow], timeout_s: float
    ) -> list[Outcome]:
        return await self.actor.call("evaluate", kind, spec, rows, timeout_s=timeout_s)
