"""The Ray backend on a real private local Ray cluster (2 CPUs): the actor-seam contract, and a
short end-to-end run that learns."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import sys

import pytest

from nonstop.config import RayRuntimeConfig
from nonstop.runtime import ActorCallError, ActorDied, make_backend

from helpers import Echo

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="the ray extra is not installed")


def test_missing_ray_is_one_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails as if it were not installed
    monkeypatch.delitem(sys.modules, "nonstop.runtime.ray", raising=False)
    with pytest.raises(ImportError, match=r"runtime.backend=ray needs Ray: install the extra with `pip install nonstop\[ray\]`"):
        make_backend(RayRuntimeConfig())


@contextlib.asynccontextmanager
async def ray_backend(run_dir, **cfg):
    backend = make_backend(RayRuntimeConfig(ray_num_cpus=2, **cfg), run_dir)
    try:
        yield backend
    finally:
        await backend.shutdown()


@needs_ray
def test_ray_actor_seam_contract(tmp_path, monkeypatch):
    """Calls, remote errors, timeouts, start failures and a killed actor, on one private cluster
    that writes nothing to the home folder and leaves its logs in the run folder."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for var in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    here = os.path.dirname(os.path.abspath(__file__))  # Ray workers import `helpers` from here
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    run_dir = tmp_path / "run"

    async def go():
        async with ray_backend(run_dir, start_timeout_s=120, ray_engine={"num_cpus": 0.5}) as backend:
            actor = await backend.spawn("echo", Echo, 10)
            assert (run_dir / "ray").is_symlink()
            assert await actor.call("add", 1, y=2) == 13
            assert await actor.call("threads") == 1
            assert await asyncio.gather(*(actor.call("add", i) for i in range(20))) == [10 + i for i in range(20)]
            with pytest.raises(ActorCallError, match=r"echo\.fail raised:(.|\n)*no such thing"):
                await actor.call("fail")
            assert await actor.call("add", 0) == 10 and actor.is_alive()
            # async methods are served concurrently, plain ones in order, as on the local backend
            waiting = asyncio.ensure_future(actor.call("wait_for", "a", timeout_s=60))
            assert await actor.call("add", 1) == 11
            await actor.call("release", "a")
            assert await waiting == "a"
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
            victim = await backend.spawn("engine-1", Echo)
            pending = asyncio.ensure_future(victim.call("sleep", 30))
            await asyncio.sleep(0.3)
            os.kill(victim.pid, 9)
            with pytest.raises(ActorDied, match=r"actor 'engine-1' \(pid \d+\) died"):
                await pending
            with pytest.raises(ActorDied, match="engine-1"):
                await victim.call("add", 1)
            assert not victim.is_alive()
            hung = await backend.spawn("engine-2", Echo)
            pending = asyncio.ensure_future(hung.call("sleep", 30))
            await hung.kill()
            with pytest.raises(ActorDied, match=r"actor 'engine-2' \(pid \d+\) was killed"):
                await pending

    asyncio.run(go())
    assert not any(home.iterdir()), list(home.rglob("*"))  # no token, no cache, nothing in $HOME
    assert (run_dir / "ray").is_dir() and not (run_dir / "ray").is_symlink()
    assert any((run_dir / "ray").glob("raylet*")), list((run_dir / "ray").iterdir())


@needs_ray
def test_short_run_on_a_local_ray_cluster_learns(tiny_dir, tmp_path):
    """The real CLI on a private 2-CPU Ray cluster, two engines (half a CPU each) and one trainer:
    it finishes, the reward rises, both engines follow the published versions."""
    from test_e2e import nonstop, records, small_model_args

    result = nonstop(
        ["train", *small_model_args(tiny_dir), "--set", "runtime.backend=ray", "--set", "runtime.ray_num_cpus=2",
         "--set", "runtime.num_engines=2", "--set", "runtime.ray_engine.num_cpus=0.5", "--set", "run.name=ray",
         "--set", "task.reward=helpers:ones_reward", "--set", "run.max_steps=25", "--set", "trainer.lr=3e-2",
         "--set", "rollout.prompts_per_step=8", "--set", "rollout.group_size=4", "--set", "rollout.max_new_tokens=6",
         "--set", "task.max_operand=9", "--set", "task.eval_size=10", "--set", "rollout.filter_uniform_reward=false"],
        cwd=tmp_path, timeout_s=400,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 engine and 1 trainer actor(s) (ray backend)" in result.stdout
    run_dir = tmp_path / "runs" / "ray"
    recs = records(run_dir)
    assert [r["policy_version"] for r in recs] == list(range(1, 26))
    first, last = [r["reward_mean"] for r in recs[:5]], [r["reward_mean"] for r in recs[-5:]]
    assert sum(last) / 5 >= sum(first) / 5 + 0.5, (first, last)  # the policy learnt to write '1's
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [e["policy_version"] for e in summary["engines"]] == [25, 25]
    assert all(e["tokens_generated"] > 0 for e in summary["engines"])
    assert min(recs[-1]["engine_versions"]) >= 20
    assert any((run_dir / "ray").glob("raylet*"))  # Ray's logs stay with the run
