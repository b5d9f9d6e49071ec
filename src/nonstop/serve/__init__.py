"""`nonstop serve`: the engine behind an OpenAI-compatible HTTP server, and its async clients.

`serve(cfg, model_path, ...)` loads the model and tokenizer, builds the engine from
`cfg.engine`, serves until SIGINT/SIGTERM and then shuts down cleanly.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable


async def serve(cfg, model_path: str, host: str, port: int, api_key: str | None, model_name: str,
                on_ready: Callable[[int], None]) -> None:
    import torch

    from nonstop.engine.aio import AsyncEngine
    from nonstop.engine.core import TorchEngine
    from nonstop.hf import load_model, load_tokenizer
    from nonstop.serve.server import EngineServer

    torch.manual_seed(cfg.run.seed)
    tok = load_tokenizer(model_path)
    engine = TorchEngine(load_model(model_path), [tok.eos_token_id], tok.pad_token_id, settings=cfg.engine,
                         detokenize=lambda ids: tok.decode(ids, skip_special_tokens=True))
    aio = AsyncEngine(engine)
    server = EngineServer(aio, tok, model_name, api_key, max_tokens_default=cfg.rollout.max_new_tokens)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    bound = await server.start(host, port)
    on_ready(bound)
    try:
        await stop.wait()
    finally:
        await server.stop()
        await aio.close()
