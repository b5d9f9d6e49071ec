"""verifiers' own rollout on nonstop's engines: `Agent.run(task)` per episode, tools included.

With `env.verifiers_rollout: agent`, each episode of a verifiers taskset is played by verifiers
0.4.0's own code path, the one `vf-eval` and prime-rl run:

- `vf.Agent.run(task)` -> `Rollout`: task setup, the rollout's interception server on 127.0.0.1
  (an aiohttp server: every model call of the harness goes through it, is checked against the
  agent's limits and `@vf.stop` hooks, and is committed into the trace's message graph), the
  taskset's tool servers (MCP, `Taskset.toolsets`), the harness, `Task.finalize`, then the task's
  `@vf.reward`/`@vf.metric` scoring;
- the harness is verifiers' `null` chat program run in process (envs/verifiers/harness.py): it
  lists the tools over MCP, calls the model through the interception endpoint, runs each tool call
  the model makes against its MCP server, and loops until a reply without a tool call;
- the interception's model client is verifiers' `TrainClient`, as in a training run: it renders the
  chat to ids with `TokenRenderer` (bridging from the previous turn's ids, so each turn continues
  the exact ids sampled), POSTs `/inference/v1/generate`, and parses the reply, tool calls
  included (envs/tool_calls.py). Here the POST reaches the run's engines in process
  (`EngineTransport`, no socket).

What nonstop provides around it: one interception server per player (verifiers' "inject a live
`Interception` to share servers across agents"), with this client registered for the agent's
client config; one runtime "box" for all episodes, verifiers' subprocess runtime in a temp folder
(a borrowed runtime: `Agent.run(runtime=box)`), which runs the taskset-scoped tool servers as
`python -m <toolset module>` processes, started once per player as verifiers' `serve_shared`
would; and the per-token policy versions, which verifiers' trace has no field for: the client
keeps each answer's versions under its exact token sequence (prompt + completion), and after the
rollout every sampled node of the graph finds its own by its path's ids (node ids concatenated
from the root are that call's prompt + completion, an invariant of verifiers' graph).

Out of scope: harness programs that install their dependencies at run time (`uv run --script`:
`null` and `bash` as verifiers launches them, the container harnesses), runtimes other than the
subprocess one, task-scoped toolsets (`Task.toolsets`: verifiers starts a server per episode in
its own cache folder; use taskset-scoped ones). The episode's trace becomes nonstop samples as in
envs/verifiers/env.py (`episode_result`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import tempfile
import weakref
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import verifiers.v1 as vf
from openai import AsyncOpenAI
from verifiers.v1.clients import TrainClient
from verifiers.v1.episode import EnvInfo, TrainRunInfo, TrainWorkInfo
from verifiers.v1.harnesses.null.harness import NullHarnessConfig
from verifiers.v1.interception import InterceptionServer
from verifiers.v1.mcp import SharedToolServer
from verifiers.v1.mcp.launch import serve_in_runtime
from verifiers.v1.runtimes import SubprocessConfig, SubprocessRuntime
from verifiers.v1.state import State

from nonstop.config import ConfigError
from nonstop.envs.base import EnvLimits, EpisodeResult, TurnEngine
from nonstop.envs.verifiers.client import EngineTransport, VersionLog
from nonstop.envs.verifiers.env import MODEL, VERSIONS_KEY, episode_result
from nonstop.envs.verifiers.harness import InProcessChatHarness, ToolConnections
from nonstop.envs.verifiers.renderer import renderer_config
from nonstop.tasks.data import Example
from nonstop.types import SamplingParams

BASE_URL = "http://nonstop.invalid/v1"
"""The engines' address as the client knows it: answered in process, never resolved."""


class Box(SubprocessRuntime):
    """verifiers' subprocess runtime in a folder nonstop chose (not verifiers' ~/.cache)."""

    def __init__(self, root: Path) -> None:
        super().__init__(SubprocessConfig(), name="nonstop-verifiers")
        self.root = root

    async def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.workdir = self.root
        self.info.id = str(self.root)
        # Its processes run in this folder: a relative PYTHONPATH entry (PYTHONPATH=src) would no
        # longer find the modules this process imports, a tool server's module among them.
        paths = os.environ.get("PYTHONPATH")
        if paths:
            self.env = {"PYTHONPATH": os.pathsep.join(os.path.abspath(p) for p in paths.split(os.pathsep) if p)}


