"""RestartingActor over real processes: crash and hang are survived, calls re-made, budget kept."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from nonstop.config import LocalRuntimeConfig
from nonstop.runtime import ActorDied, Supervisor, make_backend
from nonstop.runtime.restart import RestartingActor

from helpers import Echo


def _run(coro):
    return asyncio.run(coro)


async def _restarting(backend, max_restarts=2, interval_s=0.2, timeout_s=1.0):
    async def start():
        return await backend.spawn("echo", Echo, 7)

    return await RestartingActor("echo", start, max_restarts, interval_s, timeout_s,
                                 count_items=lambda m, a: 1).begin()


def test_a_killed_actor_is_replaced_and_the_pending_call_made_again():
    async def go():
        backend = make_backend(LocalRuntimeConfig())
        try:
            actor = await _restarting(backend)
            first_pid = actor.actor.process.pid
            pending = asyncio.ensure_future(actor.call("sleep", 2.0))
            await asyncio.sleep(0.5)
            os.kill(first_pid, signal.SIGKILL)
            assert await pending == 2.0  # answered by the replacement
            assert actor.actor.process.pid != first_pid
            assert await actor.call("add", 1) == 8
            summary = actor.stats.summary()
            assert summary["restarts"] == 1 and summary["requeued"] == 1
            assert "killed by signal 9" in summary["reasons"][0]
        finally:
            await backend.shutdown()
    _run(go())


def test_a_hung_actor_is_detected_by_the_heartbeat_within_its_timeout():
    async def go():
        backend = make_backend(LocalRuntimeConfig())
        supervisor = Supervisor()
        try:
            actor = await _restarting(backend, interval_s=0.2, timeout_s=1.0)
            supervisor.spawn(actor.heartbeat(), name="heartbeat")
            hung_pid = actor.actor.process.pid
            os.kill(hung_pid, signal.SIGSTOP)  # alive, silent
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            assert await actor.call("add", 2, timeout_s=60) == 9
            assert loop.time() - t0 < 30  # interval + timeout + a fresh start, on a loaded machine
            restart = actor.stats.restarts[0]
            assert 0.9 <= restart.detect_s <= 5.0, restart
            assert actor.actor.process.pid != hung_pid
        finally:
            await supervisor.close()
            await backend.shutdown()
    _run(go())


def test_deaths_beyond_the_budget_end_with_actor_died():
    async def go():
        backend = make_backend(LocalRuntimeConfig())
        try:
            actor = await _restarting(backend, max_restarts=1)
            with pytest.raises(ActorDied, match=r"no restart left \(runtime.max_engine_restarts=1\)"):
                await actor.call("crash")  # crashes the first actor and then its replacement
            assert len(actor.stats.restarts) == 1
        finally:
            await backend.shutdown()
    _run(go())
