"""Building a run: spawn the actors, connect the weight transport, wire the stages together.

`build_run(...)` returns a `Run`: the fixed wiring of one training run (config, data, the
engine pool and the trainer rank group as typed clients, buffer, scorer, prompt stream and
ledger, metrics sink) and its small mutable `RunState` (clock, base accuracy, first step, last
checkpoint), which resume (recovery.py) and the learning loop (learn.py) update.

Wiring: `runtime.num_engines` engine actors, each behind a RestartingEngine whose replacement
starts from the same weights and attaches to the same transport, behind one least-loaded
EnginePool; `trainer.ranks` trainer actors in one RankGroup (with several, they form their
process group before anything else). Trainer rank 0 is transport rank 0; engine i is rank i + 1.
Services the actors open for each other listen where the backend says (`ActorBackend.host`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nonstop.checkpoint import Checkpoint
from nonstop.clients import EngineClient, TrainerClient
from nonstop.config import Config
from nonstop.engine.worker import EngineWorker
from nonstop.observe.clock import Clock
from nonstop.observe.progress import Progress
from nonstop.observe.spans import SpanLog, span_path
from nonstop.observe.tracking import MetricsSink, open_sinks
from nonstop.orchestrator.buffer import RolloutBuffer, make_buffer
from nonstop.orchestrator.dispatch import EnginePool, RankGroup
from nonstop.orchestrator.episode_flow import EnvRun
from nonstop.orchestrator.generate import Codec, RolloutStats, evaluate
from nonstop.orchestrator.ledger import Ledger
from nonstop.orchestrator.score import RewardFn
from nonstop.runtime import ActorBackend
from nonstop.runtime.actor_clients import EngineActor, TrainerActor
from nonstop.runtime.restart import RestartingEngine
from nonstop.scoring.base import Scorer
from nonstop.scoring.build import build_scorer
from nonstop.tasks.data import PromptStream, TaskData, screen_prompts
from nonstop.trainer.worker import TrainerWorker
from nonstop.types import SamplingParams, TransportHandle

if TYPE_CHECKING:
    from nonstop.orchestrator.policies import Policies


@dataclass
class RunState:
    """What changes during a run besides the stages' own counters; a checkpoint saves it."""

    clock: Clock = field(default_factory=Clock)  # RL wall time and busy seconds per side
    base_accuracy: float = 0.0
    first_step: int = 1
    last_checkpoint: int | None = None
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    """Set by the first Ctrl-C (or SIGTERM): the learning loop ends after the current step and
    writes a checkpoint."""


@dataclass(frozen=True)
class Run:
    cfg: Config
    data: TaskData
    codec: Codec
    engine: EnginePool  # of RestartingEngine
    engines: list[RestartingEngine]  # the pool's members, for their fault counters
    trainer: TrainerClient
    buffer: RolloutBuffer
    scorer: Scorer
    stats: RolloutStats
    stream: PromptStream
    ledger: Ledger
    sink: MetricsSink  # metrics.jsonl and the trackers of cfg.tracking
    progress: Progress
    run_dir: Path
    base_model: Path
    state: RunState
    spans: SpanLog = field(default_factory=lambda: SpanLog(None))  # the orchestrator's span file
    transport: TransportHandle | None = None
    envs: EnvRun | None = None  # an environment run (cfg.env): episodes instead of single-turn groups
    policies: Policies | None = None  # roles with their own policy (cfg.env.policies; orchestrator/policies.py)

    async def eval(self) -> float:
        """Greedy exact-match accuracy; in an environment run, the success rate of sampled episodes."""
        if self.envs is not None:
            r = self.cfg.rollout
            params = SamplingParams(
                self.envs.limits.turn_max_tokens, r.temperature, top_k=r.top_k, top_p=r.top_p, min_p=r.min_p
            )
            return await self.envs.evaluate(self.engine, self.data.eval, self.codec, params)
        return await evaluate(self.engine, self.data.eval, self.codec, self.cfg.rollout.max_new_tokens)


def _names(role: str, count: int) -> list[str]:
    return [role] if count == 1 else [f"{role}-{i}" for i in range(count)]


