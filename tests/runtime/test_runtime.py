"""The local backend's own details (the contract of every backend is in test_actors.py) and the
supervisor of the orchestrator's background tasks."""

import asyncio
import contextlib
import os
import signal
import time

import pytest

from nonstop.config import LocalRuntimeConfig
from nonstop.runtime import ActorDied, Supervisor, make_backend
from support.actor_classes import Echo


def _run(coro):
    return asyncio.run(coro)


@contextlib.asynccontextmanager
async def local_backend(**cfg):
    backend = make_backend(LocalRuntimeConfig(**cfg))
    try:
        yield backend
    finally:
        await backend.shutdown()


def test_local_death_names_the_signal_or_exit_code():
    async def go():
        async with local_backend() as backend:
            actor = await backend.spawn("victim", Echo)
            pending = asyncio.ensure_future(actor.call("sleep", 30))
            await asyncio.sleep(0.2)
            os.kill(actor.pid, signal.SIGKILL)
            with pytest.raises(ActorDied, match=r"actor 'victim' \(pid \d+\) died \(killed by signal 9\)"):
                await pending

            crasher = await backend.spawn("crasher", Echo)
            with pytest.raises(ActorDied, match=r"actor 'crasher' \(pid \d+\) died \(exit code 3\)"):
                await crasher.call("crash")

    _run(go())


def _flood(size: int, out) -> None:
    """In a child process: a large echo whose answer is written while this loop is busy (it fills the
    answer pipe), then another large call (it fills the call pipe). Puts the bytes echoed."""

    async def go():
        async with local_backend() as backend:
            actor = await backend.spawn("echo", Echo)
            first = asyncio.create_task(actor.call("echo", b"a" * size, timeout_s=120))
            await asyncio.sleep(0)  # the first call is sent
            time.sleep(1.0)  # a busy orchestrator: the actor's answer fills the pipe meanwhile
            second = await actor.call("echo", b"b" * size, timeout_s=120)
            return len(await first) + len(second)

    out.put(asyncio.run(go()))


def test_large_calls_and_answers_in_both_directions_do_not_deadlock_the_pipe():
    """Each direction of the pipe buffers 64 KiB. A parent sending many large calls while the actor
    sends large answers back used to block both in `send` forever (a multi-turn environment run
    hung this way). Run in a separate process so that a regression fails by timeout, not by hanging."""
    import multiprocessing as mp
    import queue

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_flood, args=(4 << 20, out))
    proc.start()
    try:
        echoed = out.get(timeout=120)
    except queue.Empty:
        echoed = None
    finally:
        proc.kill()
        proc.join(10)
    assert echoed == 8 << 20, "parent and actor deadlocked on a full pipe"


def test_supervisor_reraises_background_failure_and_cancels_main():
    async def go():
        sup = Supervisor()
        cancelled = asyncio.Event()

        async def main():
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.set()
                raise

        async def producer():
            await asyncio.sleep(0.05)
            raise RuntimeError("producer broke")

        sup.spawn(producer(), name="producer")
        with pytest.raises(RuntimeError, match="producer broke"):
            await sup.run(main())
        assert cancelled.is_set()
        assert all(t.done() for t in sup.tasks.values())

    _run(go())


def test_supervisor_ends_a_task_that_swallowed_its_cancellation():
    """Python 3.11's asyncio.wait_for can swallow a cancellation; such a task is cancelled again
    at close rather than waited for forever (the engine heartbeat once kept a run from ending)."""
    swallowed = []

    async def stubborn():
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            swallowed.append(True)  # carries on, as after a swallowed cancellation
        await asyncio.sleep(60)

    async def go():
        sup = Supervisor()
        task = sup.spawn(stubborn(), name="stubborn")
        await asyncio.sleep(0)

        async def main():
            return 7

        t0 = time.monotonic()
        assert await asyncio.wait_for(sup.run(main()), 10) == 7
        return task, time.monotonic() - t0

    task, took_s = _run(go())
    assert swallowed == [True] and task.cancelled() and took_s < 5


def test_supervisor_returns_main_result_and_cancels_background():
    async def go():
        sup = Supervisor()
        sup.spawn(asyncio.sleep(60), name="forever")

        async def main():
            return 42

        assert await sup.run(main()) == 42
        assert sup.tasks["forever"].cancelled()
        sup.spawn(asyncio.sleep(1), name="x")
        second = asyncio.sleep(1)
        with pytest.raises(ValueError, match="already running"):
            sup.spawn(second, name="x")
        second.close()
        await sup.close()

    _run(go())