class VersionedTrainClient(TrainClient):
    """verifiers' train client, keeping each answer's per-token policy versions by trace and by
    the answer's whole token sequence (prompt + completion)."""

    def __init__(self, config: vf.TrainClientConfig, log: VersionLog) -> None:
        super().__init__(config)
        self.log = log
        self.by_trace: dict[str, dict[tuple[int, ...], list[int]]] = {}

    async def get_response(self, dialect, body, sampling, session_id=None, turn=None, headers=None):
        response = await super().get_response(dialect, body, sampling, session_id, turn, headers)
        versions = self.log.pop(response.id)
        if turn is not None and versions is not None and response.tokens is not None:
            path = tuple(response.tokens.prompt_ids) + tuple(response.tokens.completion_ids)
            self.by_trace.setdefault(turn.trace.id, {})[path] = versions
        return response

    def node_versions(self, trace: vf.Trace) -> dict[str, list[int]]:
        """Sampled node index (as text) -> its tokens' versions, by each node's path of ids."""
        recorded = self.by_trace.pop(trace.id, {})
        out: dict[str, list[int]] = {}
        for i, node in enumerate(trace.nodes):
            if not node.sampled:
                continue
            path: list[int] = []
            at: int | None = i
            while at is not None:
                path[:0] = trace.nodes[at].token_ids
                at = trace.nodes[at].parent
            got = recorded.get(tuple(path))
            if got is not None:
                out[str(i)] = got
        return out


