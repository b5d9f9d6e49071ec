"""Agents over the API (config `agents`): the run's endpoint, and the producer its episodes feed.

`AgentEndpoint` serves serve/server.py's `EngineServer` in front of the run's own engine pool
(`PoolEngine`, a `ServedEngine`) with an `EpisodeRecorder` (serve/recorder.py): agent programs,
written against any OpenAI client, play episodes under an episode id and a group id, post each
episode's reward, and every complete group of `rollout.group_size` rewarded episodes is handed
to training with exactly the tokens the engines sampled and the agents' text between turns.
The bound address goes to the progress output and to RUN_DIR/endpoint.json (base_url, model,
group_size, episode_timeout_s), so an agent program finds it; the recorded groups to
RUN_DIR/agents/groups.jsonl.

`produce_agent_groups` is the run's producer in this mode (the run draws no prompts of its own):
it waits for the buffer's admission, then for the next complete group, records it as a draw in
the ledger (so it settles once, trained or dropped), sets GRPO advantages over the group
(modes/environment/episode_flow.py `RoleBaselines`) and puts it in the buffer, or drops it
('uniform_reward') under rollout.filter_uniform_reward. When training ends, `finish()` refuses recorded requests (409),
drops and counts what is open, and keeps serving the final policy until no request came for
`agents.linger_s`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from nonstop.config import Config
from nonstop.engine.aio import TokenEvent
from nonstop.orchestrator.dispatch import EnginePool
from nonstop.orchestrator.generate import Production, drop_uniform
from nonstop.orchestrator.modes.environment.episode_flow import RoleBaselines
from nonstop.serve.recorder import EpisodeRecorder
from nonstop.serve.server import EngineServer
from nonstop.tasks.data import Draw, Example
from nonstop.types import GenerationRequest, Sample


class PoolEngine:
    """The run's engine pool as a `ServedEngine`: each request goes to the least-loaded engine; a
    stream yields the finished samples only (no per-token events)."""

    def __init__(self, pool: EnginePool, max_seq_len: int, vocab_size: int, version: Callable[[], int]) -> None:
        self.pool, self._max_seq_len, self._vocab_size, self._version = pool, max_seq_len, vocab_size, version
        self._ids = itertools.count(1 << 42)  # apart from the producers' and the evaluation's request ids
        self.running = 0

    @property
    def max_seq_len(self) -> int:
        return self._max_seq_len

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def check(self, request: GenerationRequest) -> None:
        """The server checked ids and lengths against the bounds above; the engines check the rest."""

    async def _generate(self, request: GenerationRequest) -> list[Sample]:
        self.running += 1
        try:
            return (await self.pool.generate([replace(request, request_id=next(self._ids))]))[0]
        finally:
            self.running -= 1

    def submit(self, request: GenerationRequest, queue: asyncio.Queue | None = None) -> asyncio.Future:
        return asyncio.ensure_future(self._generate(request))

    async def stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent | list[Sample]]:
        yield await self._generate(request)

    def health(self) -> dict[str, int]:
        return {"policy_version": self._version(), "running": self.running, "waiting": 0}

    async def close(self) -> None:
        """The engines belong to the run, which stops them."""


class AgentEndpoint:
    """The run's OpenAI-compatible endpoint with its episode recorder; `start()`, `finish()`, `stop()`."""

    def __init__(
        self, cfg: Config, pool: EnginePool, tokenizer: Any, run_dir: Path, version: Callable[[], int], max_seq_len: int
    ) -> None:
        a = cfg.agents
        self.cfg, self.run_dir = cfg, run_dir
        (run_dir / "agents").mkdir(exist_ok=True)
        self.log: Callable[[str], None] = print
        self.recorder = EpisodeRecorder(
            tokenizer,
            cfg.rollout.group_size,
            a.episode_timeout_s,
            a.max_open_episodes,
            log_path=run_dir / "agents" / "groups.jsonl",
            on_drop=lambda msg: self.log(f"[yellow]{msg}[/]"),
        )
        vocab = int(getattr(tokenizer, "vocab_size", 0) or len(tokenizer))
        self.engine = PoolEngine(pool, max_seq_len, max(vocab, len(tokenizer)), version)
        self.server = EngineServer(
            self.engine,
            tokenizer,
            a.model_name,
            a.api_key,
            max_tokens_default=cfg.env.turn_max_tokens if cfg.env is not None else cfg.rollout.max_new_tokens,
            recorder=self.recorder,
        )
        self.url: str | None = None

    async def start(self, log: Callable[[str], None]) -> str:
        """Bind, write RUN_DIR/endpoint.json, say where; returns the base URL (…/v1)."""
        a = self.cfg.agents
        self.log = log
        port = await self.server.start(a.host, a.port)
        self.url = f"http://{a.host}:{port}/v1"
        info = {
            "base_url": self.url,
            "model": a.model_name,
            "group_size": self.cfg.rollout.group_size,
            "episode_timeout_s": a.episode_timeout_s,
            "reward_path": "/episodes/{episode_id}/reward",
        }
        tmp = self.run_dir / "endpoint.json.tmp"
        tmp.write_text(json.dumps(info, indent=2))
        tmp.replace(self.run_dir / "endpoint.json")  # an agent polling for the file never reads half of it
        log(f"agents endpoint: {self.url} (model '{a.model_name}'; groups of {self.cfg.rollout.group_size} episodes)")
        return self.url

    async def finish(self) -> None:
        """Training ended: refuse recorded requests, drop what is open (counted), then serve the final
        policy until no request came for agents.linger_s."""
        self.recorder.close("the run has finished training; requests without an episode id are still served")
        linger_s = self.cfg.agents.linger_s
        if self.url is None or linger_s <= 0:
            return
        self.log(f"agents endpoint: serving the final policy until {linger_s:g} s pass without a request")
        activity = self.server.activity
        while True:
            activity.clear()
            try:
                await asyncio.wait_for(activity.wait(), linger_s)
            except TimeoutError:
                return

    async def stop(self) -> None:
        await self.server.stop()
        (self.run_dir / "endpoint.json").unlink(missing_ok=True)

    def report(self) -> dict[str, Any]:
        return {**self.recorder.report(), "requests_served": self.server.requests_served}


async def produce_agent_groups(production: Production, endpoint: AgentEndpoint) -> None:
    """The buffer fed by the agents' complete groups only (see the module docstring); runs until cancelled."""
    p, rollout, recorder = production, production.rollout, endpoint.recorder
    baselines = RoleBaselines("group", 0.0)
    while True:
        await p.buffer.admit(1)
        group = await recorder.next_group()
        p.ledger.draw(Draw(group.epoch, Example(group.prompt_index, group.prompt, "")))
        p.stats.prompts += 1
        p.stats.samples += len(group.samples)
        has_signal = baselines.assign(group.samples)
        if not has_signal and rollout.filter_uniform_reward:
            await drop_uniform(p.buffer, group, p.stats, rollout.max_consecutive_uniform)
            continue
        p.stats.uniform_in_row = 0
        p.stats.groups_delivered += 1
        await p.buffer.put(group)
