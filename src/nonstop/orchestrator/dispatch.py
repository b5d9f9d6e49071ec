"""Several actors behind one client: a least-loaded engine pool and a lockstep group of trainer ranks.

`EnginePool(engines)` is an EngineClient over several. `generate(requests)` spreads the
requests over the engines and answers like one engine: one list of samples per request, in
request order. Each request goes to the engine with the fewest samples in flight at that moment
(ties: the lower index), counting the requests already placed by this call and by every
concurrent call, so a stream of small calls and one large call balance alike. An engine that is
down (dead, or being replaced: its calls wait for the replacement) gets no new request while
another engine is up. Every request is
generated exactly once, by one engine. The pool tracks, per engine, the samples it served and
the newest policy_version in its tokens (`versions`); weights never pass through it (every
engine receives each published version from the transport). `stats`, `connect_transport`,
`ping`, `sampling_states`, `load_sampling_states`, `stop` and `kill` go to every engine (engine
i takes transport rank `rank + i`, and sampling state i).

`RankGroup(ranks)` is a TrainerClient over several trainer ranks: every call goes to every rank
at once (data parallel: they meet in collectives, so none may be left out) and answers with
rank 0's answer.

In both, the first failing part fails the whole call at once with its own error (ActorDied
naming the actor, ...); the waits on the other parts are cancelled (a rank left waiting in a
collective would otherwise hold the call until its timeout).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Generic, TypeVar

from nonstop.clients import Client, EngineClient, EngineStats, SamplingState, TrainerClient
from nonstop.config import TransportConfig
from nonstop.types import AheadResult, GenerationRequest, Group, PublishResult, Sample, StepResult, TransportHandle

C = TypeVar("C", bound=Client)
R = TypeVar("R")


def place(in_flight: list[int], requests: list[GenerationRequest], up: list[bool] | None = None) -> list[list[int]]:
    """Indices of the requests each engine gets: one at a time to the engine with the fewest
    samples in flight (ties: lower index) among those `up` (all, when none is); `in_flight` is
    updated to count them."""
    placed: list[list[int]] = [[] for _ in in_flight]
    usable = [j for j in range(len(in_flight)) if up is None or up[j]] or list(range(len(in_flight)))
    for i, req in enumerate(requests):
        k = min(usable, key=lambda j: (in_flight[j], j))
        placed[k].append(i)
        in_flight[k] += req.n
    return placed


async def all_or_first_error(parts: list[tuple[str, Coroutine[Any, Any, Any]]]) -> list[Any]:
    """Run named coroutines together; their results in order, or the first error at once."""
    tasks = [asyncio.get_running_loop().create_task(coro, name=name) for name, coro in parts]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in tasks:
            exc = t.exception() if t.done() and not t.cancelled() else None
            if exc is not None:
                raise exc
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _Several(Generic[C]):
    def __init__(self, parts: list[C], what: str, plural: str) -> None:
        if not parts:
            raise ValueError(f"a {what} needs at least one member")
        self.parts = parts
        self.name = parts[0].name if len(parts) == 1 else plural

    async def _each(self, label: str, call: Callable[[int, C], Coroutine[Any, Any, R]]) -> list[R]:
        return await all_or_first_error([(f"{p.name}.{label}", call(i, p)) for i, p in enumerate(self.parts)])

    def is_alive(self) -> bool:
        return all(p.is_alive() for p in self.parts)

    async def stop(self, timeout_s: float = 10.0) -> None:
        await asyncio.gather(*(p.stop(timeout_s) for p in self.parts), return_exceptions=True)

    async def kill(self) -> None:
        await asyncio.gather(*(p.kill() for p in self.parts), return_exceptions=True)


class EnginePool(_Several[EngineClient]):
    def __init__(self, engines: list[EngineClient]) -> None:
        super().__init__(engines, "engine pool", "engines")
        self.engines = engines
        self.in_flight = [0] * len(engines)  # samples requested and not yet answered, per engine
        self.served = [0] * len(engines)  # samples answered, per engine
        self.versions = [0] * len(engines)  # newest policy_version seen in each engine's tokens

    async def _generate(self, k: int, requests: list[GenerationRequest], timeout_s: float | None) -> list[list[Sample]]:
        want = sum(r.n for r in requests)
        try:
            results = await self.engines[k].generate(requests, timeout_s=timeout_s)
        finally:
            self.in_flight[k] -= want
        self.served[k] += sum(len(samples) for samples in results)
        newest = [s.versions[-1] for samples in results for s in samples if s.versions]
        if newest:
            self.versions[k] = max(self.versions[k], *newest)
        return results

    async def generate(self, requests: list[GenerationRequest], timeout_s: float | None = None) -> list[list[Sample]]:
        # an engine that is down (being replaced: maybe minutes, waiting for a node) gets nothing new
        placed = place(self.in_flight, requests, [e.is_alive() for e in self.engines])
        parts = [(k, idx) for k, idx in enumerate(placed) if idx]
        answers = await all_or_first_error(
            [
                (f"{self.engines[k].name}.generate", self._generate(k, [requests[i] for i in idx], timeout_s))
                for k, idx in parts
            ]
        )
        results: list[list[Sample]] = [[] for _ in requests]
        for (_, idx), part in zip(parts, answers):
            for i, samples in zip(idx, part):
                results[i] = samples
        return results

    async def stats(self) -> list[EngineStats]:
        return [st for part in await self._each("stats", lambda i, e: e.stats()) for st in part]

    async def ping(self, timeout_s: float | None = None) -> int:
        return min(await self._each("ping", lambda i, e: e.ping(timeout_s)))

    async def connect_transport(self, handle: TransportHandle, rank: int) -> None:
        await self._each("connect_transport", lambda i, e: e.connect_transport(handle, rank + i))

    async def sampling_states(self) -> list[SamplingState]:
        return [st for part in await self._each("sampling_states", lambda i, e: e.sampling_states()) for st in part]

    async def weights_crc32(self) -> list[tuple[int, int]]:
        return [d for part in await self._each("weights_crc32", lambda i, e: e.weights_crc32()) for d in part]

    def add(self, engine: EngineClient) -> None:
        """A member that joined mid-run (runtime.max_engines): it takes requests from now on."""
        self.engines.append(engine)  # the same list as `parts`
        self.in_flight.append(0)
        self.served.append(0)
        self.versions.append(0)

    async def load_sampling_states(self, states: list[SamplingState]) -> None:
        """Member i (one engine each: a RestartingEngine) gets states[i]."""
        if len(states) != len(self.engines):
            raise ValueError(f"{len(states)} sampling states for {len(self.engines)} engines")
        await self._each("load_sampling_states", lambda i, e: e.load_sampling_states(states[i : i + 1]))


class RankGroup(_Several[TrainerClient]):
    def __init__(self, ranks: list[TrainerClient]) -> None:
        super().__init__(ranks, "rank group", "trainers")
        self.ranks = ranks
        self.lead = ranks[0]
        self._lockstep = asyncio.Lock()

    async def _all(self, label: str, call: Callable[[TrainerClient], Coroutine[Any, Any, R]]) -> R:
        """The same call on every rank; rank 0's answer. One call at a time: two concurrent calls
        (a step and an engine restart's resend) could reach the ranks in different orders, and
        ranks that meet in collectives must make them in the same order."""
        async with self._lockstep:
            return (await self._each(label, lambda i, r: call(r)))[0]

    async def step(self, groups: list[Group]) -> StepResult:
        return await self._all("step", lambda r: r.step(groups))

    async def forward_ahead(self, groups: list[Group]) -> AheadResult:
        return await self._all("forward_ahead", lambda r: r.forward_ahead(groups))

    async def publish(self, resend: bool = False) -> PublishResult:
        return await self._all("publish", lambda r: r.publish(resend))

    async def published(self) -> PublishResult:
        """Ranks publish inline (no overlap with several ranks): rank 0's last send, at once."""
        return await self.lead.published()

    async def save(self, path: str) -> str:
        return await self._all("save", lambda r: r.save(path))

    async def save_checkpoint(self, path: str) -> int:
        return await self._all("save_checkpoint", lambda r: r.save_checkpoint(path))

    async def load_checkpoint(self, path: str) -> int:
        return await self._all("load_checkpoint", lambda r: r.load_checkpoint(path))

    async def plan_transport(
        self, cfg: TransportConfig, num_engines: int, host: str | None, first_engines: int | None = None
    ) -> TransportHandle:
        """Rank 0 alone holds the transport's sending end."""
        return await self.lead.plan_transport(cfg, num_engines, host, first_engines)

    async def weights_crc32(self) -> tuple[int, int]:
        return await self._all("weights_crc32", lambda r: r.weights_crc32())

    async def connect_transport(self) -> None:
        await self.lead.connect_transport()
