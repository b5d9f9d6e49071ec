"""The asynchronous driver: one decode loop on the event loop, shared by every caller.

Contract of `AsyncEngine`:
- `submit(request, queue=None)` returns an asyncio future of the request's n samples (with a
  `queue`, it also receives a TokenEvent per sampled token); any
  number of callers may submit concurrently, and all their sequences are decoded together by
  one task (`engine-decode-loop`) that runs `TorchEngine.step()` while there is work and
  sleeps on an event (no polling) while there is none; between two steps it yields to the
  loop, so requests and weight updates are taken between two forward passes;
- cancelling a future aborts its request in the engine (its slots are freed at once);
- a bad request raises `RequestError` from `submit` and never reaches the loop; if a step
  itself raises, every in-flight request fails with that error and the loop goes on serving;
- `stream(request)` yields `TokenEvent`s as tokens are sampled, then the final samples
  (`stream_events`, shared with the vLLM engine);
- `check`, `health`, `max_seq_len` and `vocab_size` are what `nonstop serve` asks of an engine
  (serve/protocol.py ServedEngine).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from nonstop.engine.core import TorchEngine
from nonstop.observe.spans import PassRecorder, SpanLog, now
from nonstop.types import GenerationRequest, Sample


@dataclass(slots=True)
class TokenEvent:
    index: int  # which of the request's n completions
    token_id: int
    logprob: float
    policy_version: int


class AsyncEngine:
    def __init__(self, engine: TorchEngine, spans: SpanLog | None = None) -> None:
        """`spans`: where forward passes (coalesced `busy` chunks) and weight applies are recorded."""
        self.engine = engine
        self._work = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.spans = spans if spans is not None and spans.enabled else None
        self._passes = PassRecorder(self.spans) if self.spans is not None else None

    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-decode-loop")

    async def _run(self) -> None:
        while True:
            if not self.engine.has_work():
                if self._passes is not None:
                    self._passes.flush()
                self._work.clear()
                await self._work.wait()
                continue
            try:
                self._step()
            except Exception as e:  # fail the requests, keep serving
                self.engine.scheduler.fail_all(e)
            await asyncio.sleep(0)  # let callers and the transport in between two forward passes

    def _step(self) -> None:
        if self._passes is None:
            self.engine.step()
            return
        stats = self.engine.scheduler.stats
        t0, tokens, swaps, swap_s = now(), stats["tokens_generated"], stats["swaps"], stats["swap_s"]
        prefills, prefill_tokens, reads = stats["prefills"], stats["prefill_tokens"], stats["attention_reads"]
        cpu0 = time.process_time()
        self.engine.step()
        t1, cpu1 = now(), time.process_time()
        if stats["swaps"] != swaps:  # the pass began by making a new version live
            assert self.spans is not None  # _passes exists only with spans
            self.spans.emit(
                "apply", t0=round(t0, 6), t1=round(t0 + stats["swap_s"] - swap_s, 6), version=self.engine.policy_version
            )
        self._passes.record(
            t0,
            t1,
            int(stats["tokens_generated"] - tokens),
            cpu0,
            cpu1,
            (int(stats["prefills"] - prefills), int(stats["prefill_tokens"] - prefill_tokens)),
            int(stats["attention_reads"] - reads),
        )

    def submit(self, request: GenerationRequest, queue: asyncio.Queue | None = None) -> asyncio.Future:
        """Queue a request; `queue` (bounded by the caller) receives a TokenEvent per token."""
        self._ensure_loop()
        fut: asyncio.Future = asyncio.get_running_loop().create_future()

        def done(samples: list[Sample]) -> None:
            if not fut.done():
                fut.set_result(samples)

        def fail(error: BaseException) -> None:
            if not fut.done():
                fut.set_exception(error)

        on_token = None
        if queue is not None:

            def on_token(index: int, tok: int, lp: float, version: int) -> None:
                queue.put_nowait(TokenEvent(index, tok, lp, version))

        group = self.engine.submit(request, done, fail, on_token)
        fut.add_done_callback(lambda f: self.engine.scheduler.abort(group) if f.cancelled() else None)
        self._work.set()
        return fut

    async def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        for r in requests:
            self.engine.scheduler.check(r)  # all or nothing: reject before queueing any
        return list(await asyncio.gather(*(self.submit(r) for r in requests)))

    def stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent | list[Sample]]:
        """Token events as they are sampled, then the request's samples as the last item."""
        return stream_events(self.submit, request)

    def check(self, request: GenerationRequest) -> None:
        """Raise RequestError for a request the engine cannot take (before anything is queued)."""
        self.engine.scheduler.check(request)

    @property
    def max_seq_len(self) -> int:
        return self.engine.scheduler.max_seq_len

    @property
    def vocab_size(self) -> int:
        return self.engine.runner.vocab_size

    def health(self) -> dict[str, int]:
        sched = self.engine.scheduler
        return {"policy_version": sched.policy_version, "running": len(sched.rows), "waiting": len(sched.waiting)}

    async def close(self) -> None:
        if self._passes is not None:
            self._passes.flush()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None


async def stream_events(
    submit: Callable[[GenerationRequest, asyncio.Queue], asyncio.Future], request: GenerationRequest
) -> AsyncIterator[TokenEvent | list[Sample]]:
    """Drive `submit(request, queue)` and yield its TokenEvents as they arrive, then its samples.
    Leaving early (a client hung up) cancels the request's future, which aborts its sequences."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=request.n * request.params.max_new_tokens + 1)
    fut = submit(request, queue)
    try:
        while True:
            getter = asyncio.create_task(queue.get(), name=f"engine-stream-{request.request_id}")
            await asyncio.wait({getter, fut}, return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                yield getter.result()
                continue
            getter.cancel()
            while not queue.empty():
                yield queue.get_nowait()
            yield fut.result()
            return
    finally:
        if not fut.done():
            fut.cancel()
