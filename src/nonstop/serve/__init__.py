"""`nonstop serve`: an engine behind an OpenAI-compatible HTTP server, and its async clients.

`serve(cfg, model_path, ...)` loads the tokenizer, builds the engine `cfg.engine.kind` names
(the built-in engine from `cfg.engine`, or vLLM from `cfg.engine.vllm`, running in this
process) at the policy_version the trainer saved the weights at (nonstop_version.json, 0 for a
base model), serves until SIGINT/SIGTERM and then shuts down cleanly, within about a second
whatever the clients do (a second Ctrl-C interrupts even that). A vLLM that is missing or
cannot load the model raises VllmSetupError (a ConfigError naming the fix) before anything binds.

- fields.py          the request field types: strict JSON types with the engine's bounds;
- schema.py          the request shapes as pydantic models: they validate every request and give
                     the JSON schema;
- validation.py      a body against a request model, or `BadRequest` naming the field;
- responses.py       the response shapes as pydantic models, with the `nonstop` extension (token
                     ids, behaviour logprobs, policy versions); every answer is built from them;
- openapi.py         the OpenAPI document of both, served at `GET /openapi.json` and fuzzed against;
- protocol.py        requests as engine calls (`Call`), stop strings on text, the extension of a sample,
                     `ServedEngine` (what the server asks of an engine);
- server.py          `EngineServer`: the aiohttp routes over any `ServedEngine` (built-in or vLLM);
- answers.py         `Answers`: the engine's samples written as OpenAI responses, whole or streamed;
- generate_route.py  vLLM's token-level `POST /inference/v1/generate` (what verifiers' train client calls);
- episodes.py        `EpisodeRecorder`: agents' episodes recorded token by token under the episode id they
                     pass, rewarded, handed to training by group (a training run's agents endpoint);
- episode_record.py  what is recorded of an episode (`Turn`), and a request's episode and group ids;
- client.py          `GenerationClient` and its two implementations: `InProcessClient`, `HttpClient`.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nonstop.serve.protocol import ServedEngine


def build_engine(cfg: Any, model_path: str, tok: Any) -> ServedEngine:
    """The engine `cfg.engine.kind` names, with `model_path`'s weights at the policy_version the
    trainer saved them at (0 for a base model; checkpoint.saved_policy_version)."""
    from nonstop.checkpoint import saved_policy_version
    from nonstop.hf import stop_token_ids

    version = saved_policy_version(model_path)
    if cfg.engine.kind == "vllm":
        from nonstop.engine.vllm_engine import VllmEngineWorker

        return VllmEngineWorker(
            model_path,
            stop_token_ids(tok, model_path),
            tok.pad_token_id,
            seed=cfg.run.seed,
            initial_version=version,
            settings=cfg.engine,
        )
    import torch

    from nonstop.engine.aio import AsyncEngine
    from nonstop.engine.core import TorchEngine
    from nonstop.hf import load_model

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
    from nonstop.hf import load_tokenizer
    from nonstop.serve.server import EngineServer

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
