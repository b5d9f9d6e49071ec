"""Schema-driven fuzzing of `nonstop serve` over real HTTP on 127.0.0.1 (schemathesis on hypothesis).

Requests are generated from the server's own `/openapi.json` (serve/openapi.py, built from the
pydantic models that validate them), both valid ones and ones that break the schema, for every
route. Every answer must be a 2xx or a 4xx JSON error, match the documented status, content type
and body schema (streamed events included), and an invalid request must be refused; no request
may hang, and `/health` must answer throughout. What the fuzzer found is pinned in
test_server_hardening.py (test_fuzz_findings_are_refused_or_served).

The default run is bounded (FUZZ_EXAMPLES requests, about 15 s); the slow form runs ten times as
many. NONSTOP_FUZZ_EXAMPLES overrides both.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Iterator

import pytest

schemathesis = pytest.importorskip("schemathesis")
import requests  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from nonstop.config import EngineConfig  # noqa: E402
from nonstop.engine.aio import AsyncEngine  # noqa: E402
from nonstop.engine.core import TorchEngine  # noqa: E402
from nonstop.hf import load_model, load_tokenizer  # noqa: E402
from nonstop.serve.server import EngineServer  # noqa: E402

FUZZ_EXAMPLES = 150
REQUEST_TIMEOUT_S = 60.0
"""A request unanswered after this long is a hang (generous: a loaded 2-core machine)."""
HEALTH_TIMEOUT_S = 10.0
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


class Served:
    """An engine and its server on their own event loop in a thread, for synchronous clients."""

    def __init__(self, tiny_dir) -> None:
        tok = load_tokenizer(str(tiny_dir))
        engine = TorchEngine(
            load_model(str(tiny_dir)),
            [tok.eos_token_id],
            tok.pad_token_id,
            settings=EngineConfig(max_seq_len=256, max_concurrent_seqs=8),
            detokenize=lambda ids: tok.decode(ids, skip_special_tokens=True),
        )
        self.aio = AsyncEngine(engine)
        self.server = EngineServer(self.aio, tok, "tiny-fuzz")
        self._ready = threading.Event()
        self._thread = threading.Thread(target=asyncio.run, args=(self._main(),), name="fuzz-server", daemon=True)
        self.url = ""

    async def _main(self) -> None:
        port = await self.server.start("127.0.0.1", 0)
        self.url, self._loop, self._stop = f"http://127.0.0.1:{port}", asyncio.get_running_loop(), asyncio.Event()
        self._ready.set()
        await self._stop.wait()
        await self.server.stop()
        await self.aio.close()

    def __enter__(self) -> Served:
        self._thread.start()
        assert self._ready.wait(60), "the server did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)


@dataclasses.dataclass
class HealthTally:
    answers: int = 0
    failures: list[str] = dataclasses.field(default_factory=list)
    worst_s: float = 0.0


@contextlib.contextmanager
def health_watch(url: str) -> Iterator[HealthTally]:
    """Ask /health every 0.1 s while the body runs."""
    tally, done = HealthTally(), threading.Event()

    def watch() -> None:
        with requests.Session() as s:
            while not done.wait(0.1):
                t0 = time.perf_counter()
                try:
                    r = s.get(url + "/health", timeout=HEALTH_TIMEOUT_S)
                    if r.status_code != 200 or r.json()["status"] != "ok":
                        tally.failures.append(f"{r.status_code}: {r.text[:200]}")
                except (requests.RequestException, ValueError) as e:
                    tally.failures.append(repr(e))
                tally.worst_s = max(tally.worst_s, time.perf_counter() - t0)
                tally.answers += 1

    t = threading.Thread(target=watch, name="health-watch", daemon=True)
    t.start()
    try:
        yield tally
    finally:
        done.set()
        t.join(HEALTH_TIMEOUT_S + 5)


def _fuzz(tiny_dir, examples: int) -> None:
    statuses: collections.Counter[tuple[str, int]] = collections.Counter()
    with Served(tiny_dir) as served, requests.Session() as session, health_watch(served.url) as health:
        schema = schemathesis.openapi.from_dict(requests.get(served.url + "/openapi.json", timeout=30).json())
        cases = st.one_of(
            schema.as_strategy(generation_mode=GenerationMode.POSITIVE),
            schema.as_strategy(generation_mode=GenerationMode.NEGATIVE),
        )

        @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(cases)
        def fuzz(case) -> None:
            try:
                response = case.call(base_url=served.url, session=session, timeout=REQUEST_TIMEOUT_S)
            except requests.Timeout:
                pytest.fail(
                    f"no answer within {REQUEST_TIMEOUT_S:g} s (a hang): {case.method} {case.path} {case.body!r}"
                )
            statuses[(case.path, response.status_code)] += 1
            case.validate_response(response, checks=CHECKS)

        fuzz()
        for _ in range(200):  # every request has ended: nothing is left running in the engine
            if not served.aio.engine.has_work():
                break
            time.sleep(0.05)
        assert not served.aio.engine.has_work()
        assert served.server.requests_served > 0
    print(f"fuzz: {sum(statuses.values())} requests {dict(statuses)}; /health {health}")
    assert not any(code >= 500 for _, code in statuses)
    assert health.answers and not health.failures, health
    served_ok = {path for path, code in statuses if code == 200}
    assert {"/v1/completions", "/v1/chat/completions"} <= served_ok, statuses  # not only refusals


def test_fuzz_every_route_from_the_openapi_schema(tiny_dir):
    _fuzz(tiny_dir, int(os.environ.get("NONSTOP_FUZZ_EXAMPLES", FUZZ_EXAMPLES)))


@pytest.mark.slow
def test_fuzz_every_route_longer(tiny_dir):
    _fuzz(tiny_dir, int(os.environ.get("NONSTOP_FUZZ_EXAMPLES", 10 * FUZZ_EXAMPLES)))