def _span_file(cfg: Config, run_dir: Path | None, actor: str) -> str | None:
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
    """Engine i of `runtime.num_engines`, named `prefix` (a policy of env.policies has its own)."""
    worker: type = EngineWorker
    if cfg.engine.kind == "vllm":
        from nonstop.engine.vllm_engine import VllmEngineWorker

        worker = VllmEngineWorker
    return EngineActor(
        await backend.spawn(
            _names(prefix, cfg.runtime.num_engines)[i],
            worker,
            str(weights),
            [tok.eos_token_id],
            tok.pad_token_id,
            cfg.run.seed + i,
            initial_version=version0,
            settings=cfg.engine_settings,
            span_path=_span_file(cfg, run_dir, f"{prefix}-{i}"),
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
                    span_path=_span_file(cfg, run_dir, f"{prefix}-{r}"),
                    distill=cfg.distill if cfg.distill.teacher is not None else None,
                )
                for r, n in enumerate(_names(prefix, cfg.trainer.ranks))
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
    """Trainer rank 0 is transport rank 0; engine i is rank i + 1."""
    handle = await trainer.plan_transport(cfg.transport, len(engines), host)
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


def screen(cfg: Config, data: TaskData, codec: Codec, model_weights: Path, progress: Progress) -> None:
    """Skip prompts too long for the model's context with room for the completion."""
    from nonstop.hf import max_positions

    new_tokens = cfg.env.max_episode_tokens if cfg.env is not None else cfg.rollout.max_new_tokens
    limit = cfg.task.max_prompt_tokens or max_positions(model_weights) - new_tokens
    long_prompts = screen_prompts(data, codec.encode, limit, cfg.task.on_bad_row)
    for problem in long_prompts[:10]:
        progress.log(f"[yellow]dataset:[/] {problem}; skipped")
    if len(long_prompts) > 10:
        progress.log(f"dataset: {len(long_prompts)} over-long prompts skipped in all")


async def build_run(
    cfg: Config,
    backend: ActorBackend,
    base_model: Path,
    data: TaskData,
    run_dir: Path,
    progress: Progress,
    resume: Checkpoint | None = None,
    reward: RewardFn | None = None,
) -> Run:
    """Spawn and connect the actors and wire the stages. With `resume`, actors start from the
    checkpoint's weights and trainer state (the orchestrator's state comes back in recovery.py).
    `reward` (a Python callable, from nonstop.api) replaces task.reward; it runs in this process
    and is never pickled unless scoring.pool sends it to worker processes ('process', or 'auto'
    for a slow module-level function). The scoring stage's actors (scoring/build.py) start
    beside the engines and trainers; pool 'auto' starts its workers later, if a function needs them."""
    from nonstop.hf import load_tokenizer

    weights = resume.model_dir if resume is not None else base_model
    lora = cfg.model.lora.enabled  # LoRA: engines always hold the base; adapters come by transport
    model_weights = base_model if lora else weights
    version0 = resume.state["policy_version"] if resume is not None else 0
    codec = Codec(load_tokenizer(str(weights)))
    tok = codec.tokenizer
    screen(cfg, data, codec, model_weights, progress)
    scorer = build_scorer(cfg, backend, codec.decode, reward, progress.log, str(weights))  # bad names fail here
    num_engines = cfg.runtime.num_engines
    progress.log(
        f"starting {num_engines} engine and {cfg.trainer.ranks} trainer actor(s) ({cfg.runtime.backend} backend) ..."
    )
    first_engines, trainer, _ = await asyncio.gather(
        asyncio.gather(
            *(spawn_engine(backend, cfg, model_weights, tok, i, version0, run_dir) for i in range(num_engines))
        ),
        spawn_trainers(
            backend,
            cfg,
            model_weights,
            tok,
            str(base_model) if resume is not None else None,
            adapter_path=str(weights) if resume is not None and lora else None,
            run_dir=run_dir,
        ),
        scorer.start(),
    )
    if resume is not None:
        await trainer.load_checkpoint(str(resume.path))
    handle = await connect_transport(cfg, trainer, list(first_engines), backend.host)
    engines = [
        RestartingEngine(
            e.name,
            engine_restarter(backend, cfg, model_weights, tok, i, version0, handle, trainer, run_dir),
            cfg.engine_restarts,
            cfg.runtime.heartbeat_interval_s,
            cfg.runtime.heartbeat_timeout_s,
            log=progress.log,
            engine=e,
        )
        for i, e in enumerate(first_engines)
    ]
    own = sorted(cfg.env.policies) if cfg.env is not None else []
    ledger = Ledger(("", *own) if own else ())  # with own policies a row settles once each settled its part
    spans = SpanLog(_span_file(cfg, run_dir, "orchestrator"))
    buffer = make_buffer(cfg, ledger.part("") if own else ledger, spans)
    policies = None
    if own:
        from nonstop.orchestrator.policies import Policies, build_policies

        sides = await build_policies(cfg, backend, base_model, tok, ledger, run_dir, spans, progress, resume)
        policies = Policies(buffer, sides, cfg.rollout.filter_uniform_reward, ledger)
    return Run(
        cfg,
        data,
        codec,
        EnginePool(list(engines)),
        engines,
        trainer,
        buffer,
        scorer,
        RolloutStats(),
        PromptStream(data.train, cfg.run.seed, cfg.run.max_epochs),
        ledger,
        open_sinks(cfg, run_dir),
        progress,
        run_dir,
        base_model,
        RunState(),
        spans,
        handle,
        EnvRun.build(cfg.env, weights) if cfg.env is not None else None,
        policies,
    )
