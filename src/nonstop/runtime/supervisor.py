"""One supervisor for the orchestrator's background tasks.

Every task is created through `Supervisor.spawn(coro, name)` and kept. `run(main)` runs the
main coroutine and returns its result; if any background task fails first, the main coroutine
is cancelled and that failure is re-raised, so a dead producer can never leave the trainer
loop waiting forever. If `run` is cancelled, so is the main coroutine. On exit every remaining
task is cancelled and awaited.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class Supervisor:
    def __init__(self) -> None:
        self.tasks: dict[str, asyncio.Task] = {}
        self._failed: asyncio.Future | None = None

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task:
        if name in self.tasks and not self.tasks[name].done():
            raise ValueError(f"a task named {name!r} is already running")
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self.tasks[name] = task
        task.add_done_callback(self._on_done)
        return task

    def _on_done(self, task: asyncio.Task) -> None:
        exc = None if task.cancelled() else task.exception()
        if exc is None:
            return
        if self._failed is not None and not self._failed.done():
            self._failed.set_exception(exc)

    async def run(self, main: Coroutine[Any, Any, T]) -> T:
        self._failed = asyncio.get_running_loop().create_future()
        for task in self.tasks.values():  # a task may have failed before run() started
            exc = task.exception() if task.done() and not task.cancelled() else None
            if exc is not None:
                self._failed.set_exception(exc)
                break
        main_task = asyncio.get_running_loop().create_task(main, name="main")
        try:
            await asyncio.wait({main_task, self._failed}, return_when=asyncio.FIRST_COMPLETED)
            if self._failed.done() and not main_task.done():
                main_task.cancel()
                await asyncio.gather(main_task, return_exceptions=True)
                self._failed.result()  # raises the background failure
            return main_task.result()
        finally:
            if not main_task.done():  # run() itself was cancelled (a second Ctrl-C): main goes too
                main_task.cancel()
                await asyncio.gather(main_task, return_exceptions=True)
            if not self._failed.done():
                self._failed.cancel()
            elif not self._failed.cancelled():
                self._failed.exception()  # mark retrieved
            await self.close()

    async def close(self, recancel_s: float = 1.0) -> None:
        """Cancel every remaining task and wait for it. A task still running `recancel_s` seconds
        after its cancellation is cancelled again: on Python 3.11 `asyncio.wait_for` swallows a
        cancellation that arrives as the call it waits for completes, and a loop around such a
        call (the engine heartbeat) would otherwise keep the run from ever ending."""
        live = {t for t in self.tasks.values() if not t.done()}
        while live:
            for t in live:
                t.cancel()
            _, live = await asyncio.wait(live, timeout=recancel_s)
