"""An engine behind a real `nonstop serve` HTTP server on 127.0.0.1, for tests that talk HTTP to it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from nonstop.engine.aio import AsyncEngine
from nonstop.serve.server import EngineServer


@contextlib.asynccontextmanager
async def serving(aio: AsyncEngine, tok, name: str, api_key: str | None = None) -> AsyncIterator[str]:
    """Serve `aio` on a free port of 127.0.0.1 and yield its base URL; on exit stop the server, then the engine."""
    server = EngineServer(aio, tok, name, api_key=api_key)
    port = await server.start("127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await server.stop()
        await aio.close()
