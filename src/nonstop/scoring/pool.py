"""Where scoring work runs: a replaceable pool of actor processes, and the reward worker actor.

`ActorPool(backend, name, cls, args, size)` keeps `size` actors of `cls` (local processes or Ray
actors, through the runtime seam) and sends each call to the one with the fewest calls in
flight. A call that outlives its `timeout_s` kills its actor (a hung function cannot be
cancelled any other way); a call whose actor died, was killed or could not answer fails too.
Either way the actor is replaced by a fresh one (at most `max_restarts` times in all; None: no
limit), and the call fails with `CallFailed(reason)`: 'timeout', 'worker_died' (also the calls
that shared a killed actor), 'worker_error' (the actor itself raised), or 'no_restart_left'.
Retrying is the caller's decision (scoring/stage.py). The reward model and the distillation
teacher are ActorPools of one actor of their own class.

`RewardWorker` is the actor of `scoring.pool: process`: it resolves reward functions by name
('package.module:function' or a built-in) or receives importable callables, and runs one
group's rows per call (scoring/calls.py), sync functions on its own threads, so one worker
serves several calls at once.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nonstop.runtime.base import ActorBackend, ActorCallError, ActorDied, ActorHandle
from nonstop.scoring.calls import Kind, Outcome, PooledCalls, RewardRow
from nonstop.scoring.threads import DaemonThreads


class CallFailed(RuntimeError):
    """A scoring call failed; `counts` says how many samples failed by reason when that is known."""

    def __init__(self, reason: str, message: str, counts: dict[str, int] | None = None) -> None:
        super().__init__(message)
        self.reason, self.counts = reason, counts


@dataclass
class _Slot:
    actor: ActorHandle
    in_flight: int = 0
    replacing: asyncio.Task | None = None


class ActorPool:
    def __init__(
        self,
        backend: ActorBackend,
        name: str,
        cls: type,
        args: tuple = (),
        kwargs: dict | None = None,
        size: int = 1,
        max_restarts: int | None = None,
        log: Callable[[str], None] = print,
    ) -> None:
        self.backend, self.name, self.cls, self.args, self.kwargs = backend, name, cls, args, kwargs or {}
        self.size, self.max_restarts, self.log = size, max_restarts, log
        self.slots: list[_Slot] = []
        self.restarts = 0
        self._spawned = 0

    async def _spawn(self) -> ActorHandle:
        name = self.name if self.size == 1 and self._spawned == 0 else f"{self.name}-{self._spawned}"
        self._spawned += 1
        return await self.backend.spawn(name, self.cls, *self.args, **self.kwargs)

    async def start(self) -> None:
        actors = await asyncio.gather(*(self._spawn() for _ in range(self.size)))
        self.slots = [_Slot(a) for a in actors]

    async def _replace(self, slot: _Slot, dead: ActorHandle, why: str) -> None:
        """Kill `dead` and put a fresh actor in its slot (once, however many calls saw it fail)."""
        if slot.actor is not dead:
            return
        if slot.replacing is None:
            slot.replacing = asyncio.get_running_loop().create_task(
                self._respawn(slot, dead, why), name=f"{self.name}-replace"
            )
        await asyncio.shield(slot.replacing)

    async def _respawn(self, slot: _Slot, dead: ActorHandle, why: str) -> None:
        try:
            await dead.kill()
            if self.max_restarts is not None and self.restarts >= self.max_restarts:
                raise CallFailed(
                    "no_restart_left", f"{dead.name}: {why}; no restart left (max_restarts={self.max_restarts})"
                )
            self.restarts += 1
            self.log(f"[yellow]{dead.name}: {why}; starting a fresh one ({self.restarts})[/]")
            slot.actor = await self._spawn()
        finally:
            slot.replacing = None

    async def call(self, method: str, *args: Any, timeout_s: float) -> Any:
        slot = min(self.slots, key=lambda s: (s.replacing is not None, s.in_flight))
        if slot.replacing is not None:
            await asyncio.shield(slot.replacing)
        actor = slot.actor
        slot.in_flight += 1
        try:
            return await actor.call(method, *args, timeout_s=timeout_s)
        except TimeoutError:
            await self._replace(slot, actor, f"a call took over {timeout_s:g} s")
            raise CallFailed("timeout", f"{actor.name}.{method} did not answer within {timeout_s:g} s") from None
        except ActorDied as e:
            await self._replace(slot, actor, "it died")
            raise CallFailed("worker_died", str(e)) from None
        except ActorCallError as e:
            raise CallFailed("worker_error", str(e)) from None
        finally:
            slot.in_flight -= 1

    def alive(self) -> list[ActorHandle]:
        return [s.actor for s in self.slots]

    async def stop(self) -> None:
        await asyncio.gather(*(s.actor.stop() for s in self.slots), return_exceptions=True)


def _resolve(spec: str | Callable[..., Any]) -> Callable[..., Any]:
    if callable(spec):
        return spec
    from nonstop.orchestrator.score import resolve_reward

    return resolve_reward(spec)


class RewardWorker:
    """The reward actor of `scoring.pool: process` (see the module docstring)."""

    def __init__(self, threads: int = 8) -> None:
        self.executor = DaemonThreads(threads, "reward")
        self.calls = PooledCalls(self.executor)
        self.fns: dict[str, Callable[..., Any]] = {}

    async def evaluate(self, kind: Kind, spec: str | Callable[..., Any], rows: list[RewardRow]) -> list[Outcome]:
        key = spec if isinstance(spec, str) else repr(spec)
        fn = self.fns.get(key)
        if fn is None:
            fn = self.fns[key] = _resolve(spec)
        return await self.calls(kind, fn, rows)

    def close(self) -> None:
        self.executor.shutdown()


class Batcher:
    """Requests of concurrent groups merged into calls of at most `batch_size` items.

    One call is in flight at a time; the requests that arrive meanwhile wait and go together in
    the next (whole: a request larger than `batch_size` goes alone). A failed call fails every
    request it carried with the same error."""

    def __init__(self, name: str, send: Callable[[list[Any]], Any], batch_size: int) -> None:
        self.name, self.send, self.batch_size = name, send, batch_size
        self.waiting: deque[tuple[list[Any], asyncio.Future]] = deque()
        self.arrived = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.calls = 0

    async def submit(self, items: list[Any]) -> list[Any]:
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._serve(), name=f"{self.name}-batcher")
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self.waiting.append((items, fut))
        self.arrived.set()
        return await fut

    def _next_batch(self) -> list[tuple[list[Any], asyncio.Future]]:
        batch = [self.waiting.popleft()]
        size = len(batch[0][0])
        while self.waiting and size + len(self.waiting[0][0]) <= self.batch_size:
            batch.append(self.waiting.popleft())
            size += len(batch[-1][0])
        return batch

    async def _serve(self) -> None:
        while True:
            if not self.waiting:
                self.arrived.clear()
                await self.arrived.wait()
            batch = [(items, fut) for items, fut in self._next_batch() if not fut.done()]
            if not batch:
                continue
            self.calls += 1
            try:
                results = await self.send([x for items, _ in batch for x in items])
            except Exception as e:  # handed to every request of this call
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            at = 0
            for items, fut in batch:
                if not fut.done():
                    fut.set_result(results[at : at + len(items)])
                at += len(items)

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
