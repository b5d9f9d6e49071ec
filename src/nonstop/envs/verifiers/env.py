"""verifiers (0.4.0, `verifiers.v1`) on nonstop's engines, and its episodes into nonstop's buffer.

What runs, and whose code it is:
- verifiers' own model-call path, as its interception server runs it for every model call of a
  training rollout: `graph.prepare_turn(trace, messages)` -> `TrainClient.get_response(...)`
  (renders the prompt to ids, bridging from the previous turn's ids, and POSTs them to
  `/inference/v1/generate` through `renderers.client.generate`) -> `PendingTurn.commit(response)`
  into the trace's message graph -> `Trace.branches` (token ids, `sampled_mask`, logprobs,
  `SamplingMask`) -> `vf.Episode` with a `PolicySpan`;
- a verifiers `Taskset` gives the tasks, and each task's own `@vf.reward`/`@vf.metric` methods
  score the trace (`Task.score`, in process);
- nonstop serves `/inference/v1/generate`: over HTTP (`nonstop serve`, serve/generate_route.py),
  or in process through `EngineTransport` (envs/verifiers/client.py), an httpx transport that answers the same JSON from
  any `TurnEngine` (the training pipeline's engines), so no socket is needed in a run.

What stands in for verifiers here (`env.verifiers_rollout: chat_loop`): `play_episode` is the chat
loop: the task's prompt, then up to `max_turns` model turns, the trace scored after each; a turn
that does not solve the task (total reward below `solved_at`) is answered with the user message
`retry`. With `max_turns` 1 it is verifiers' single-turn rollout. With `env.verifiers_rollout:
agent`, verifiers' own `Agent.run` plays each episode instead, tools included
(envs/verifiers/agent.py); this module's `episode_result` turns its traces into samples too.

`TokenRenderer` (envs/verifiers/renderer.py) renders messages for tokenizers without a chat
template, so an episode's ids are exactly those `orchestrator/episodes.py` would make.

`episode_samples(episode)` turns a `vf.Episode` (one played here, or one read from verifiers'
wire format) into nonstop `Sample`s: per trainable trace and branch, the prompt is the branch's
ids before its first sampled token, the completion the rest, the loss mask `sampled_mask`,
behaviour logprobs as sampled, the kept sets from the branch's `SamplingMask` (an unsampled
token keeps itself), and per model token the `policy_version` the server reported (recorded
per assistant node in `trace.info["nonstop_policy_versions"]`), else the episode's
`PolicySpan.start` (the oldest version that could have produced it: staleness is never
underestimated). Environment tokens carry version -1, as in nonstop's own episodes.

Optional extra: `pip install 'nonstop[verifiers]'`.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import itertools
from collections import Counter
from typing import Any

import numpy as np

from nonstop.config import ConfigError, EnvConfig

try:
    import verifiers.v1 as vf
    from openai import AsyncOpenAI  # noqa: F401  (envs/verifiers/client.py uses it: missing, it is this ConfigError)
    from verifiers.v1 import graph
    from verifiers.v1.clients import TrainClient
    from verifiers.v1.dialects.chat import ChatDialect, message_to_wire
    from verifiers.v1.episode import EnvInfo, TrainRunInfo, TrainWorkInfo
    from verifiers.v1.trace import AgentInfo, TraceTask
except ImportError as e:
    raise ConfigError(
        f"env.name: verifiers environments need the verifiers extra: pip install 'nonstop[verifiers]' ({e})"
    ) from None
from nonstop.envs.base import ENV_VERSION, EnvLimits, EpisodeResult, TurnEngine
from nonstop.envs.verifiers.client import EngineTransport, VersionLog, train_client
from nonstop.envs.verifiers.renderer import TokenRenderer
from nonstop.tasks.data import DatasetReport, Example, TaskData
from nonstop.types import Sample, SamplingParams

VERSIONS_KEY = "nonstop_policy_versions"
"""`trace.info` key: assistant node index (as text) -> the policy_version of each sampled token."""
AGENT = "agent"


def _first_messages(task: vf.Task) -> list[vf.types.Message]:
    data = task.data
    messages: list[vf.types.Message] = [vf.SystemMessage(content=data.system_prompt)] if data.system_prompt else []
    if isinstance(data.prompt, list):
        return messages + list(data.prompt)
    return [*messages, vf.UserMessage(content=data.prompt_text)]


async def play_episode(
    client: TrainClient,
    versions: VersionLog,
    task: vf.Task,
    model: str,
    sampling: vf.SamplingConfig,
    max_turns: int,
    retry: str,
    solved_at: float = 1.0,
    step: int = 0,
    run_id: str = "nonstop",
    max_episode_tokens: int | None = None,
    tokenizer: Any = None,
) -> vf.Episode:
    """One episode of `task` through verifiers' model-call path (module docstring), scored by the task.
    With `max_episode_tokens` (and the `tokenizer` to count with), no turn samples past it."""
    trace: vf.Trace = vf.Trace(
        task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        agent=AgentInfo(config=vf.AgentConfig(model=model, sampling=sampling), name=AGENT),
    )
    node_versions: dict[str, list[int]] = trace.info.setdefault(VERSIONS_KEY, {})
    messages = _first_messages(task)
    counter = TokenRenderer(tokenizer) if tokenizer is not None else None
    used = len(counter.render([message_to_wire(m) for m in messages]).token_ids) if counter else 0
    for turn in range(max_turns):
        budget = sampling.max_tokens
        if max_episode_tokens is not None:
            left = max_episode_tokens - used
            if left <= 0:
                trace.stop("max_total_tokens")
                break
            budget = min(budget or left, left)
        pending = graph.prepare_turn(trace, messages)
        response = await client.get_response(
            ChatDialect(), {"model": model}, sampling.model_copy(update={"max_tokens": budget}), turn=pending
        )
        node = pending.commit(response)
        sampled = versions.pop(response.id)
        if sampled is not None:
            node_versions[str(node)] = sampled
        messages.append(response.message)
        trace.rewards, trace.metrics = {}, {}
        await task.score(trace)
        if trace.reward >= solved_at:
            trace.stop("solved")
            break
        if turn == max_turns - 1:
            trace.stop("max_turns" if max_turns > 1 else "answered")  # a single-turn rollout is not cut short
            break
        messages.append(vf.UserMessage(content=retry))
        if counter is not None and response.tokens is not None:
            used = (
                len(response.tokens.prompt_ids)
                + len(response.tokens.completion_ids)
                + len(counter._ids(message_to_wire(messages[-1]), first=False))
            )
    trace.is_completed = trace.ok = True
    spent = [v for vs in node_versions.values() for v in vs]
    span = vf.PolicySpan(start=min(spent), end=max(spent)) if spent else None
    return vf.Episode(
        env=EnvInfo(id="nonstop"),
        task=trace.task,
        traces=[trace],
        ok=True,
        run=TrainRunInfo(id=run_id, work=TrainWorkInfo(step=step, policy=span)),
    )


def _kept(mask: vf.SamplingMask | None, ids: list[int], start: int) -> list[list[int]] | None:
    if mask is None:
        return None
    counts = np.asarray(mask.counts)
    ends = np.cumsum(counts)
    flat = np.asarray(mask.ids)
    return [
        [int(x) for x in flat[e - c : e]] if c else [ids[k]]
        for k, (c, e) in enumerate(zip(counts.tolist(), ends.tolist()))
        if k >= start
    ]


def episode_samples(episode: vf.Episode, tokenizer: Any, index: int = 0) -> list[Sample]:
    """nonstop samples of a verifiers episode: one per trainable trace and branch (module docstring)."""
    span = episode.run.work.policy if episode.run is not None and episode.run.type == "train" else None
    out = []
    for trace in episode.traces:
        if not trace.agent.trainable:
            continue
        node_index = {id(n): i for i, n in enumerate(trace.nodes)}
        recorded = trace.info.get(VERSIONS_KEY, {})
        for branch in trace.branches:
            ids, mask = branch.token_ids, branch.sampled_mask
            if not branch.trainable or not any(mask):
                continue
            versions: list[int] = []
            for node in branch.nodes:
                sampled = sum(node.mask)
                got = recorded.get(str(node_index[id(node)]))
                if sampled and got is None and span is None:
                    raise ValueError(
                        f"episode {episode.id}: no policy version for its sampled tokens (neither "
                        f"trace.info[{VERSIONS_KEY!r}] nor run.work.policy)"
                    )
                own = iter(got if got is not None and len(got) == sampled else [span.start if span else 0] * sampled)
                versions += [next(own) if m else ENV_VERSION for m in node.mask]
            start = mask.index(True)
            out.append(
                Sample(
                    prompt_ids=ids[:start],
                    completion_ids=ids[start:],
                    logprobs=branch.logprobs[start:],
                    versions=versions[start:],
                    finish_reason="length" if trace.is_truncated else "stop",
                    loss_mask=mask[start:],
                    sampling_mask=_kept(branch.sampling_mask, ids, start),
                    reward=trace.reward,
                    text=tokenizer.decode(ids[start:], skip_special_tokens=True),
                    role=trace.agent.name,
                    episode=index,
                )
            )
    return out


def episode_result(episode: vf.Episode, tokenizer: Any, index: int, solved_at: float = 1.0) -> EpisodeResult:
    samples = episode_samples(episode, tokenizer, index)
    trace = episode.traces[0]
    return EpisodeResult(
        samples,
        {"success": trace.reward >= solved_at, "stop": trace.stop_condition, "verifiers_episode": episode.id},
        trace.num_turns,
        trace.is_truncated,
    )


PREFIX = "verifiers/"
RETRY = "Wrong, try again. "
"""The user message after a turn that did not solve the task (with env.max_turns above 1)."""
MODEL = "nonstop"


def _factory(name: str) -> Any:
    module_name, sep, attr = name.removeprefix(PREFIX).partition(":")
    if not sep:
        raise ConfigError(
            f"env.name: {name!r}: expected 'verifiers/package.module:factory' (a callable returning a "
            "verifiers.v1 Taskset or a list of its Tasks)"
        )
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"env.name: cannot import {name.removeprefix(PREFIX)!r}: {e}") from None


@functools.cache
def taskset(name: str) -> Any:
    """What `env.name`'s factory returns: a verifiers `Taskset`, or a list of its `Task`s."""
    return _factory(name)()


