"""A fixed pool of daemon threads that hands a batch of jobs back to the event loop in one wake-up.

Sync reward functions run here, off the orchestrator's loop (scoring.pool 'thread') or off a
reward worker's loop (pool 'process'). Two properties matter:

- Daemon threads: a reward call that never returns cannot keep the process alive at exit
  (ThreadPoolExecutor joins its threads at interpreter shutdown). A call past its timeout is
  abandoned where it runs; its result, if it ever comes, is discarded.
- One loop wake-up per batch: `run_all(calls)` queues every call as its own job and resolves one
  asyncio future when the last of them is done. `loop.run_in_executor` per call would cost the
  loop a concurrent Future, a chained asyncio Future and a wake-up per call, all under the GIL the
  loop shares with these threads: with a slow reward split into one job per row, that hand-off
  work on the loop (not the reward) was what made a group late.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class _Batch(Generic[T]):
    """The results of one `run_all`; the job that finishes last resolves the future on its loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, n: int) -> None:
        self.loop, self.left, self.lock = loop, n, threading.Lock()
        self.future: asyncio.Future[list[T]] = loop.create_future()
        self.results: list[Any] = [None] * n
        self.error: BaseException | None = None

    def run(self, i: int, call: Callable[[], T]) -> None:
        try:
            self.results[i] = call()
        except BaseException as e:  # handed to the awaiting coroutine, not lost in a thread
            self.error = self.error or e
        with self.lock:
            self.left -= 1
            last = self.left == 0
        if last:
            try:
                self.loop.call_soon_threadsafe(self._resolve)
            except RuntimeError:  # the loop closed meanwhile (the run ended): nobody awaits
                pass

    def _resolve(self) -> None:
        if self.future.done():  # cancelled: the call timed out and was abandoned
            return
        if self.error is not None:
            self.future.set_exception(self.error)
        else:
            self.future.set_result(self.results)


class DaemonThreads:
    """At most `threads` daemon threads, started when a job finds every thread taken (a cheap
    reward keeps a few; a burst of slow calls grows the pool to its cap), then kept for the run."""

    def __init__(self, threads: int, name: str) -> None:
        self.max_threads, self.name = threads, name
        self.jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.threads: list[threading.Thread] = []
        self.outstanding = 0  # jobs queued or running; the pool holds min(outstanding, max_threads) threads or more
        self.lock = threading.Lock()

    def _work(self) -> None:
        while (job := self.jobs.get()) is not None:
            job()
            with self.lock:
                self.outstanding -= 1

    def _put(self, job: Callable[[], None]) -> None:
        with self.lock:
            self.outstanding += 1
            thread = None
            if self.outstanding > len(self.threads) and len(self.threads) < self.max_threads:
                thread = threading.Thread(target=self._work, name=f"{self.name}-{len(self.threads)}", daemon=True)
                self.threads.append(thread)
        if thread is not None:
            thread.start()
        self.jobs.put(job)

    def run_all(self, calls: Sequence[Callable[[], T]]) -> asyncio.Future[list[T]]:
        """Run each call as its own job; the future holds their results in order, or the first
        exception one of them raised, once all are done. Call it from the event loop."""
        batch: _Batch[T] = _Batch(asyncio.get_running_loop(), len(calls))
        if not calls:
            batch.future.set_result([])
        for i, call in enumerate(calls):
            self._put(lambda i=i, call=call: batch.run(i, call))  # type: ignore[misc]
        return batch.future

    def shutdown(self) -> None:
        """Threads end after their current job; a job that never returns keeps its thread, which
        does not hold up the process's exit."""
        with self.lock:
            self.max_threads = 0  # no thread starts after this
            started = len(self.threads)
        for _ in range(started):
            self.jobs.put(None)
