"""Local-process actor backend: one spawned OS process per actor, one pipe per actor.

Wire protocol over a duplex `multiprocessing` pipe: the parent sends `(call_id, method, args,
kwargs)`; the child answers `(call_id, ok, value)` where value is the result or a formatted
remote traceback. The child sets `torch.set_num_threads(1)` before it builds its object, so
actors never oversubscribe cores; it names itself by role (`nonstop: engine-0` in `ps`) and
dies with the orchestrator (procinfo.py), so a killed orchestrator leaves no actor behind. With
`runtime.pin_cpus`, it first pins itself to its role's CPUs, and `LocalBackend.pools` measures each
pool's CPU time (runtime/pinning.py).

Call semantics (the same on every backend): the child runs an asyncio loop. Methods declared
`async def` run as tasks on that loop, concurrently with each other, so an engine can take new
requests while earlier ones decode. Plain methods run one at a time, in arrival order, on one
worker thread, so they never block the loop. Answers may therefore arrive out of order; the
parent matches them by call id.

The parent never polls: it registers the pipe with the event loop (`add_reader`) and resolves
the matching future when an answer arrives. The child's answers are written by one writer
thread (`_Outbox`), never by its loop: both ends blocking in `send` on full pipes at once would
deadlock (it happened with multi-turn episodes, whose many small calls and answers fill both
64 KiB pipe buffers). With the child's loop free to read, a parent blocked in `send` is released
as soon as the child's loop runs again. When the child dies the pipe hits EOF, and every
pending call fails at once with ActorDied naming the actor and its exit code; a call that
outlives its timeout fails with TimeoutError naming the actor and the method.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import itertools
import multiprocessing as mp
import os
import queue
import signal
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from nonstop.config import BaseRuntimeConfig
from nonstop.runtime.base import ActorCallError, ActorDied
from nonstop.runtime.oom import death_reason
from nonstop.runtime.pinning import PoolMeter, pin, role_of
from nonstop.runtime.procinfo import die_with_parent, name_process
from nonstop.sizing.machine import oom_kills

_READY = -1
_CLOSE = object()


class _Outbox:
    """The child's answers in order, sent by one thread; `put` never blocks the child's loop.

    A full pipe (the parent busy) blocks this thread only, so the loop keeps reading the parent's
    calls. If the parent is gone, the thread ends; the loop learns it from EOF on its reader."""

    def __init__(self, conn: Connection, name: str) -> None:
        self._conn = conn
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"nonstop-{name}-outbox", daemon=True)
        self._thread.start()

    def put(self, message: Any) -> None:
        self._queue.put(message)

    def _run(self) -> None:
        while (message := self._queue.get()) is not _CLOSE:
            try:
                self._conn.send(message)
            except (BrokenPipeError, OSError):
                return

    def close(self, timeout_s: float) -> None:
        """Send what is queued, then end the thread (waits at most `timeout_s`)."""
        self._queue.put(_CLOSE)
        self._thread.join(timeout_s)


def _child_main(
    conn: Connection, name: str, cls: type, args: tuple, kwargs: dict, parent_pid: int, cpus: frozenset[int] | None
) -> None:
    pin(cpus)  # before torch starts its threads: they inherit the set
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the orchestrator decides when actors stop
    die_with_parent(parent_pid)
    name_process(name)
    import torch  # spawn: in the actor's process, after pin(), so torch's threads inherit its CPU set

    torch.set_num_threads(1)
    asyncio.run(_serve(conn, name, cls, args, kwargs))


async def _serve(conn: Connection, name: str, cls: type, args: tuple, kwargs: dict) -> None:
    """Build the object inside the loop (so it may start tasks), then answer calls until stopped."""
    loop = asyncio.get_running_loop()
    try:
        obj = cls(*args, **kwargs)
    except BaseException:
        conn.send((_READY, False, f"actor {name} failed to start:\n{traceback.format_exc()}"))
        return
    serial = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"nonstop-{name}")
    outbox = _Outbox(conn, name)
    calls: set[asyncio.Task] = set()
    stop: asyncio.Future = loop.create_future()

    async def answer(call_id: int, method: str, a: tuple, kw: dict) -> None:
        try:
            fn = getattr(obj, method)
            if inspect.iscoroutinefunction(fn):
                value = await fn(*a, **kw)
            else:
                value = await loop.run_in_executor(serial, functools.partial(fn, *a, **kw))
            reply = (call_id, True, value)
        except BaseException:
            reply = (call_id, False, f"{name}.{method} raised:\n{traceback.format_exc()}")
        outbox.put(reply)

    def on_readable() -> None:
        # Every call already waiting is taken in one go: calls that arrive together (a step's groups)
        # then reach the engine before its next forward pass, not one per pass.
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                msg = "eof"  # the orchestrator went away
            if msg is None or msg == "eof":
                loop.remove_reader(conn.fileno())
                if not stop.done():
                    stop.set_result(msg)
                return
            call_id, method, a, kw = msg
            task = loop.create_task(answer(call_id, method, a, kw), name=f"{name}.{method}#{call_id}")
            calls.add(task)
            task.add_done_callback(calls.discard)
            if not conn.poll():
                return

    conn.send((_READY, True, os.getpid()))
    loop.add_reader(conn.fileno(), on_readable)
    how = await stop
    for task in list(calls):
        task.cancel()
    if how is None:
        closer = getattr(obj, "close", None)
        if callable(closer):
            if inspect.iscoroutinefunction(closer):
                await closer()
            else:
                await loop.run_in_executor(serial, closer)
        outbox.put((None, True, None))
    outbox.close(timeout_s=10.0)
    serial.shutdown(wait=False, cancel_futures=True)


class LocalActor:
    def __init__(self, name: str, process: mp.process.BaseProcess, conn: Connection, call_timeout_s: float):
        self.name = name
        self.process = process
        self.pid = process.pid
        self.conn = conn
        self.call_timeout_s = call_timeout_s
        self.oom_before = oom_kills()  # the cgroup's OOM kills so far: a rise at its death names the OOM killer
        self._ids = itertools.count()
        self._pending: dict[int | None, asyncio.Future] = {}
        self._dead: str | None = None
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(conn.fileno(), self._on_readable)

    def _death_reason(self) -> str:
        self.process.join(timeout=1.0)
        return death_reason(self.name, self.process.pid, self.process.exitcode, self.oom_before)

    def _on_readable(self) -> None:
        while self._dead is None:  # every answer already waiting, in one go
            try:
                call_id, ok, value = self.conn.recv()
            except (EOFError, OSError):
                self._mark_dead(self._death_reason())
                return
            fut = self._pending.pop(call_id, None)
            if fut is not None and not fut.done():
                if ok:
                    fut.set_result(value)
                else:
                    fut.set_exception(ActorDied(value) if call_id == _READY else ActorCallError(value))
            try:
                if not self.conn.poll():
                    return
            except (EOFError, OSError):
                self._mark_dead(self._death_reason())
                return

    def _mark_dead(self, reason: str) -> None:
        if self._dead is None:
            self._dead = reason
            self._loop.remove_reader(self.conn.fileno())
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(ActorDied(reason))
        self._pending.clear()

    async def _await(self, call_id: int | None, what: str, timeout_s: float) -> Any:
        fut = self._loop.create_future()
        self._pending[call_id] = fut
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            self._pending.pop(call_id, None)
            raise TimeoutError(f"actor '{self.name}': {what} did not answer within {timeout_s:g} s") from None

    async def wait_ready(self, timeout_s: float) -> None:
        await self._await(_READY, "start-up", timeout_s)

    async def call(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
        if self._dead is not None:
            raise ActorDied(self._dead)
        call_id = next(self._ids)
        try:
            self.conn.send((call_id, method, args, kwargs))
        except (BrokenPipeError, OSError):
            self._mark_dead(self._death_reason())
            raise ActorDied(self._dead) from None
        return await self._await(call_id, f"call '{method}'", timeout_s or self.call_timeout_s)

    def is_alive(self) -> bool:
        return self._dead is None and self.process.is_alive()

    async def kill(self) -> None:
        """End the process at once (SIGKILL works on a hung or stopped process too)."""
        # named before the signal: the pipe's EOF it causes would otherwise race to record a death
        # "exit code None" (the process not reaped yet) as the reason
        self._mark_dead(f"actor '{self.name}' (pid {self.process.pid}) was killed")
        if self.process.is_alive():
            self.process.kill()
            await asyncio.to_thread(self.process.join, 10.0)

    async def stop(self, timeout_s: float = 10.0) -> None:
        if self._dead is None and self.process.is_alive():
            try:
                self.conn.send(None)
                await self._await(None, "stop", timeout_s)
            except (TimeoutError, ActorDied, ActorCallError, BrokenPipeError, OSError):
                pass
        if self.process.is_alive():
            self.process.terminate()
            await asyncio.to_thread(self.process.join, timeout_s)
        if self.process.is_alive():
            self.process.kill()
            await asyncio.to_thread(self.process.join, timeout_s)
        self._mark_dead(f"actor '{self.name}' was stopped")
        self.conn.close()


class LocalBackend:
    host = "127.0.0.1"  # every actor runs on this machine

    def __init__(self, cfg: BaseRuntimeConfig) -> None:
        self.cfg = cfg
        self.ctx = mp.get_context("spawn")
        self.actors: list[LocalActor] = []
        pools = getattr(cfg, "pin_cpus", None)  # runtime.pin_cpus (LocalRuntimeConfig)
        self.pools = PoolMeter(pools.sets() if pools is not None else {})
        """CPU seconds of each role's actors (runtime/pinning.py); the pipeline opens its window."""

    async def spawn(self, name: str, cls: type, *args: Any, **kwargs: Any) -> LocalActor:
        parent, child = self.ctx.Pipe(duplex=True)
        role = role_of(name)
        process = self.ctx.Process(
            target=_child_main,
            args=(child, name, cls, args, kwargs, os.getpid(), self.pools.sets.get(role) if role else None),
            name=f"nonstop-{name}",
            daemon=True,
        )
        process.start()
        child.close()
        actor = LocalActor(name, process, parent, self.cfg.call_timeout_s)
        self.actors.append(actor)
        self.pools.add(role, process.pid)  # type: ignore[arg-type]  # a started process has a pid
        await actor.wait_ready(self.cfg.start_timeout_s)
        return actor

    async def shutdown(self) -> None:
        await asyncio.gather(*(a.stop() for a in self.actors), return_exceptions=True)
        self.actors.clear()
