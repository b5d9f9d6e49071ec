import asyncio
import contextlib
import os
import signal
import time

import pytest

from nonstop.config import LocalRuntimeConfig
from nonstop.runtime import ActorCallError, ActorDied, Supervisor, make_backend

from helpers import Echo


def _run(coro):
    return asyncio.run(coro)


@contextlib.asynccontextmanager
async def local_backend(**cfg):
    backend = make_backend(LocalRuntimeConfig(**cfg))
    try:
        yield backend
    finally:
        await backend.shutdown()


def test_spawn_call_and_remote_errors():
    async def go():
        async with local_backend(start_timeout_s=120) as backend:
            actor = await backend.spawn("echo", Echo, 10)
            assert await actor.call("add", 1, y=2) == 13
            assert await actor.call("threads") == 1  # each actor runs single-threaded torch
            assert await asyncio.gather(*(actor.call("add", i) for i in range(20))) == [10 + i for i in range(20)]
            with pytest.raises(ActorCallError, match=r"echo\.fail raised:(.|\n)*KeyError: 'no such thing'"):
                await actor.call("fail")
            assert await actor.call("add", 0) == 10  # a remote error does not kill the actor
            assert actor.is_alive()
    _run(go())


def test_async_methods_are_served_concurrently_and_plain_ones_in_order():
    async def go():
        async with local_backend() as backend:
            actor = await backend.spawn("conc", Echo, 1)
            waiting = asyncio.ensure_future(actor.call("wait_for", "a", timeout_s=30))
            # a plain call and a second async call are answered while `wait_for` is pending
            assert await actor.call("add", 1) == 2
            await actor.call("release", "a")
            assert await waiting == "a"
            # plain calls keep their order even when each takes a while
            order = []

            async def noted(coro, tag):
                value = await coro
                order.append(tag)
                return value

            await asyncio.gather(noted(actor.call("sleep", 0.3), "slow"), noted(actor.call("add", 5), "fast"))
            assert order == ["slow", "fast"]
    _run(go())


def test_dead_actor_fails_pending_calls_at_once():
    async def go():
        async with local_backend() as backend:
            actor = await backend.spawn("victim", Echo)
            pending = [asyncio.ensure_future(actor.call("sleep", 30)), asyncio.ensure_future(actor.call("add", 1))]
            await asyncio.sleep(0.2)
            t0 = time.monotonic()
            os.kill(actor.process.pid, signal.SIGKILL)
            for fut in pending:
                with pytest.raises(ActorDied, match=r"actor 'victim' \(pid \d+\) died \(killed by signal 9\)"):
                    await fut
            assert time.monotonic() - t0 < 5
            with pytest.raises(ActorDied):
                await actor.call("add", 1)
            assert not actor.is_alive()

            crasher = await backend.spawn("crasher", Echo)
            with pytest.raises(ActorDied, match=r"actor 'crasher' \(pid \d+\) died \(exit code 3\)"):
                await crasher.call("crash")
    _run(go())


def test_call_timeout_names_actor_and_method():
    async def go():
        async with local_backend() as backend:
            actor = await backend.spawn("slow", Echo)
            with pytest.raises(TimeoutError, match=r"actor 'slow': call 'sleep' did not answer within 0.5 s"):
                await actor.call("sleep", 5, timeout_s=0.5)
    _run(go())


def test_start_failure_is_reported_with_traceback():
    async def go():
        async with local_backend() as backend:
            with pytest.raises(ActorDied, match=r"actor bad failed to start(.|\n)*refusing to start"):
                await backend.spawn("bad", Echo, fail_init=True)
    _run(go())


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
