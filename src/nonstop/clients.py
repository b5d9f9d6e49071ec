"""The role clients: what the orchestrator may ask of engines and of trainers.

`EngineClient` and `TrainerClient` are the typed seam between the flow (nonstop.orchestrator)
and the processes that generate and learn. Every implementation answers the same way whatever
stands behind it:

- one actor: `runtime.actor_clients.EngineActor` / `TrainerActor` over an ActorHandle of either
  backend (local processes or Ray); the only place besides the runtime internals where a
  method is named by a string;
- several actors: `orchestrator.dispatch.EnginePool` (least-loaded placement of requests over
  engines) and `RankGroup` (the same call on every trainer rank, in lockstep);
- a replaceable actor: `runtime.restart.RestartingEngine` (heartbeat, restart, re-submission).

Failures: a dead actor raises ActorDied naming it, a remote exception ActorCallError, a call
past its timeout TimeoutError (runtime/base.py). `kill()` ends the processes at once without
their cooperation; `stop()` asks them to close first.

The scoring actors have clients of their own, built the same way: `RewardModelClient`,
`TeacherClient` and `RewardWorkerClient`, implemented by one-actor clients in
`runtime.actor_clients` (which raise the backend's errors above) and by the replaceable pools over
them in `scoring.pool` (which replace a dead or hung actor and raise `CallFailed` instead).

This module imports only neutral types, so neither side has to import the other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from nonstop.config import TransportConfig
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

EngineStats = dict[str, float | int]  # one engine's counters: policy_version and the scheduler's stats
SamplingState = dict[str, bytes]  # one engine's sampling generator state by device ('cpu', 'cuda'); {}: none kept
TokenSequence = tuple[list[int], list[int]]  # (prompt ids, completion ids) of one sample


class Client(Protocol):
    """What every client of actors offers: a name for messages, health, and an end."""

    name: str

    def is_alive(self) -> bool: ...

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Close the actors (they release their transports), then end their processes."""
        ...

    async def kill(self) -> None:
        """End the processes now; pending calls fail with ActorDied."""
        ...


class EngineClient(Client, Protocol):
    async def generate(self, requests: list[GenerationRequest], timeout_s: float | None = None) -> list[list[Sample]]:
        """One list of `request.n` samples per request, in request order; each request is
        generated exactly once. Concurrent calls share the engines' continuous batches."""
        ...

    async def stats(self) -> list[EngineStats]:
        """The counters of every engine behind this client, in engine order."""
        ...

    async def ping(self, timeout_s: float | None = None) -> int:
        """Answered between two decode steps: the oldest policy_version the engines hold."""
        ...

    async def connect_transport(self, handle: TransportHandle, rank: int) -> None:
        """Attach to the trainer's weight transport; the engines behind this client take the
        transport ranks `rank`, `rank + 1`, ... in engine order."""
        ...

    async def sampling_states(self) -> list[SamplingState]:
        """The state of each engine's sampling generator (for requests without a seed), in
        engine order, taken between two decode steps: what a checkpoint keeps."""
        ...

    async def load_sampling_states(self, states: list[SamplingState]) -> None:
        """Give each engine, in engine order, the state `sampling_states` returned."""
        ...

    async def weights_crc32(self) -> list[tuple[int, int]]:
        """(policy_version, CRC32 of its weights in the transport's layout) of every engine, in
        engine order: equal to the trainer's `weights_crc32` for an engine that holds its version."""
        ...


class TrainerClient(Client, Protocol):
    async def step(self, groups: list[Group]) -> StepResult:
        """Train on one batch. The new weights stay with the trainer until `publish()`."""
        ...

    async def forward_ahead(self, groups: list[Group]) -> AheadResult:
        """Run the forward pass of `groups`, the coming batch's first groups, while the rest of
        it is still on its way; the next `step` (whose batch holds them) uses it. Says how many
        groups are held (0 where the trainer cannot: data-parallel ranks, a mixture-of-experts
        model) and the trainer's time for it."""
        ...

    async def publish(self, resend: bool = False) -> PublishResult:
        """Send the current weights through the transport as their policy_version (nothing is
        sent when the last step was skipped, unless `resend`: an engine that replaced a dead one
        needs them); once it returns, every engine can load it."""
        ...

    async def save(self, path: str) -> str:
        """Write the weights loadable by transformers (with LoRA: the peft adapter folder)."""
        ...

    async def save_checkpoint(self, path: str) -> int:
        """Write weights and optimizer/RNG state under `path`; returns their policy_version."""
        ...

    async def published(self) -> PublishResult:
        """Wait for the send the last `publish()` left under way (its result said `pending`:
        trainer.publish_overlap) and return what it cost; once it returns every engine can load the
        version. At once when the last publish was complete when it returned."""
        ...

    async def load_checkpoint(self, path: str) -> int:
        """Restore the state `save_checkpoint` wrote; returns its policy_version."""
        ...

    async def plan_transport(
        self, cfg: TransportConfig, num_engines: int, host: str | None, first_engines: int | None = None
    ) -> TransportHandle:
        """Open the sending end of the weight transport (transport rank 0) for `num_engines`
        engines, of which `first_engines` attach at the start and the others may join later (None:
        all at the start); `host` is where its services listen (None: this node's address)."""
        ...

    async def weights_crc32(self) -> tuple[int, int]:
        """(policy_version, CRC32 of the current weights as the transport sends them)."""
        ...

    async def connect_transport(self) -> None:
        """Rendezvous with the engines that attached to the planned transport."""
        ...


class RewardModelClient(Client, Protocol):
    async def score(self, texts: list[str], timeout_s: float) -> list[float]:
        """The reward model's score (its single logit) of each text, prompt + completion, in
        text order; a call not answered within `timeout_s` fails."""
        ...


class TeacherClient(Client, Protocol):
    async def logprobs(self, seqs: list[TokenSequence], timeout_s: float) -> list[list[float]]:
        """For each (prompt ids, completion ids), in order, log pi_teacher of every completion
        token given the tokens before it; a call not answered within `timeout_s` fails."""
        ...


class RewardWorkerClient(Client, Protocol):
    async def evaluate(
        self, kind: RewardKind, spec: str | Callable[..., Any], rows: list[RewardRow], timeout_s: float
    ) -> list[Outcome]:
        """One group's outcomes of the reward function `spec` (a name the worker resolves, or an
        importable callable) over `rows` (scoring/calls.py evaluate: a fault of the function is
        an Outcome, not an error); a call not answered within `timeout_s` fails."""
        ...
