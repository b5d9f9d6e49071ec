"""A restartable engine: an EngineClient that outlives crashes and hangs of the actor behind it.

`RestartingEngine` forwards each call to its current engine. When that engine dies (crash,
kill, or declared hung by the heartbeat) the failed call is made again on a fresh engine from
`start()`, so the prompts a `generate` carried are re-submitted, not lost (counted in
`faults.requeued`). Concurrent calls that fail together cause one restart, not several. After
`max_restarts` restarts the next death is final: ActorDied propagates and the run ends.

A restart runs as a task of its own, which every caller of that engine's generation awaits
(shielded). A caller cancelled meanwhile (a producer at the run's end, a sibling call's failure)
leaves the replacement going: abandoned halfway, a Ray actor already requested would still be placed
and hold its node's resources, while the next caller's second request waited for them for good.

The heartbeat (`heartbeat()`, run as a supervised task) pings the engine every `interval_s`;
an engine that does not answer within `timeout_s` is killed, which turns a hang into a death
that the pending calls recover from. Each restart is recorded with the time to detect the
fault and the time to have a working replacement.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from nonstop.clients import EngineClient, EngineStats, SamplingState
from nonstop.runtime.base import ActorDied
from nonstop.types import GenerationRequest, Sample, TransportHandle

T = TypeVar("T")


@dataclass
class Restart:
    reason: str
    detect_s: float  # fault -> noticed (0 for a crash seen by a call; up to interval + timeout for a hang)
    recover_s: float  # noticed -> replacement ready
    requeued: int  # prompts of the calls that were re-submitted
    noticed_at: float = 0.0  # wall clock (time.time()) when noticed: to measure against a fault made outside


@dataclass
class RestartStats:
    restarts: list[Restart] = field(default_factory=list)
    requeued: int = 0  # all prompts re-submitted after restarts

    def summary(self) -> dict:
        return {
            "restarts": len(self.restarts),
            "requeued": self.requeued,
            "max_detect_s": max((r.detect_s for r in self.restarts), default=0.0),
            "max_recover_s": max((r.recover_s for r in self.restarts), default=0.0),
            "reasons": [r.reason for r in self.restarts],
            "noticed_at": [r.noticed_at for r in self.restarts],
            "recover_s": [r.recover_s for r in self.restarts],
        }


class RestartingEngine:
    def __init__(
        self,
        name: str,
        start: Callable[[], Awaitable[EngineClient]],
        max_restarts: int,
        interval_s: float,
        timeout_s: float,
        log: Callable[[str], None] = lambda msg: None,
        engine: EngineClient | None = None,
    ) -> None:
        """`start()` makes a replacement (spawned, attached to the transport, ready for calls);
        `engine` is the first one, if already running (else call `begin()`)."""
        self.name = name
        self._start = start
        self.max_restarts = max_restarts
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._log = log
        self.engine = engine
        self.generation = 0  # bumped by every restart; a failure of an older generation is already handled
        self.faults = RestartStats()
        self._lock = asyncio.Lock()
        self._replacing: asyncio.Task[None] | None = None  # the restart in progress, awaited by every caller
        self._hung_since: float | None = None
        self._last: dict[str, Any] = {}  # the last answer of each reporting call (_report)

    async def begin(self) -> "RestartingEngine":
        self.engine = await self._start()
        return self

    async def _retry(self, call: Callable[[EngineClient], Awaitable[T]], prompts: int = 0) -> T:
        """Make `call` on the current engine; after a death, again on its replacement."""
        while True:
            engine, generation = self.engine, self.generation
            assert engine is not None, "begin() first"
            try:
                return await call(engine)
            except ActorDied as e:
                await self._restart(generation, str(e), time.monotonic())
                self.faults.requeued += prompts
                if self.faults.restarts:
                    self.faults.restarts[-1].requeued += prompts

    async def generate(self, requests: list[GenerationRequest], timeout_s: float | None = None) -> list[list[Sample]]:
        return await self._retry(lambda e: e.generate(requests, timeout_s), prompts=len(requests))

    async def _report(self, what: str, call: Callable[[EngineClient], Awaitable[T]]) -> T:
        """A call that only reports (counters, sampling state): while the engine is down or being
        replaced (which can take minutes: a node-loss replacement may wait for a node), the last
        answer it gave, so the learning loop's per-step report and its checkpoints never wait for
        the replacement; the heartbeat and the calls that need the engine do the restarting."""
        last = self._last.get(what)
        if last is not None and (self._lock.locked() or not self.is_alive()):
            return last
        engine = self.engine
        assert engine is not None, "begin() first"
        try:
            answer = await call(engine)
        except ActorDied:
            if last is not None:
                return last
            answer = await self._retry(call)
        self._last[what] = answer
        return answer

    async def stats(self) -> list[EngineStats]:
        return await self._report("stats", lambda e: e.stats())

    async def ping(self, timeout_s: float | None = None) -> int:
        return await self._retry(lambda e: e.ping(timeout_s))

    async def connect_transport(self, handle: TransportHandle, rank: int) -> None:
        await self._retry(lambda e: e.connect_transport(handle, rank))

    async def sampling_states(self) -> list[SamplingState]:
        """For a checkpoint; while the engine is being replaced, the state it had at the last one
        (the replacement starts a fresh stream anyway)."""
        return await self._report("sampling_states", lambda e: e.sampling_states())

    async def load_sampling_states(self, states: list[SamplingState]) -> None:
        await self._retry(lambda e: e.load_sampling_states(states))

    async def weights_crc32(self) -> list[tuple[int, int]]:
        return await self._retry(lambda e: e.weights_crc32())

    async def _restart(self, generation: int, reason: str, noticed: float) -> None:
        """Replace the engine of `generation` (a newer one is already a replacement: nothing to do),
        or wait for the restart already under way."""
        task = self._replacing
        if task is None or task.done():
            if generation != self.generation:
                return
            task = asyncio.get_running_loop().create_task(
                self._replace(generation, reason, noticed), name=f"{self.name}-restart"
            )
            # its failure reaches every caller that awaits it; one nobody awaits any more is seen
            # again by the next call (the engine is still down)
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
            self._replacing = task
        await asyncio.shield(task)

    async def _replace(self, generation: int, reason: str, noticed: float) -> None:
        async with self._lock:
            if generation != self.generation:
                return  # another call already replaced that engine
            detect_s = noticed - self._hung_since if self._hung_since is not None else 0.0
            noticed_at = time.time() - (time.monotonic() - noticed)
            self._hung_since = None
            while True:  # a replacement that dies while starting uses up a restart too
                if len(self.faults.restarts) >= self.max_restarts:
                    raise ActorDied(f"{reason}; no restart left (runtime.max_engine_restarts={self.max_restarts})")
                self._log(
                    f"[yellow]{self.name}: {reason}; restarting ({len(self.faults.restarts) + 1} of at most "
                    f"{self.max_restarts})[/]"
                )
                old = self.engine
                if old is not None:
                    await old.kill()
                t0 = time.monotonic()
                try:
                    replacement = await self._start()
                except ActorDied as e:
                    replacement, died = None, e
                self.faults.restarts.append(Restart(reason, detect_s, time.monotonic() - t0, 0, noticed_at))
                if replacement is None:
                    reason = f"{died} (while restarting)"
                    continue
                self.engine = replacement
                self.generation += 1
                return

    async def heartbeat(self) -> None:
        """Runs until cancelled: ping, and kill an engine that stays silent for timeout_s."""
        while True:  # a cancellation the ping's wait_for swallows (3.11) is repeated by the supervisor
            await asyncio.sleep(self.interval_s)
            engine, generation = self.engine, self.generation
            if engine is None:
                continue
            sent = time.monotonic()
            try:
                await engine.ping(timeout_s=self.timeout_s)
            except TimeoutError:
                if generation == self.generation:
                    self._hung_since = sent
                    await engine.kill()  # pending calls fail with ActorDied and restart it
            except ActorDied as e:
                await self._restart(generation, str(e), time.monotonic())

    def is_alive(self) -> bool:
        return self.engine is not None and self.engine.is_alive()

    async def _abandon_restart(self) -> None:
        """The run ends: a restart still under way is cancelled (its start withdraws what it asked for)."""
        task = self._replacing
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def stop(self, timeout_s: float = 10.0) -> None:
        await self._abandon_restart()
        if self.engine is not None:
            await self.engine.stop(timeout_s)

    async def kill(self) -> None:
        await self._abandon_restart()
        if self.engine is not None:
            await self.engine.kill()
