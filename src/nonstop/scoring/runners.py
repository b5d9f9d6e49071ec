"""Where reward functions run: the `Runner` seam of the scoring stage and its four implementations.

A runner takes one group's rows for one function and returns one `Outcome` per row (one for a
group function), or raises `CallFailed` when the call itself failed (a timeout, a dead worker).
`scoring.pool` picks it:

- `LoopRunner` ('loop') calls functions on the event loop, blocking it: how nonstop scored
  before the stage existed; kept for comparison, and the only runner without a timeout for sync
  functions.
- `ThreadRunner` ('thread') runs sync functions in the orchestrator's daemon threads
  (scoring/threads.py; async ones on the loop). A call past its timeout is abandoned and counted,
  its thread left to finish; a call that never returns cannot keep the process alive at exit.
- `ProcessRunner` ('process') sends calls to a RewardWorkerPool of RewardWorker processes (scoring/pool.py);
  a call past its timeout kills its worker, which is replaced.
- `AutoRunner` ('auto') starts every function on threads and moves a sync function
  that measures slower than SPLIT_ROW_S per sample to worker processes, started when the first
  such function appears. Such a function takes one thread per sample, and every thread's start
  and return is a hand-off of the interpreter lock that the event loop shares: a burst of groups
  under a 20 ms verifier (a batch of 32 x 8 samples) queues a few hundred hand-offs, each a
  context switch, and the last group of the batch, the one the trainer waits for, is scored
  10-20 ms late. Workers have locks of their own and split the hand-offs between them, at the
  price of the processors they run on (the reason 'auto' is not the default: on two cores the
  workers cost the engine and the trainer more than the hand-offs did). A function that cannot
  reach the workers (a lambda, a closure) stays on threads, said once in the log.
"""

from __future__ import annotations

import asyncio
import os
import pickle
from collections.abc import Callable
from typing import Any, Protocol

from nonstop.config.scoring import ScoringConfig
from nonstop.runtime.base import ActorBackend
from nonstop.scoring.calls import PooledCalls, evaluate
from nonstop.scoring.pool import CallFailed, RewardWorker, RewardWorkerPool
from nonstop.scoring.rewards import RewardError
from nonstop.scoring.threads import DaemonThreads
from nonstop.types import Outcome, RewardKind, RewardRow


class Runner(Protocol):
    async def start(self) -> None: ...

    async def run(
        self,
        kind: RewardKind,
        spec: str | Callable[..., Any],
        fn: Callable[..., Any],
        rows: list[RewardRow],
        timeout_s: float,
    ) -> list[Outcome]:
        """One group's outcomes; CallFailed when the call itself failed (timeout, dead worker)."""
        ...

    async def close(self) -> None: ...


class LoopRunner:
    async def start(self) -> None:
        pass

    async def run(
        self,
        kind: RewardKind,
        spec: str | Callable[..., Any],
        fn: Callable[..., Any],
        rows: list[RewardRow],
        timeout_s: float,
    ) -> list[Outcome]:
        return await evaluate(kind, fn, rows)

    async def close(self) -> None:
        pass


class ThreadRunner:
    def __init__(self, threads: int) -> None:
        self.executor = DaemonThreads(threads, "nonstop-reward")
        self.calls = PooledCalls(self.executor)

    async def start(self) -> None:
        pass

    async def run(
        self,
        kind: RewardKind,
        spec: str | Callable[..., Any],
        fn: Callable[..., Any],
        rows: list[RewardRow],
        timeout_s: float,
    ) -> list[Outcome]:
        try:
            return await asyncio.wait_for(self.calls(kind, fn, rows), timeout_s)
        except TimeoutError:
            raise CallFailed("timeout", f"the reward function did not return within {timeout_s:g} s") from None

    async def close(self) -> None:
        self.executor.shutdown()


class ProcessRunner:
    def __init__(self, backend: ActorBackend, workers: int, threads: int, log: Callable[[str], None]) -> None:
        # the user's folder goes along: a reward module beside their config resolves there too (config/specs.py)
        self.pool = RewardWorkerPool(
            backend, "reward-worker", RewardWorker, (threads, os.getcwd()), size=workers, log=log
        )

    async def start(self) -> None:
        await self.pool.start()

    async def run(
        self,
        kind: RewardKind,
        spec: str | Callable[..., Any],
        fn: Callable[..., Any],
        rows: list[RewardRow],
        timeout_s: float,
    ) -> list[Outcome]:
        return await self.pool.evaluate(kind, spec, rows, timeout_s)

    async def close(self) -> None:
        await self.pool.stop()


