"""Where scoring work runs: a replaceable pool of actor processes, and the reward worker actor.

`ActorPool(backend, name, cls, args, size)` keeps `size` actors of `cls` (local processes or Ray
actors, through the runtime seam), each behind its typed one-actor client (runtime/actor_clients.py),
and sends each call to the one with the fewest calls in flight. A call that outlives its
`timeout_s` kills its actor (a hung function cannot be cancelled any other way); a call whose
actor died, was killed or could not answer fails too. Either way the actor is replaced by a fresh
one (at most `max_restarts` times in all; None: no limit), and the call fails with
`CallFailed(reason)`: 'timeout', 'worker_died' (also the calls that shared a killed actor),
'worker_error' (the actor itself raised), or 'no_restart_left'. Retrying is the caller's decision
(scoring/stage.py). The pool offers its actors' calls only as typed methods, one subclass per kind
of actor: `RewardModelPool.score` (nonstop.clients.RewardModelClient), `TeacherPool.logprobs`
(TeacherClient) and `RewardWorkerPool.evaluate` (RewardWorkerClient); the reward model and the
distillation teacher are pools of one actor.

`RewardWorker` is the actor of `scoring.pool: process`: it resolves reward functions by name
('package.module:function' or a built-in) or receives importable callables, and runs one
group's rows per call (scoring/calls.py), sync functions on its own threads, so one worker
serves several calls at once.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from nonstop.clients import Client, TokenSequence
from nonstop.errors import ScoringError
from nonstop.runtime.actor_clients import RewardModelActor, RewardWorkerActor, TeacherActor
from nonstop.runtime.base import ActorBackend, ActorCallError, ActorDied, ActorHandle
from nonstop.scoring.calls import PooledCalls
from nonstop.scoring.rewards import resolve_reward
from nonstop.scoring.threads import DaemonThreads
from nonstop.types import Outcome, RewardKind, RewardRow


class CallFailed(ScoringError, RuntimeError):
    """A scoring call failed; `counts` says how many samples failed by reason when that is known."""

    def __init__(self, reason: str, message: str, counts: dict[str, int] | None = None) -> None:
        super().__init__(message)
        self.reason, self.counts = reason, counts


class _OneActorClient(Client, Protocol):
    actor: ActorHandle  # the handle behind the client (runtime/actor_clients.py)


A = TypeVar("A", bound=_OneActorClient)  # the typed one-actor client of a slot
T = TypeVar("T")


@dataclass
class _Slot(Generic[A]):
    actor: A
    in_flight: int = 0
    replacing: asyncio.Task | None = None


class ActorPool(Generic[A]):
    """Replaceable actors of one class behind typed one-actor clients (see the module docstring).

    Subclasses name the client (`_client`) and turn each of its calls into a typed method through
    `_on_least_loaded`; the pool itself never names an actor method."""

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
        self.slots: list[_Slot[A]] = []
        self.restarts = 0
        self._spawned = 0

    def _client(self, actor: ActorHandle) -> A:
        raise NotImplementedError

    async def _spawn(self) -> A:
        name = self.name if self.size == 1 and self._spawned == 0 else f"{self.name}-{self._spawned}"
        self._spawned += 1
        return self._client(await self.backend.spawn(name, self.cls, *self.args, **self.kwargs))

    async def start(self) -> None:
        actors = await asyncio.gather(*(self._spawn() for _ in range(self.size)))
        self.slots = [_Slot(a) for a in actors]

    async def _replace(self, slot: _Slot[A], dead: A, why: str) -> None:
        """Kill `dead` and put a fresh actor in its slot (once, however many calls saw it fail)."""
        if slot.actor is not dead:
            return
        if slot.replacing is None:
            slot.replacing = asyncio.get_running_loop().create_task(
                self._respawn(slot, dead, why), name=f"{self.name}-replace"
            )
        await asyncio.shield(slot.replacing)

    async def _respawn(self, slot: _Slot[A], dead: A, why: str) -> None:
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

    async def _on_least_loaded(self, what: str, timeout_s: float, call: Callable[[A], Awaitable[T]]) -> T:
        """`call(client)` on the actor with the fewest calls in flight (`what` names it in messages);
        the failures and replacement of the module docstring. `call` must pass `timeout_s` on."""
        slot = min(self.slots, key=lambda s: (s.replacing is not None, s.in_flight))
        if slot.replacing is not None:
            await asyncio.shield(slot.replacing)
        actor = slot.actor
        slot.in_flight += 1
        try:
            return await call(actor)
        except TimeoutError:
            await self._replace(slot, actor, f"a call took over {timeout_s:g} s")
            raise CallFailed("timeout", f"{actor.name}.{what} did not answer within {timeout_s:g} s") from None
        except ActorDied as e:
            await self._replace(slot, actor, "it died")
            raise CallFailed("worker_died", str(e)) from None
        except ActorCallError as e:
            raise CallFailed("worker_error", str(e)) from None
        finally:
            slot.in_flight -= 1

    def alive(self) -> list[ActorHandle]:
        """The current actor of every slot."""
        return [s.actor.actor for s in self.slots]

    def is_alive(self) -> bool:
        return bool(self.slots) and all(s.actor.is_alive() for s in self.slots)

    async def stop(self, timeout_s: float = 10.0) -> None:
        await asyncio.gather(*(s.actor.stop(timeout_s) for s in self.slots), return_exceptions=True)

    async def kill(self) -> None:
        await asyncio.gather(*(s.actor.kill() for s in self.slots), return_exceptions=True)


class RewardModelPool(ActorPool[RewardModelActor]):
    """A RewardModelClient over replaceable reward model actors (scoring/reward_model.py RewardModelWorker)."""

    def _client(self, actor: ActorHandle) -> RewardModelActor:
        return RewardModelActor(actor)

    async def score(self, texts: list[str], timeout_s: float) -> list[float]:
        return await self._on_least_loaded("score", timeout_s, lambda a: a.score(texts, timeout_s))


class TeacherPool(ActorPool[TeacherActor]):
    """A TeacherClient over replaceable teacher actors (scoring/teacher.py TeacherWorker)."""

    def _client(self, actor: ActorHandle) -> TeacherActor:
        return TeacherActor(actor)

    async def logprobs(self, seqs: list[TokenSequence], timeout_s: float) -> list[list[float]]:
        return await self._on_least_loaded("logprobs", timeout_s, lambda a: a.logprobs(seqs, timeout_s))


class RewardWorkerPool(ActorPool[RewardWorkerActor]):
    """A RewardWorkerClient over replaceable RewardWorker actors (below)."""

    def _client(self, actor: ActorHandle) -> RewardWorkerActor:
        return RewardWorkerActor(actor)

    async def evaluate(
        self, kind: RewardKind, spec: str | Callable[..., Any], rows: list[RewardRow], timeout_s: float
    ) -> list[Outcome]:
        return await self._on_least_loaded("evaluate", timeout_s, lambda a: a.evaluate(kind, spec, rows, timeout_s))


def _resolve(spec: str | Callable[..., Any], folder: str | None) -> Callable[..., Any]:
    if callable(spec):
        return spec
    return resolve_reward(spec, folder=folder)


class RewardWorker:
    """The reward actor of `scoring.pool: process` (see the module docstring). `folder`: the folder
    the user runs nonstop in, where a spec's module is looked for when it is not on the Python path
    (config/specs.py), as in the orchestrator: this process's own folder may be another (a Ray
    worker's is)."""

    def __init__(self, threads: int = 8, folder: str | None = None) -> None:
        self.folder = folder
        self.executor = DaemonThreads(threads, "reward")
        self.calls = PooledCalls(self.executor)
        self.fns: dict[str, Callable[..., Any]] = {}

    async def evaluate(self, kind: RewardKind, spec: str | Callable[..., Any], rows: list[RewardRow]) -> list[Outcome]:
        key = spec if isinstance(spec, str) else repr(spec)
        fn = self.fns.get(key)
        if fn is None:
            fn = self.fns[key] = _resolve(spec, self.folder)
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
