"""The generate stage: rollout production and evaluation, in the orchestrator, over an EngineClient.

`produce(production, engine, scorer, ...)` loops until the stream runs out: wait for admission
from the buffer, take the next prompts from the stream (recording each draw in the ledger), have
the engine complete each one `group_size` times, decode and score the groups (the scoring stage
runs many groups at once and holds admission while too many wait for it), and hand each group to
the buffer (or drop it, counted and settled, when its reward failed or when all its samples
scored the same and the run filters such groups). When the stream is exhausted it closes the
buffer. `Production` holds what every producer (this one, modes/environment/episode_flow.py's
`produce_episodes` and modes/api_agents/agents.py's `produce_agent_groups`) shares; the run's
mode builds it (modes/single_turn.py `production`). `evaluate(...)` scores held-out prompts with
the engine's current weights by the task's reward (greedy by default, or mean@k; tasks/codec.py HeldOut).

With a `seed` (rollout.seed_per_prompt), each group's request carries `draw_seed(seed, epoch,
prompt index)` and the engine seeds completion i with it + i: what a prompt's completions are
then depends only on the weights, never on batching, engine placement or a resume.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from nonstop.clients import EngineClient
from nonstop.config import RolloutConfig
from nonstop.errors import RunError
from nonstop.observe.clock import BusyClock, Clock
from nonstop.observe.spans import SpanLog, now
from nonstop.orchestrator.buffer import Intake
from nonstop.orchestrator.ledger import Ledger
from nonstop.orchestrator.records import Vitals
from nonstop.scoring.base import Scorer
from nonstop.tasks.codec import Codec, HeldOut, eval_requests
from nonstop.tasks.data import Draw, Example, PromptStream
from nonstop.types import GenerationRequest, Group, Sample, SamplingParams


def draw_seed(run_seed: int, epoch: int, index: int) -> int:
    """The sampling seed of one draw of a prompt: 56 bits of a hash of (run seed, epoch, prompt
    index), so the engine's per-completion seeds (+ completion index) stay far apart and in range."""
    digest = hashlib.blake2b(f"{run_seed}:{epoch}:{index}".encode(), digest_size=7).digest()
    return int.from_bytes(digest, "big")


class NoLearningSignal(RunError, RuntimeError):
    """Rollouts keep failing to produce trainable groups; the message says why and what to change."""


@dataclass
class RolloutStats:
    prompts: int = 0
    samples: int = 0
    groups_delivered: int = 0
    reward_failures_in_row: int = 0
    uniform_in_row: int = 0
    vitals: Vitals = field(default_factory=Vitals)
    """Sums over the groups scored since the last step record (not checkpointed: a window)."""

    def counters(self) -> dict[str, int]:
        """What a checkpoint saves (recovery.py): the counters, not the window of vitals."""
        return {k: v for k, v in asdict(self).items() if k != "vitals"}


@dataclass(frozen=True)
class Production:
    """What both producers share, one per run: where prompts come from (`stream`, each draw
    recorded in `ledger`) and where groups go (`buffer`: the run's buffer, or with env.policies a
    SplitIntake over one buffer per policy), how text becomes ids, the rollout settings, and what
    they count (generation's busy time in `clock`, `stats`, one `group` span per group in `spans`)."""

    buffer: Intake
    stream: PromptStream
    ledger: Ledger
    codec: Codec
    rollout: RolloutConfig
    clock: Clock
    stats: RolloutStats
    spans: SpanLog = field(default_factory=lambda: SpanLog(None))
    max_in_flight: int | None = None
    """Groups at most inside engine calls at once (None: no bound). An unbounded buffer admits far
    more groups than the engines hold; the rest wait here, before their call, so that
    `runtime.call_timeout_s` times an engine's work on a group and not a queue in front of it."""


