"""RestartingEngine over real engine processes: a crash and a hang are survived, the prompts of the
pending calls generated again by the replacement, and the restart budget kept."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from nonstop.config import Config, LocalRuntimeConfig
from nonstop.hf import load_tokenizer
from nonstop.orchestrator.actors import spawn_engine
from nonstop.runtime import ActorDied, Supervisor, make_backend
from nonstop.runtime.restart import RestartingEngine
from nonstop.types import GenerationRequest, SamplingParams


def _requests(tok, count: int) -> list[GenerationRequest]:
    return [GenerationRequest(i, tok(f"{i}+{i}=")["input_ids"], 2, SamplingParams(4, 1.0)) for i in range(count)]


async def _restarting(backend, tiny_dir, max_restarts=2, interval_s=60.0, timeout_s=60.0, kill_replacements=False):
    """A RestartingEngine over tiny-model engines; with `kill_replacements` every replacement is
    SIGKILLed as soon as it is ready (an engine that keeps dying)."""
    cfg = Config.model_validate({"model": {"path": str(tiny_dir)}})
    tok = load_tokenizer(str(tiny_dir))
    spawned = []

    async def start():
        engine = await spawn_engine(backend, cfg, tiny_dir, tok, 0)
        if spawned and kill_replacements:
            os.kill(engine.actor.pid, signal.SIGKILL)
        spawned.append(engine)
        return engine

    restarting = await RestartingEngine("engine", start, max_restarts, interval_s, timeout_s).begin()
    return restarting, tok


def test_a_killed_engine_is_replaced_and_its_pending_prompts_generated_again(tiny_dir):
    async def go():
        backend = make_backend(LocalRuntimeConfig())
        try:
            engine, tok = await _restarting(backend, tiny_dir)
            first = engine.engine
            os.kill(first.actor.pid, signal.SIGSTOP)  # the call below stays pending until the kill
            reqs = _requests(tok, 3)
            pending = asyncio.ensure_future(engine.generate(reqs))
            await asyncio.sleep(0.2)
            os.kill(first.actor.pid, signal.SIGKILL)
            results = await pending  # answered by the replacement
            assert engine.engine is not first and engine.is_alive()
            for req, samples in zip(reqs, results, strict=True):
                assert len(samples) == req.n and all(s.prompt_ids == req.prompt_ids for s in samples)
            summary = engine.faults.summary()
            assert summary["restarts"] == 1 and summary["requeued"] == 3  # the prompts of the failed call
            assert "killed by signal 9" in summary["reasons"][0]
            [stats] = await engine.stats()  # the replacement generated every token, once
            assert stats["tokens_generated"] == sum(len(s.completion_ids) for samples in results for s in samples)
        finally:
            await backend.shutdown()

    asyncio.run(go())


def test_stats_during_a_replacement_answer_with_the_last_counters_instead_of_waiting(tiny_dir):
    """A replacement can take minutes (runtime.node_loss 'wait' holds it until a node joins): the
    learning loop's per-step stats must not wait for it. Held here by a gate that opens only
    after the stats came back; then the replacement serves and reports its own counters."""

    async def go():
        backend = make_backend(LocalRuntimeConfig())
        cfg = Config.model_validate({"model": {"path": str(tiny_dir)}})
        tok = load_tokenizer(str(tiny_dir))
        gate = asyncio.Event()
        started = []

        async def start():
            if started:
                await gate.wait()  # no room for the replacement yet
            engine = await spawn_engine(backend, cfg, tiny_dir, tok, 0)
            started.append(engine)
            return engine

        try:
            engine = await RestartingEngine("engine", start, 2, 60.0, 60.0).begin()
            await engine.generate(_requests(tok, 1))
            before = await engine.stats()
            os.kill(started[0].actor.pid, signal.SIGKILL)
            pending = asyncio.ensure_future(engine.generate(_requests(tok, 2)))  # restarts, held by the gate
            while not engine.faults.restarts and not engine._lock.locked():
                await asyncio.sleep(0.05)
            assert await asyncio.wait_for(engine.stats(), 30) == before  # at once, the last counters
            gate.set()
            results = await pending
            [after] = await engine.stats()
            assert after["tokens_generated"] == sum(len(s.completion_ids) for samples in results for s in samples)
        finally:
            await backend.shutdown()

    asyncio.run(go())


def test_a_caller_cancelled_during_a_restart_leaves_it_going_and_the_next_call_gets_that_replacement(tiny_dir):
    """The run's end cancels a producer whose call is waiting for a replacement (one that waits for
    a node can take minutes). The replacement goes on, and the next call (the run's summary asks
    every engine for its weights) is served by it: no second start. A second one, on a Ray
    cluster, waited for the resources the first request still held, until the run's limit."""

    async def go():
        backend = make_backend(LocalRuntimeConfig())
        cfg = Config.model_validate({"model": {"path": str(tiny_dir)}})
        tok = load_tokenizer(str(tiny_dir))
        gate = asyncio.Event()
        starts = []

        async def start():
            starts.append(time.monotonic())
            if len(starts) > 1:
                await gate.wait()  # no room for the replacement yet
            return await spawn_engine(backend, cfg, tiny_dir, tok, 0)

        try:
            engine = await RestartingEngine("engine", start, 2, 60.0, 60.0).begin()
            first = engine.engine
            os.kill(first.actor.pid, signal.SIGKILL)
            producer = asyncio.ensure_future(engine.generate(_requests(tok, 2)))  # restarts, held by the gate
            while len(starts) < 2:
                await asyncio.sleep(0.05)
            producer.cancel()  # the run ends its producers
            await asyncio.gather(producer, return_exceptions=True)
            later = asyncio.ensure_future(engine.generate(_requests(tok, 1)))
            await asyncio.sleep(0.5)
            gate.set()
            [samples] = await asyncio.wait_for(later, 120)
            assert len(samples) == 2 and engine.engine is not first
            assert len(starts) == 2, f"{len(starts) - 1} replacements were started for one death"
            assert engine.faults.summary()["restarts"] == 1
        finally:
            await backend.shutdown()

    asyncio.run(go())