def shippable(spec: str | Callable[..., Any]) -> bool:
    """Whether a function can reach worker processes: a name travels as text, a callable if it pickles."""
    if isinstance(spec, str):
        return True
    try:
        pickle.dumps(spec)
    except Exception:  # a lambda, a closure, a bound method of something that does not pickle
        return False
    return True


class AutoRunner:
    """Threads, and worker processes for the slow sync functions (see the module docstring).

    A function moves once and stays: its calls go to the workers as soon as they have started
    (until then, and if they cannot start, they stay on threads)."""

    def __init__(self, backend: ActorBackend | None, workers: int, threads: int, log: Callable[[str], None]) -> None:
        self.threads = ThreadRunner(threads)
        self.backend, self.workers, self.worker_threads, self.log = backend, workers, max(1, threads // workers), log
        self.process: ProcessRunner | None = None  # set once its workers are up
        self.moved: set[int] = set()  # id(fn) of the functions whose calls go to the workers
        self.kept: set[int] = set()  # id(fn) of slow functions that stay on threads
        self._starting: asyncio.Task[None] | None = None

    async def start(self) -> None:
        pass

    async def run(
        self,
        kind: RewardKind,
        spec: str | Callable[..., Any],
        fn: Callable[..., Any],
        rows: list[RewardRow],
        timeout_s: float,
    ) -> list[Outcome]:
        key = id(fn)
        if key in self.moved and self.process is not None:
            return await self.process.run(kind, spec, fn, rows, timeout_s)
        outcomes = await self.threads.run(kind, spec, fn, rows, timeout_s)
        if key not in self.moved and key not in self.kept and self.threads.calls.splits(fn):
            self._move(spec, fn)
        return outcomes

    def _move(self, spec: str | Callable[..., Any], fn: Callable[..., Any]) -> None:
        name = spec if isinstance(spec, str) else getattr(fn, "__qualname__", repr(fn))
        ms = 1e3 * self.threads.calls.seconds_per_row(fn)
        if self.backend is None or not shippable(spec):
            self.kept.add(id(fn))
            why = "no actor backend" if self.backend is None else "it cannot be sent to worker processes"
            self.log(
                f"scoring: {name} takes {ms:.1f} ms per sample; it stays on threads ({why}: "
                "a module-level function in an importable module can move to processes)"
            )
            return
        self.moved.add(id(fn))
        self.log(
            f"scoring: {name} takes {ms:.1f} ms per sample; its calls move to {self.workers} worker "
            "processes (scoring.pool auto; 'thread' keeps them here)"
        )
        if self._starting is None:
            self._starting = asyncio.get_running_loop().create_task(self._start_workers(), name="scoring-workers")

    async def _start_workers(self) -> None:
        assert self.backend is not None
        runner = ProcessRunner(self.backend, self.workers, self.worker_threads, self.log)
        try:
            await runner.start()
        except Exception as e:  # the run goes on, scored on threads as before
            self.log(
                f"[yellow]scoring: worker processes did not start ({type(e).__name__}: {e}); rewards stay on threads[/]"
            )
            await runner.close()
            self.kept |= self.moved
            self.moved.clear()
            return
        self.process = runner

    async def close(self) -> None:
        if self._starting is not None:
            self._starting.cancel()
            await asyncio.gather(self._starting, return_exceptions=True)
        if self.process is not None:
            await self.process.close()
        await self.threads.close()


def make_runner(cfg: ScoringConfig, backend: ActorBackend | None, log: Callable[[str], None]) -> Runner:
    if cfg.pool == "loop":
        return LoopRunner()
    if cfg.pool == "thread":
        return ThreadRunner(cfg.concurrency)
    if cfg.pool == "auto":
        return AutoRunner(backend, cfg.workers, cfg.concurrency, log)
    if backend is None:
        raise RewardError("scoring.pool: 'process' needs an actor backend")
    return ProcessRunner(backend, cfg.workers, max(1, cfg.concurrency // cfg.workers), log)
