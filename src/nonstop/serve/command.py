"""What `nonstop serve` runs: the engine `cfg.engine.kind` names, built from a model folder, behind
the HTTP server (server.py) until SIGINT/SIGTERM.

`build_engine(cfg, model_path, tok)` is the built-in engine (an `AsyncEngine` over a `TorchEngine`
with `cfg.engine`'s settings) or vLLM (`VllmEngineWorker`, running in this process), at the
policy_version the trainer saved the weights at (checkpoint.saved_policy_version: 0 for a base
model). `serve(...)` loads the tokenizer, builds the engine, binds and calls `on_ready` with the
port, and on the first signal stops the server and closes the engine.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from typing import Any

import torch

from nonstop.checkpoint import saved_policy_version
from nonstop.engine.aio import AsyncEngine
from nonstop.engine.core import TorchEngine
from nonstop.engine.vllm.engine import VllmEngineWorker
from nonstop.hf import load_model, load_tokenizer, stop_token_ids
from nonstop.serve.protocol import ServedEngine
from nonstop.serve.server import EngineServer


def build_engine(cfg: Any, model_path: str, tok: Any) -> ServedEngine:
    """The engine `cfg.engine.kind` names, with `model_path`'s weights at the policy_version the
    trainer saved them at (0 for a base model; checkpoint.saved_policy_version)."""
    version = saved_policy_version(model_path)
    if cfg.engine.kind == "vllm":
        return VllmEngineWorker(
            model_path,
            stop_token_ids(tok, model_path),
            tok.pad_token_id,
            seed=cfg.run.seed,
            initial_version=version,
            settings=cfg.engine,
        )
    torch.manual_seed(cfg.run.seed)
    engine = TorchEngine(
        load_model(model_path),
        stop_token_ids(tok, model_path),
        tok.pad_token_id,
        policy_version=version,
        settings=cfg.engine,
        detokenize=lambda ids: tok.decode(ids, skip_special_tokens=True),
    )
    return AsyncEngine(engine)


async def serve(
    cfg, model_path: str, host: str, port: int, api_key: str | None, model_name: str, on_ready: Callable[[int], None]
) -> None:
    tok = load_tokenizer(model_path)
    engine = build_engine(cfg, model_path, tok)
    server = EngineServer(engine, tok, model_name, api_key, max_tokens_default=cfg.rollout.max_new_tokens)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def stopping() -> None:
        stop.set()
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C interrupts the shutdown itself
            loop.remove_signal_handler(sig)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping)
    try:
        bound = await server.start(host, port)
        on_ready(bound)
        await stop.wait()
    finally:
        await server.stop()
        await engine.close()