def has_tools(name: str) -> bool:
    """Whether the taskset or its task type declares tool servers (`toolsets`)."""
    tasks = taskset(name)
    if not isinstance(tasks, vf.Taskset):
        return False
    return bool(tasks.toolsets(tasks.config)) or bool(type(tasks).task_type().toolsets(tasks.config.task))


@functools.cache
def taskset_tasks(name: str, train_rows: int, eval_rows: int) -> tuple[list[vf.Task], list[vf.Task]]:
    """Train and held-out tasks: the taskset's first tasks train, the next ones are held out."""
    tasks = taskset(name)
    if isinstance(tasks, vf.Taskset):
        tasks = tasks.take(train_rows + eval_rows) if tasks.INFINITE else tasks
    tasks = list(itertools.islice(tasks, train_rows + eval_rows))
    if len(tasks) < 2 or not all(isinstance(t, vf.Task) for t in tasks):
        raise ConfigError(f"env.name: {name!r} gave {len(tasks)} items; it needs at least 2 verifiers.v1 Tasks")
    held = min(eval_rows, max(1, len(tasks) - train_rows), len(tasks) // 2)
    return tasks[: len(tasks) - held], tasks[len(tasks) - held :]


def task_rows(tasks: list[vf.Task], offset: int) -> list[Example]:
    """Rows for the prompt ledger; `answer` is the task's position (how the player finds it)."""
    return [Example(i, t.data.prompt_text, str(offset + i)) for i, t in enumerate(tasks)]


class VerifiersPlayer:
    """Plays the rows of a run (an `EnvRun` player) as verifiers episodes on the run's engines, through
    `EngineTransport` (no socket), and hands them back as nonstop `EpisodeResult`s."""

    def __init__(
        self, tasks: list[vf.Task], renderer_model: str | None, retry: str = RETRY, solved_at: float = 1.0
    ) -> None:
        self.tasks, self.renderer_model = tasks, renderer_model
        self.retry, self.solved_at = retry, solved_at
        self.clients: dict[int, tuple[TrainClient, VersionLog]] = {}
        self.played = 0

    def _client(self, engine: TurnEngine) -> tuple[TrainClient, VersionLog]:
        if self.renderer_model is None:
            raise ConfigError(
                "env.name: a verifiers taskset needs the model folder whose tokenizer renders its prompts"
            )
        if id(engine) not in self.clients:
            self.clients[id(engine)] = train_client(
                "http://nonstop.invalid/v1", self.renderer_model, EngineTransport(engine, MODEL)
            )
        return self.clients[id(engine)]

    async def __call__(
        self, engine: TurnEngine, rows: list[Example], codec: Any, limits: EnvLimits, params: SamplingParams
    ) -> tuple[list[EpisodeResult], Counter[str]]:
        client, log = self._client(engine)
        sampling = vf.SamplingConfig(
            temperature=params.temperature,
            top_p=params.top_p,
            max_tokens=params.max_new_tokens,
            **({"top_k": params.top_k} if params.top_k else {}),
            **({"min_p": params.min_p} if params.min_p else {}),
        )
        episodes = await asyncio.gather(
            *(
                play_episode(
                    client,
                    log,
                    self.tasks[int(r.answer)],
                    MODEL,
                    sampling,
                    limits.max_turns,
                    self.retry,
                    self.solved_at,
                    max_episode_tokens=limits.max_episode_tokens,
                    tokenizer=codec.tokenizer,
                )
                for r in rows
            ),
            return_exceptions=True,
        )
        done, errors = [], Counter[str]()
        for i, e in enumerate(episodes):
            if isinstance(e, BaseException):
                if not isinstance(e, Exception):
                    raise e
                errors["env_raised"] += 1
                continue
            done.append(episode_result(e, codec.tokenizer, i, self.solved_at))
        self.played += len(rows)
        return done, errors


def task_data(cfg: EnvConfig) -> TaskData:
    """The rows of `env.name: verifiers/<module:factory>` (train and held-out tasks)."""
    train, held = taskset_tasks(cfg.name, cfg.train_rows, cfg.eval_rows)
    return TaskData(task_rows(train, 0), task_rows(held, len(train)), DatasetReport(rows_read=len(train) + len(held)))


def player(cfg: EnvConfig, renderer_model: str | None) -> Any:
    """The player of `env.verifiers_rollout`: nonstop's chat loop (`VerifiersPlayer`), or verifiers'
    own `Agent.run` (envs/verifiers/agent.py `AgentPlayer`), which a taskset with tools needs."""
    train, held = taskset_tasks(cfg.name, cfg.train_rows, cfg.eval_rows)
    if cfg.verifiers_rollout == "agent":
        # cycle: verifiers/agent.py builds on this module (its episode result, model name, versions key)
        from nonstop.envs.verifiers.agent import AgentPlayer

        return AgentPlayer(train + held, renderer_model, taskset(cfg.name))
    if has_tools(cfg.name):
        raise ConfigError(
            f"env.verifiers_rollout: {cfg.name!r} declares tools, which nonstop's chat loop does not "
            "call; set env.verifiers_rollout: agent (verifiers' own rollout, its tools over MCP)"
        )
    return VerifiersPlayer(train + held, renderer_model)


def demo(cfg: EnvConfig) -> Any:
    """The taskset's weak player for the warm-up (models/env_warmup.py), when it defines `demo(task, rng,
    max_turns)` returning an episode's (text, written by the model) pieces; else None."""
    made = taskset(cfg.name)
    own = getattr(made, "demo", None)
    if not callable(own):
        return None
    train, held = taskset_tasks(cfg.name, cfg.train_rows, cfg.eval_rows)
    tasks = train + held
    return lambda row, rng, max_turns: own(tasks[int(row.answer)], rng, max_turns)