async def produce(
    production: Production,
    engine: EngineClient,
    scorer: Scorer,
    max_reward_failures: int,
    seed: int | None = None,
) -> None:
    """Each admitted prompt becomes its own engine call, so a group is scored and handed to the
    buffer as soon as its own completions are done, while the engine keeps decoding the others
    in the same continuous batch. The buffer's admission bounds the groups in flight. Each
    group's life (admitted, generated, delivered) is one `group` event in the span log. `seed`:
    the run seed when every draw is sampled from its own seed (rollout.seed_per_prompt);
    `max_reward_failures` groups in a row whose reward failed end the run (NoLearningSignal)."""
    p = production
    buffer, codec, cfg, stats, log = p.buffer, p.codec, p.rollout, p.stats, p.spans
    params = SamplingParams(cfg.max_new_tokens, cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, min_p=cfg.min_p)
    busy = BusyClock(p.clock)
    calls = asyncio.Semaphore(p.max_in_flight) if p.max_in_flight is not None else contextlib.nullcontext()

    async def one_group(draw: Draw, t_admit: float) -> None:
        ex = draw.example
        async with calls:
            busy.enter()
            t_gen0 = now()
            try:
                own = params if seed is None else replace(params, seed=draw_seed(seed, draw.epoch, ex.index))
                request = GenerationRequest(ex.index, codec.encode(ex.prompt), cfg.group_size, own)
                results = await engine.generate([request])
            finally:
                busy.leave()
        t_gen1 = now()
        t_scored: float | None = None
        try:
            group, scored = await score(ex, draw.epoch, results[0])
            t_scored = now()
            await deliver(group, scored)
        finally:  # also when the run ends while the group waits for scoring or buffer space: its samples count
            if log.enabled:
                versions = [v for s in results[0] for v in (s.versions[:1] + s.versions[-1:])]
                t_done = now()
                log.emit(
                    "group",
                    id=[draw.epoch, ex.index],
                    t_admit=round(t_admit, 6),
                    t_gen0=round(t_gen0, 6),
                    t_gen1=round(t_gen1, 6),
                    t_scored=round(t_scored if t_scored is not None else t_done, 6),
                    t_done=round(t_done, 6),
                    lens=[len(s.completion_ids) for s in results[0]],
                    v=[min(versions), max(versions)] if versions else [],
                )

    async def score(ex: Example, epoch: int, samples: list[Sample]) -> tuple[Group, bool]:
        """The group of an example's samples, decoded and scored; False when its reward failed."""
        stats.samples += len(samples)
        for i, s in enumerate(samples):
            s.text = codec.decode(s.completion_ids)
            s.index = i
        group = Group(ex.index, ex.prompt, ex.answer, samples, epoch=epoch, extra=ex.extra, messages=ex.messages)
        return group, await scorer.score(group)

    async def deliver(group: Group, scored: bool) -> None:
        """Hand a scored group to the buffer, or drop it (counted and settled) for a failed reward or no signal."""
        if not scored:
            await buffer.drop(group, "reward_error")
            stats.reward_failures_in_row += 1
            if stats.reward_failures_in_row >= max_reward_failures:
                raise NoLearningSignal(
                    f"the reward function failed on {stats.reward_failures_in_row} groups in a row "
                    f"(task.max_consecutive_reward_failures); last: {scorer.last_error}"
                )
            return
        stats.reward_failures_in_row = 0
        stats.vitals.add(group)
        if cfg.filter_uniform_reward and len({s.reward for s in group.samples}) == 1:
            await drop_uniform(buffer, group, stats, cfg.max_consecutive_uniform)
            return
        stats.uniform_in_row = 0
        stats.groups_delivered += 1
        await buffer.put(group)

    await admit_and_run(buffer, p.stream, p.ledger, stats, cfg.prompts_per_step, one_group, "group", ready=scorer.ready)


async def drop_uniform(buffer: Intake, group: Group, stats: RolloutStats, max_in_row: int) -> None:
    """Drop a group without learning signal; `max_in_row` such groups in a row end the run, since a
    policy that never produces a signal would otherwise generate until the time budget (or forever)."""
    await buffer.drop(group, "uniform_reward")
    stats.uniform_in_row += 1
    if stats.uniform_in_row >= max_in_row:
        raise NoLearningSignal(
            f"{stats.uniform_in_row} groups in a row had all-equal rewards "
            "(rollout.max_consecutive_uniform): the policy gets no learning signal on this task; "
            "start from a stronger base, use a graded reward, or set rollout.filter_uniform_reward=false"
        )


async def admit_and_run(
    buffer: Intake,
    stream: PromptStream,
    ledger: Ledger,
    stats: RolloutStats,
    prompts_per_step: int,
    run_group: Callable[[Draw, float], Coroutine[Any, Any, None]],
    task_name: str,
    ready: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """The admission loop both producers share: wait for `ready` (a stage that falls behind slows
    admission) and for the buffer's admission, draw that many prompts (each recorded in the
    ledger) and run each draw's group as its own named task, given its admission time. The first
    group failure ends the loop. When the stream runs out, the groups in flight finish, then the
    buffer closes."""
    try:
        async with asyncio.TaskGroup() as groups:
            while True:
                if ready is not None:
                    await ready()
                k = await buffer.admit(prompts_per_step)
                t_admit = now()
                draws = [d for d in (stream.next() for _ in range(k)) if d is not None]
                if len(draws) < k:
                    await buffer.refund(k - len(draws))
                if not draws:
                    break
                for d in draws:
                    ledger.draw(d)
                    stats.prompts += 1
                    groups.create_task(run_group(d, t_admit), name=f"{task_name}-{d.example.index}")
    except BaseExceptionGroup as eg:
        raise eg.exceptions[0] from None
    await buffer.close()


async def evaluate(
    engine: EngineClient, examples: list[Example], codec: Codec, max_new_tokens: int, held_out: HeldOut
) -> float:
    requests = eval_requests(examples, codec, max_new_tokens, held_out.samples, held_out.temperature)
    return await held_out.score(await engine.generate(requests), examples, codec)
