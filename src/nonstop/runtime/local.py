"""Local-process actor backend: one spawned OS process per actor, one pipe per actor.

Wire protocol over a duplex `multiprocessing` pipe: the parent sends `(call_id, method, args,
kwargs)`; the child serves calls one at a time, in order, and answers `(call_id, ok, value)`
where value is the result or a formatted remote traceback. The child sets
`torch.set_num_threads(1)` before it builds its object, so actors never oversubscribe cores.

The parent never polls: it registers the pipe with the event loop (`add_reader`) and resolves
the matching future when an answer arrives. When the child dies the pipe hits EOF, and every
pending call fails at once with ActorDied naming the actor and its exit code; a call that
outlives its timeout fails with TimeoutError naming the actor and the method.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing as mp
import os
import signal
import traceback
from multiprocessing.connection import Connection
from typing import Any

from nonstop.config import RuntimeConfig
from nonstop.runtime.base import ActorCallError, ActorDied

_READY = -1


def _child_main(conn: Connection, name: str, cls: type, args: tuple, kwargs: dict) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the orchestrator decides when actors stop
    import torch

    torch.set_num_threads(1)
    try:
        obj = cls(*args, **kwargs)
    except BaseException:
        conn.send((_READY, False, f"actor {name} failed to start:\n{traceback.format_exc()}"))
        return
    conn.send((_READY, True, os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return  # the orchestrator went away
        if msg is None:
            closer = getattr(obj, "close", None)
            if callable(closer):
                closer()
            conn.send((None, True, None))
            return
        call_id, method, a, kw = msg
        try:
            result = (call_id, True, getattr(obj, method)(*a, **kw))
        except BaseException:
            result = (call_id, False, f"{name}.{method} raised:\n{traceback.format_exc()}")
        conn.send(result)


class LocalActor:
    def __init__(self, name: str, process: mp.process.BaseProcess, conn: Connection, call_timeout_s: float):
        self.name = name
        self.process = process
        self.conn = conn
        self.call_timeout_s = call_timeout_s
        self._ids = itertools.count()
        self._pending: dict[int | None, asyncio.Future] = {}
        self._dead: str | None = None
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(conn.fileno(), self._on_readable)

    def _death_reason(self) -> str:
        self.process.join(timeout=1.0)
        code = self.process.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return f"actor '{self.name}' (pid {self.process.pid}) died ({how})"

    def _on_readable(self) -> None:
        try:
            call_id, ok, value = self.conn.recv()
        except (EOFError, OSError):
            self._mark_dead(self._death_reason())
            return
        fut = self._pending.pop(call_id, None)
        if fut is None or fut.done():
            return
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(ActorDied(value) if call_id == _READY else ActorCallError(value))

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
    def __init__(self, cfg: RuntimeConfig) -> None:
        self.cfg = cfg
        self.ctx = mp.get_context("spawn")
        self.actors: list[LocalActor] = []

    async def spawn(self, name: str, cls: type, *args: Any, **kwargs: Any) -> LocalActor:
        parent, child = self.ctx.Pipe(duplex=True)
        process = self.ctx.Process(
            target=_child_main, args=(child, name, cls, args, kwargs), name=f"nonstop-{name}", daemon=True
        )
        process.start()
        child.close()
        actor = LocalActor(name, process, parent, self.cfg.call_timeout_s)
        self.actors.append(actor)
        await actor.wait_ready(self.cfg.start_timeout_s)
        return actor

    async def shutdown(self) -> None:
        await asyncio.gather(*(a.stop() for a in self.actors), return_exceptions=True)
        self.actors.clear()
