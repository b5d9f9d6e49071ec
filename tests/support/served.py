"""An engine behind a real `nonstop serve` HTTP server on 127.0.0.1, for tests that talk HTTP to it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

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


def served_versions(model_dir: Path) -> tuple[int, list[int]]:
    """Serve `model_dir` with the engine `nonstop serve` builds for it (serve.build_engine) on
    127.0.0.1: /health's policy_version and the policy_versions of a completion's tokens."""
    import aiohttp

    from nonstop.config import load_config
    from nonstop.hf import load_tokenizer
    from nonstop.serve.command import build_engine

    tok = load_tokenizer(str(model_dir))

    async def main() -> tuple[int, list[int]]:
        engine = build_engine(load_config(None, []), str(model_dir), tok)
        async with serving(engine, tok, "saved") as url, aiohttp.ClientSession() as s:
            async with s.get(url + "/health") as r:
                health = await r.json()
            async with s.post(url + "/v1/completions", json={"prompt": "1+1=", "max_tokens": 3}) as r:
                out = await r.json()
        return health["policy_version"], out["choices"][0]["nonstop"]["policy_versions"]

    return asyncio.run(main())