def test_a_hung_engine_is_detected_by_the_heartbeat_within_its_timeout(tiny_dir):
    async def go():
        backend = make_backend(LocalRuntimeConfig())
        supervisor = Supervisor()
        try:
            engine, tok = await _restarting(backend, tiny_dir, interval_s=0.2, timeout_s=1.0)
            supervisor.spawn(engine.heartbeat(), name="heartbeat")
            hung = engine.engine
            os.kill(hung.actor.pid, signal.SIGSTOP)  # alive, silent
            results = await engine.generate(_requests(tok, 2), timeout_s=120)
            assert [len(samples) for samples in results] == [2, 2]
            restart = engine.faults.restarts[0]
            assert 0.9 <= restart.detect_s <= 5.0, restart
            assert restart.requeued == 2 and engine.engine is not hung
        finally:
            await supervisor.close()
            await backend.shutdown()

    asyncio.run(go())


def test_deaths_beyond_the_budget_end_with_actor_died(tiny_dir):
    async def go():
        backend = make_backend(LocalRuntimeConfig())
        try:
            engine, tok = await _restarting(backend, tiny_dir, max_restarts=1, kill_replacements=True)
            os.kill(engine.engine.actor.pid, signal.SIGKILL)
            with pytest.raises(ActorDied, match=r"no restart left \(runtime.max_engine_restarts=1\)"):
                await engine.generate(_requests(tok, 1))  # the first engine died, then its replacement
            assert len(engine.faults.restarts) == 1
        finally:
            await backend.shutdown()

    asyncio.run(go())


def test_a_replacement_that_dies_while_starting_uses_up_a_restart_and_ends_with_the_budget_message(tiny_dir):
    """An engine killed while its replacement is still starting (a fault that keeps recurring)
    counts as a restart, and when none is left the caller gets the budget message, not the bare
    death of the half-started replacement."""

    async def go():
        backend = make_backend(LocalRuntimeConfig())
        cfg = Config.model_validate({"model": {"path": str(tiny_dir)}})
        tok = load_tokenizer(str(tiny_dir))
        started = []

        async def start():
            engine = await spawn_engine(backend, cfg, tiny_dir, tok, 0)
            if started:  # every replacement dies before it is ready
                os.kill(engine.actor.pid, signal.SIGKILL)
                await engine.ping(timeout_s=60)
            started.append(engine)
            return engine

        try:
            engine = await RestartingEngine("engine", start, 2, 60.0, 60.0).begin()
            os.kill(engine.engine.actor.pid, signal.SIGKILL)
            with pytest.raises(
                ActorDied, match=r"while restarting\); no restart left \(runtime.max_engine_restarts=2\)"
            ):
                await engine.generate(_requests(tok, 1))
            assert len(engine.faults.restarts) == 2
        finally:
            await backend.shutdown()

    asyncio.run(go())
