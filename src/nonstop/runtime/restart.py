"""A restartable actor: an ActorHandle that outlives crashes and hangs of the process behind it.

`RestartingActor` forwards `call` to its current actor. When that actor dies (crash, kill, or
declared hung by the heartbeat) the failed call is made again on a fresh actor from `start()`,
so whatever the call carried (for an engine: the prompts it was generating) is re-submitted,
not lost. Concurrent calls that fail together cause one restart, not several. After
`max_restarts` restarts the next death is final: ActorDied propagates and the run ends.

The heartbeat (`heartbeat()`, run as a supervised task) pings the actor every `interval_s`; an
actor that does not answer within `timeout_s` is killed, which turns a hang into a death that
the pending calls recover from. Each restart is recorded with the time to detect the fault
and the time to have a working replacement.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from nonstop.runtime.base import ActorDied, ActorHandle


@dataclass
class Restart:
    reason: str
    detect_s: float  # fault -> noticed (0 for a crash seen by a call; up to interval + timeout for a hang)
    recover_s: float  # noticed -> replacement ready
    requeued: int  # items (e.g. prompts) of the calls that were re-submitted


@dataclass
class RestartStats:
    restarts: list[Restart] = field(default_factory=list)
    requeued: int = 0  # all items re-submitted after restarts

    def summary(self) -> dict:
        return {
            "restarts": len(self.restarts), "requeued": self.requeued,
            "max_detect_s": max((r.detect_s for r in self.restarts), default=0.0),
            "max_recover_s": max((r.recover_s for r in self.restarts), default=0.0),
            "reasons": [r.reason for r in self.restarts],
        }


class RestartingActor:
    def __init__(
        self, name: str, start: Callable[[], Awaitable[ActorHandle]], max_restarts: int,
        interval_s: float, timeout_s: float, count_items: Callable[[str, tuple], int] = lambda m, a: 0,
        log: Callable[[str], None] = lambda msg: None, actor: ActorHandle | None = None,
    ) -> None:
        """`start()` makes a replacement (spawned and ready for calls); `actor` is the first one, if
        already running (else call `begin()`); `count_items(method, args)` says how many items a
        re-submitted call carries, for the metrics."""
        self.name = name
        self._start = start
        self.max_restarts = max_restarts
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._count_items = count_items
        self._log = log
        self.actor = actor
        self.generation = 0  # bumped by every restart; a failure of an older generation is already handled
        self.stats = RestartStats()
        self._lock = asyncio.Lock()
        self._hung_since: float | None = None

    async def begin(self) -> "RestartingActor":
        self.actor = await self._start()
        return self

    async def call(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
        while True:
            actor, generation = self.actor, self.generation
            assert actor is not None, "begin() first"
            try:
                return await actor.call(method, *args, timeout_s=timeout_s, **kwargs)
            except ActorDied as e:
                await self._restart(generation, str(e), time.monotonic())
                items = self._count_items(method, args)
                self.stats.requeued += items
                if self.stats.restarts:
                    self.stats.restarts[-1].requeued += items

    async def _restart(self, generation: int, reason: str, noticed: float) -> None:
        async with self._lock:
            if generation != self.generation:
                return  # another call already replaced that actor
            if len(self.stats.restarts) >= self.max_restarts:
                raise ActorDied(f"{reason}; no restart left (runtime.max_engine_restarts={self.max_restarts})")
            detect_s = noticed - self._hung_since if self._hung_since is not None else 0.0
            self._hung_since = None
            self._log(f"[yellow]{self.name}: {reason}; restarting ({len(self.stats.restarts) + 1} of at most "
                      f"{self.max_restarts})[/]")
            old = self.actor
            if old is not None:
                await old.kill()
            t0 = time.monotonic()
            self.actor = await self._start()
            self.generation += 1
            self.stats.restarts.append(Restart(reason, detect_s, time.monotonic() - t0, 0))

    async def heartbeat(self) -> None:
        """Runs until cancelled: ping, and kill an actor that stays silent for timeout_s."""
        while True:
            await asyncio.sleep(self.interval_s)
            actor, generation = self.actor, self.generation
            if actor is None:
                continue
            sent = time.monotonic()
            try:
                await actor.call("ping", timeout_s=self.timeout_s)
            except TimeoutError:
                if generation == self.generation:
                    self._hung_since = sent
                    await actor.kill()  # pending calls fail with ActorDied and restart it
            except ActorDied as e:
                await self._restart(generation, str(e), time.monotonic())

    def is_alive(self) -> bool:
        return self.actor is not None and self.actor.is_alive()

    async def stop(self, timeout_s: float = 10.0) -> None:
        if self.actor is not None:
            await self.actor.stop(timeout_s)

    async def kill(self) -> None:
        if self.actor is not None:
            await self.actor.kill()
