"""The actor seam's contract, one suite run on every backend (local processes and a private Ray
cluster): calls and their errors, concurrency and order, timeouts, start failures, death and kill."""

from __future__ import annotations

import asyncio
import importlib.util
import os

import pytest

from nonstop.config import LocalRuntimeConfig, RayRuntimeConfig, RuntimeConfig
from nonstop.runtime import ActorCallError, ActorDied, make_backend
from support import PYTHONPATH
from support.actor_classes import Echo

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="the ray extra is not installed")


@pytest.fixture(params=["local", pytest.param("ray", marks=needs_ray)])
def backend_kind(request, tmp_path, monkeypatch) -> str:
    if request.param == "ray":  # a private cluster that must write nothing to the home folder
        monkeypatch.setenv("HOME", str(tmp_path / "home"))
        (tmp_path / "home").mkdir()
        for var in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):
            monkeypatch.delenv(var, raising=False)
        # Ray workers import `support.actor_classes` (and this checkout's sources) from here
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([PYTHONPATH, os.environ.get("PYTHONPATH", "")]))
    return request.param


def _config(kind: str) -> RuntimeConfig:
    if kind == "ray":
        return RayRuntimeConfig(ray_num_cpus=2, start_timeout_s=120, ray_engine={"num_cpus": 0.5})
    return LocalRuntimeConfig(start_timeout_s=120)


def test_actor_seam_contract(backend_kind, tmp_path):
    run_dir = tmp_path / "run"

    async def go():
        backend = make_backend(_config(backend_kind), run_dir)
        try:
            actor = await backend.spawn("echo", Echo, 10)
            assert await actor.call("add", 1, y=2) == 13
            assert await actor.call("threads") == 1  # each actor runs single-threaded torch
            assert await asyncio.gather(*(actor.call("add", i) for i in range(20))) == [10 + i for i in range(20)]
            with pytest.raises(ActorCallError, match=r"echo\.fail raised:(.|\n)*no such thing"):
                await actor.call("fail")
            assert await actor.call("add", 0) == 10 and actor.is_alive()  # a remote error does not kill the actor

            # async methods are served concurrently: a plain call and a second async call are
            # answered while `wait_for` is pending
            waiting = asyncio.ensure_future(actor.call("wait_for", "a", timeout_s=60))
            assert await actor.call("add", 1) == 11
            await actor.call("release", "a")
            assert await waiting == "a"
            # plain calls keep their order even when each takes a while
            order = []

            async def noted(coro, tag):
                await coro
                order.append(tag)

            await asyncio.gather(noted(actor.call("sleep", 0.3), "slow"), noted(actor.call("add", 5), "fast"))
            assert order == ["slow", "fast"]

            with pytest.raises(TimeoutError, match=r"actor 'echo': call 'sleep' did not answer within 0.5 s"):
                await actor.call("sleep", 5, timeout_s=0.5)
            with pytest.raises(ActorDied, match=r"actor bad failed to start(.|\n)*refusing to start"):
                await backend.spawn("bad", Echo, fail_init=True)

            # a process that dies fails every pending call, and every later one, naming the actor
            victim = await backend.spawn("engine-1", Echo)
            pending = [asyncio.ensure_future(victim.call("sleep", 30)), asyncio.ensure_future(victim.call("add", 1))]
            await asyncio.sleep(0.3)
            os.kill(victim.pid, 9)
            for fut in pending:
                with pytest.raises(ActorDied, match=r"actor 'engine-1' \(pid \d+\) died"):
                    await fut
            with pytest.raises(ActorDied, match="engine-1"):
                await victim.call("add", 1)
            assert not victim.is_alive()

            # kill() ends a busy (or hung) actor without its cooperation
            busy = await backend.spawn("engine-2", Echo)
            pending = [asyncio.ensure_future(busy.call("sleep", 30))]
            await busy.kill()
            with pytest.raises(ActorDied, match=r"actor 'engine-2' \(pid \d+\) (was killed|died)"):
                await pending[0]
            assert not busy.is_alive()
        finally:
            await backend.shutdown()

    asyncio.run(go())
    if backend_kind == "ray":  # no token, no cache in $HOME; Ray's logs stay with the run
        home = tmp_path / "home"
        assert not any(home.iterdir()), list(home.rglob("*"))
        assert (run_dir / "ray").is_dir() and not (run_dir / "ray").is_symlink()
        assert any((run_dir / "ray").glob("raylet*")), list((run_dir / "ray").iterdir())