class AgentPlayer:
    """Plays the rows of a run (an `EnvRun` player) through verifiers' `Agent.run` (module docstring).
    Its servers start on first use and stop in `aclose`."""

    def __init__(self, tasks: list[vf.Task], renderer_model: str | None, taskset: Any, solved_at: float = 1.0) -> None:
        self.tasks, self.renderer_model, self.taskset, self.solved_at = tasks, renderer_model, taskset, solved_at
        self.played = 0
        self.failures: Counter[str] = Counter()
        """Failed episodes by verifiers' error type (each also counted as `env_raised`)."""
        self.last_failure = ""
        self._clients: dict[tuple[int, EnvLimits], tuple[vf.TrainClientConfig, VersionedTrainClient]] = {}
        self._agents: dict[tuple, vf.Agent] = {}
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))
        self._connections = ToolConnections()
        self._lock = asyncio.Lock()
        self._stack: contextlib.AsyncExitStack | None = None
        self._server: InterceptionServer | None = None
        self._box: Box | None = None
        self._tools: dict[str, SharedToolServer] = {}
        self._root = Path(tempfile.mkdtemp(prefix="nonstop-verifiers-"))
        self._finalizer = weakref.finalize(self, _remove, self._root)

    async def _start(self) -> None:
        stack = contextlib.AsyncExitStack()
        self._box = Box(self._root / "box")
        await self._box.start()
        stack.push_async_callback(self._box.stop)
        toolsets = list(self.taskset.toolsets(self.taskset.config)) if self.taskset is not None else []
        secrets_by_name: dict[str, str] = {}
        for toolset in toolsets:  # as verifiers' serve_shared: one server per toolset for all episodes
            secret = secrets.token_urlsafe(24) if toolset._state_cls is not State else ""
            port = await serve_in_runtime(toolset, self._box, exposed=False, state_secret=secret)
            self._tools[toolset.server_name] = SharedToolServer(
                url=f"http://127.0.0.1:{port}/mcp", local=True, runtime=self._box, state_secret=secret
            )
            secrets_by_name[toolset.server_name] = secret
        self._server = InterceptionServer(state_service_secrets=tuple(s for s in secrets_by_name.values() if s))
        await stack.enter_async_context(self._server)
        self._stack = stack

    def _client(self, engine: TurnEngine, limits: EnvLimits) -> tuple[vf.TrainClientConfig, VersionedTrainClient]:
        """The interception's model client for `engine`: verifiers' train client over `EngineTransport`,
        within the episode's token budget (`limits.max_episode_tokens`)."""
        assert self._server is not None
        if self.renderer_model is None:
            raise ConfigError(
                "env.name: a verifiers taskset needs the model folder whose tokenizer renders its prompts"
            )
        if (id(engine), limits) not in self._clients:
            config = vf.TrainClientConfig(
                base_url=BASE_URL,
                api_key_var="NONSTOP_API_KEY",
                renderer=renderer_config(),
                renderer_model_name=self.renderer_model,
                headers={"X-Nonstop-Client": str(len(self._clients))},  # a config of its own per engine and budget
            )
            log = VersionLog()
            client = VersionedTrainClient(config, log)
            client.client = AsyncOpenAI(
                base_url=BASE_URL,
                api_key="EMPTY",
                max_retries=0,
                http_client=httpx.AsyncClient(
                    transport=EngineTransport(engine, MODEL, limits.max_episode_tokens, clamp=True),
                    event_hooks={"response": [log]},
                ),
            )
            self._server.clients[config.model_dump_json()] = client  # the interception's client for this config
            self._clients[id(engine), limits] = (config, client)
        return self._clients[id(engine), limits]

    def _agent(
        self, engine: TurnEngine, limits: EnvLimits, params: SamplingParams
    ) -> tuple[vf.Agent, VersionedTrainClient]:
        """verifiers' agent for `engine` and these sampling settings: the `null` harness (its program
        in process), the subprocess runtime, the run's limits."""
        config, client = self._client(engine, limits)
        key = (id(engine), limits, repr(params))
        if key not in self._agents:
            agent = vf.Agent(
                vf.AgentConfig(
                    harness=NullHarnessConfig(id="null"),
                    runtime=SubprocessConfig(),
                    model=MODEL,
                    client=config,
                    sampling=_sampling(params),
                    max_turns=limits.max_turns,  # the token budget is the transport's (`_client`)
                ),
                interception=self._server,
            )
            agent.harness = InProcessChatHarness(agent.harness.config, self._http, self._connections)
            self._agents[key] = agent
        return self._agents[key], client

    async def _episode(
        self, agent: vf.Agent, client: VersionedTrainClient, task: vf.Task, index: int, tokenizer: Any
    ) -> EpisodeResult | str:
        assert self._box is not None
        minted: list[str] = []
        try:
            trace = await agent.run(task, runtime=self._box, tools=self._tools, on_trace=lambda t: minted.append(t.id))
            trace.info[VERSIONS_KEY] = client.node_versions(trace)
        finally:  # what the client kept for a trace that raised, or one a retry replaced, goes too
            for trace_id in minted:
                client.by_trace.pop(trace_id, None)
        if not trace.ok:
            error = trace.errors[-1] if trace.errors else None
            kind = error.type if error is not None else "not_ok"
            self.failures[kind] += 1
            self.last_failure = f"{kind}: {error.message if error is not None else ''}"
            return kind
        spent = [v for vs in trace.info[VERSIONS_KEY].values() for v in vs]
        span = vf.PolicySpan(start=min(spent), end=max(spent)) if spent else None
        episode = vf.Episode(
            env=EnvInfo(id="nonstop"),
            task=trace.task,
            traces=[trace],
            ok=True,
            run=TrainRunInfo(id="nonstop", work=TrainWorkInfo(step=0, policy=span)),
        )
        result = episode_result(episode, tokenizer, index, self.solved_at)
        # A turn refused for want of room in the episode's token budget ended the chat (the program
        # reads it as its context being used up): a truncated episode, as nonstop's own runner says.
        result.truncated = result.truncated or any(
            c.error is not None and "maximum context length" in c.error.message for c in trace.calls
        )
        return result

    async def __call__(
        self, engine: TurnEngine, rows: list[Example], codec: Any, limits: EnvLimits, params: SamplingParams
    ) -> tuple[list[EpisodeResult], Counter[str]]:
        async with self._lock:
            if self._stack is None:
                await self._start()
            agent, client = self._agent(engine, limits, params)
        outcomes = await asyncio.gather(
            *(self._episode(agent, client, self.tasks[int(r.answer)], i, codec.tokenizer) for i, r in enumerate(rows)),
            return_exceptions=True,
        )
        done, errors = [], Counter[str]()
        for o in outcomes:
            if isinstance(o, EpisodeResult):
                done.append(o)
            elif isinstance(o, BaseException) and not isinstance(o, Exception):
                raise o
            else:
                errors["env_raised"] += 1  # a failed trace (its error type counted in `failures`) or a raise
                if isinstance(o, Exception):
                    self.failures[type(o).__name__] += 1
                    self.last_failure = f"{type(o).__name__}: {o}"
        self.played += len(rows)
        return done, errors

    async def aclose(self) -> None:
        await self._connections.aclose()
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()
        for _, client in self._clients.values():
            await client.client.close()
        self._clients.clear()
        self._agents.clear()
        await self._http.aclose()
        self._finalizer()


def _remove(root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)


def _sampling(params: SamplingParams) -> vf.SamplingConfig:
    return vf.SamplingConfig(
        temperature=params.temperature,
        top_p=params.top_p,
        max_tokens=params.max_new_tokens,
        **({"top_k": params.top_k} if params.top_k else {}),
        **({"min_p": params.min_p} if params.min_p else {}),
    )
