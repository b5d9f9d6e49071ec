"""Several actors behind one handle: a least-loaded engine pool and a lockstep group of trainer ranks.

`EnginePool(engines).call("generate", requests)` spreads the requests over the engines and
answers like one engine: one list of samples per request, in request order. Each request goes
to the engine with the fewest samples in flight at that moment (ties: the lower index), counting
the requests already placed by this call and by every concurrent call, so a stream of small calls
and one large call balance alike. Every request is generated exactly once, by one engine. The pool
tracks, per engine, the samples it served and the newest policy_version in its tokens
(`versions`); weights never pass through it (every engine receives each published version from
the transport). Any other method is called on every engine and answers with the list of their
answers, in engine order.

`RankGroup(ranks).call(method, ...)` makes the same call on every trainer rank at once (data
parallel: they meet in collectives, so none may be left out) and answers with rank 0's answer.

In both, the first failing part fails the whole call at once with its own error (ActorDied
naming the actor, ...); the waits on the other parts are cancelled (a rank left waiting in a
collective would otherwise hold the call until its timeout).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from nonstop.runtime import ActorHandle
from nonstop.types import GenerationRequest, Sample

# Engine methods whose first argument is a list of requests to spread over the pool.
DISPATCHED = frozenset({"generate"})


def place(in_flight: list[int], requests: list[GenerationRequest]) -> list[list[int]]:
    """Indices of the requests each engine gets: one at a time to the engine with the fewest
    samples in flight (ties: lower index); `in_flight` is updated to count them."""
    placed: list[list[int]] = [[] for _ in in_flight]
    for i, req in enumerate(requests):
        k = min(range(len(in_flight)), key=lambda j: (in_flight[j], j))
        placed[k].append(i)
        in_flight[k] += req.n
    return placed


async def all_or_first_error(parts: list[tuple[str, Coroutine[Any, Any, Any]]]) -> list[Any]:
    """Run named coroutines together; their results in order, or the first error at once."""
    tasks = [asyncio.get_running_loop().create_task(coro, name=name) for name, coro in parts]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class EnginePool:
    def __init__(self, engines: list[ActorHandle]) -> None:
        if not engines:
            raise ValueError("an engine pool needs at least one engine")
        self.engines = engines
        self.name = "engines" if len(engines) > 1 else engines[0].name
        self.in_flight = [0] * len(engines)  # samples requested and not yet answered, per engine
        self.served = [0] * len(engines)  # samples answered, per engine
        self.versions = [0] * len(engines)  # newest policy_version seen in each engine's tokens

    async def _generate(self, k: int, requests: list[GenerationRequest], timeout_s: float | None) -> list[list[Sample]]:
        want = sum(r.n for r in requests)
        try:
            results = await self.engines[k].call("generate", requests, timeout_s=timeout_s)
        finally:
            self.in_flight[k] -= want
        self.served[k] += sum(len(samples) for samples in results)
        newest = [s.versions[-1] for samples in results for s in samples if s.versions]
        if newest:
            self.versions[k] = max(self.versions[k], *newest)
        return results

    async def call(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
        if method not in DISPATCHED:
            return await all_or_first_error(
                [(f"{e.name}.{method}", e.call(method, *args, timeout_s=timeout_s, **kwargs)) for e in self.engines])
        requests: list[GenerationRequest] = args[0]
        placed = place(self.in_flight, requests)
        parts = [(k, idx) for k, idx in enumerate(placed) if idx]
        answers = await all_or_first_error(
            [(f"{self.engines[k].name}.{method}", self._generate(k, [requests[i] for i in idx], timeout_s))
             for k, idx in parts])
        results: list[list[Sample]] = [[] for _ in requests]
        for (_, idx), part in zip(parts, answers):
            for i, samples in zip(idx, part):  # type: ignore[arg-type]
                results[i] = samples
        return results

    def is_alive(self) -> bool:
        return all(e.is_alive() for e in self.engines)

    async def stop(self, timeout_s: float = 10.0) -> None:
        await asyncio.gather(*(e.stop(timeout_s) for e in self.engines), return_exceptions=True)


class RankGroup:
    def __init__(self, ranks: list[ActorHandle]) -> None:
        if not ranks:
            raise ValueError("a rank group needs at least one rank")
        self.ranks = ranks
        self.lead = ranks[0]
        self.name = ranks[0].name if len(ranks) == 1 else "trainers"

    async def call(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
        answers = await all_or_first_error(
            [(f"{r.name}.{method}", r.call(method, *args, timeout_s=timeout_s, **kwargs)) for r in self.ranks])
        return answers[0]

    def is_alive(self) -> bool:
        return all(r.is_alive() for r in self.ranks)

    async def stop(self, timeout_s: float = 10.0) -> None:
        await asyncio.gather(*(r.stop(timeout_s) for r in self.ranks), return_exceptions=True)
