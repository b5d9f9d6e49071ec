"""Starting the actors of a policy: engines, trainer ranks, the weight transport between them,
and how a dead engine is started again.

Used for the run's shared policy (build.py) and for every role with its own policy
(modes/own_policies/policy_build.py), which passes its own config (`policy_config`) and name
`prefix`.
- `spawn_engine(...)`: engine i of `runtime.num_engines` (or of `runtime.max_engines`, for one
  that joins mid-run), the built-in torch engine or vLLM;
- `spawn_trainers(...)`: the `trainer.ranks` trainer actors as one RankGroup (dispatch.py);
  with several, they form their process group before anything else;
- `connect_transport(...)`: trainer rank 0 is transport rank 0, engine i is rank i + 1 (the
  transport is planned for `runtime.max_engines` engines, the first ones attach at once);
- `engine_restarter(...)`: what a RestartingEngine (runtime/restart.py) calls to replace
  engine i: a fresh actor from the same weights, attached to the same transport.
Services the actors open for each other listen where the backend says (`ActorBackend.host`).
With `run.spans`, each actor writes its span log under RUN_DIR/spans (observe/spans.py). Rank 0
of the shared policy's trainer keeps the record of what it trained, RUN_DIR/trained.jsonl
(observe/consumed.py); an own policy's trainer (env.policies) keeps none yet.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from nonstop.clients import EngineClient, TrainerClient
from nonstop.config import Config, FilesTransportConfig
from nonstop.engine.vllm.engine import VllmEngineWorker
from nonstop.engine.worker import EngineWorker
from nonstop.hf import stop_token_ids
from nonstop.observe.consumed import TRAINED
from nonstop.observe.spans import span_path
from nonstop.orchestrator.dispatch import RankGroup
from nonstop.runtime import ActorBackend
from nonstop.runtime.actor_clients import EngineActor, TrainerActor
from nonstop.sizing.defaults import wire_dtype
from nonstop.trainer.worker import TrainerWorker
from nonstop.types import TransportHandle


def actor_names(role: str, count: int) -> list[str]:
    """The names of `count` actors of one kind: `role` alone, else `role-0`, `role-1`, ..."""
    return [role] if count == 1 else [f"{role}-{i}" for i in range(count)]


def span_file(cfg: Config, run_dir: Path | None, actor: str) -> str | None:
    """Where actor `actor` writes its span log (None: spans off); see nonstop/observe/spans.py."""
    return str(span_path(run_dir, actor)) if cfg.run.spans and run_dir is not None else None


async def spawn_engine(
    backend: ActorBackend,
    cfg: Config,
    weights: Path,
    tok: Any,
    i: int,
    version0: int = 0,
    run_dir: Path | None = None,
    prefix: str = "engine",
) -> EngineActor:
    """Engine i of `runtime.max_engines`, named `prefix` (a policy of env.policies has its own)."""
    worker: type = EngineWorker
    if cfg.engine.kind == "vllm":
        worker = VllmEngineWorker
    return EngineActor(
        await backend.spawn(
            actor_names(prefix, cfg.max_engines)[i],
            worker,
            str(weights),
            stop_token_ids(tok, weights),
            tok.pad_token_id,
            cfg.run.seed + i,
            initial_version=version0,
            settings=cfg.engine_settings,
            span_path=span_file(cfg, run_dir, f"{prefix}-{i}"),
        )
    )


async def spawn_trainers(
    backend: ActorBackend,
    cfg: Config,
    weights: Path,
    tok: Any,
    reference_path: str | None = None,
    adapter_path: str | None = None,
    run_dir: Path | None = None,
    prefix: str = "trainer",
) -> RankGroup:
    """The trainer rank actors; with several, they form their process group before returning."""
    shared = prefix == "trainer"  # the run's shared policy, whose rank 0 keeps the record of what it trained
    ranks = [
        TrainerActor(a)
        for a in await asyncio.gather(
            *(
                backend.spawn(
                    n,
                    TrainerWorker,
                    str(weights),
                    cfg.trainer,
                    cfg.rollout.temperature,
                    tok.pad_token_id,
                    cfg.run.seed,
                    cfg.buffer.max_lag,
                    cfg.buffer.reject,
                    reference_path=reference_path,
                    total_steps=cfg.run.max_steps,
                    lora=cfg.model.lora,
                    adapter_path=adapter_path,
                    max_new_tokens=cfg.rollout.max_new_tokens,
                    span_path=span_file(cfg, run_dir, f"{prefix}-{r}"),
                    distill=cfg.distill if cfg.distill.teacher is not None else None,
                    record_path=str(run_dir / TRAINED) if r == 0 and run_dir is not None and shared else None,
                )
                for r, n in enumerate(actor_names(prefix, cfg.trainer.ranks))
            )
        )
    ]
    if len(ranks) > 1:
        addr, port = await ranks[0].rendezvous(backend.host)
        await asyncio.gather(
            *(t.join_group(addr, port, r, len(ranks), cfg.transport.connect_timeout_s) for r, t in enumerate(ranks))
        )
    return RankGroup(list(ranks))


async def connect_transport(
    cfg: Config, trainer: TrainerClient, engines: list[EngineClient], host: str | None
) -> TransportHandle:
    """Trainer rank 0 is transport rank 0; engine i is rank i + 1. `engines` attach now; engines
    up to `runtime.max_engines` may join later."""
    transport = cfg.transport
    if isinstance(transport, FilesTransportConfig) and transport.dir is not None:  # as this process sees it
        transport = transport.model_copy(update={"dir": str(Path(transport.dir).resolve())})
    transport = transport.model_copy(update={"dtype": wire_dtype(cfg)})
    handle = await trainer.plan_transport(transport, max(cfg.max_engines, len(engines)), host, len(engines))
    await asyncio.gather(
        trainer.connect_transport(), *(e.connect_transport(handle, i + 1) for i, e in enumerate(engines))
    )
    return handle


def engine_restarter(
    backend: ActorBackend,
    cfg: Config,
    weights: Path,
    tok: Any,
    i: int,
    version0: int,
    handle: TransportHandle,
    trainer: TrainerClient,
    run_dir: Path | None = None,
    prefix: str = "engine",
) -> Callable[[], Awaitable[EngineClient]]:
    """A fresh engine i: it starts from `weights` and applies the newest published version at
    its first forward pass. With broadcast, nothing is stored to take the newest version from:
    the engine joins the group (transport/broadcast.py re-plans it) and the trainer sends its
    current weights again, so the engine holds them before it serves a request."""

    async def restart_engine() -> EngineClient:
        engine = await spawn_engine(backend, cfg, weights, tok, i, version0, run_dir, prefix)
        await engine.connect_transport(handle, i + 1)
        if handle.kind == "broadcast":
            await trainer.publish(resend=True)
        return engine

    return restart_engine
