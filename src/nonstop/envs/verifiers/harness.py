"""verifiers' `null` harness program, run in process: its chat loop, its tool calls over MCP.

verifiers 0.4.0's `null` harness (the tool-calling chat loop, `harnesses/null`) launches a program
with `uv run --script`: the text `CHAT_PROGRAM_SOURCE`, which bundles three of verifiers' own
modules (`harnesses/utils/{mcp,compaction,core}.py`) behind a PEP 723 header naming their
dependencies (openai, mcp, httpx, httpx2, tenacity, certifi). uv downloads those at run time,
which nonstop does not do, and a process per episode costs more CPU than a tiny model's whole
episode. `Harness.launch`'s contract allows a loop in process instead of a program, "as long as
every model call goes through `endpoint` + `secret`", returning a synthetic `ProgramResult`.

`InProcessChatHarness` is that: the same program text, compiled once into a module of its own
(`chat_program()`), and driven here the way its `main()` drives it (`run_chat`): an OpenAI client
on the rollout's interception endpoint with the rollout's secret, the rollout's MCP tool servers
connected (`connect_mcp`), compaction off (a tiny model has nothing to compact), then
`run_chat_loop` until a reply without tool calls. So every model call, tool call and message is
made by verifiers' own code; what differs from `null` is where the loop runs (this process,
beside the training run's engines), that nothing is installed, and one thing a process per
episode cannot do: a tool server whose URL carries no per-rollout state (a stateless
taskset-scoped server) keeps its MCP connection (`MCPConnection`, with its tool list) across
episodes, as a long-lived agent would, instead of a new one per episode (each new MCP HTTP client
builds a TLS context, ~33 ms of CPU here, more than a tiny model's whole episode). The
dependencies are those of the verifiers extra (`pip install 'nonstop[verifiers]'`).

Where the program would exit (`SystemExit(97)` on a lost model connection), the harness returns
the same exit code as a `ProgramResult`, so verifiers classifies the failure as it would for the
program (`InterceptionError`).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import types
from contextlib import AsyncExitStack
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
from openai import AsyncOpenAI
from verifiers.v1.clients import ModelContext
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harnesses.null.harness import NullHarness
from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
from verifiers.v1.runtimes import ProgramResult, Runtime
from verifiers.v1.task import TaskData
from verifiers.v1.trace import Trace

MCP_CONNECT_TIMEOUT_S = 60.0
"""How long connecting to the tool servers may take (the program's own bound without bash)."""


@functools.cache
def chat_program() -> types.ModuleType:
    """`CHAT_PROGRAM_SOURCE` compiled as a module (not as `__main__`, so its entry point stays idle)."""
    module = types.ModuleType("verifiers_chat_program")
    exec(compile(CHAT_PROGRAM_SOURCE, "<verifiers null harness chat program>", "exec"), module.__dict__)
    return module


def program_args(
    endpoint: str, secret: str, model: str, system_prompt: str | None, tool_interception_url: str | None
) -> argparse.Namespace:
    """The arguments `null` would pass its program (launch_chat_program): no bash, edit, search or compaction."""
    return argparse.Namespace(
        base_url=endpoint,
        api_key=secret,
        model=model,
        system_prompt=system_prompt or "",
        tool_interception_url=tool_interception_url or "",
        bash=False,
        edit=False,
        search=False,
        serper_key="",
        compaction=False,
        summarize_at_tokens=None,
    )


Tools = tuple[list[dict], dict, dict]
"""What the program's `connect_mcp` gives: tool schemas, dispatch map, connections by server."""


def per_rollout(url: str) -> bool:
    """Whether a tool server URL carries one rollout's state coordinates (verifiers signs them
    into the query of a stateful shared server's URL), so its connection serves that rollout only."""
    return any(k.startswith("vf_state") for k in parse_qs(urlsplit(url).query))


class ToolConnections:
    """MCP connections kept across episodes for tool servers without per-rollout state."""

    def __init__(self) -> None:
        self.stack = AsyncExitStack()
        self.kept: dict[tuple, asyncio.Task[Tools]] = {}

    async def connect(self, mcp_urls: dict[str, str], tool_timeout_s: float, stack: AsyncExitStack) -> Tools:
        """The program's `connect_mcp` on these servers: once for all episodes when none of the
        URLs is per rollout, else for this episode (closed with `stack`)."""
        config = {"mcpServers": {name: {"url": url, "timeout": tool_timeout_s} for name, url in mcp_urls.items()}}
        connect = chat_program().connect_mcp
        if any(per_rollout(u) for u in mcp_urls.values()):
            return await asyncio.wait_for(connect(config, stack, set()), timeout=MCP_CONNECT_TIMEOUT_S)
        key = tuple(sorted(mcp_urls.items()))
        if key not in self.kept or (self.kept[key].done() and self.kept[key].exception() is not None):
            self.kept[key] = asyncio.ensure_future(
                asyncio.wait_for(connect(config, self.stack, set()), timeout=MCP_CONNECT_TIMEOUT_S)
            )
        return await asyncio.shield(self.kept[key])

    async def aclose(self) -> None:
        for kept in self.kept.values():
            kept.cancel()
        self.kept.clear()
        await self.stack.aclose()


async def run_chat(
    args: argparse.Namespace,
    prompt: str | list[dict] | None,
    mcp_urls: dict[str, str],
    tool_timeout_s: float,
    http: httpx.AsyncClient,
    connections: ToolConnections,
) -> None:
    """The program's `main()`, in process: one chat on `prompt` (text, or wire messages), its
    tools from the MCP servers at `mcp_urls`, every model call to `args.base_url`."""
    program = chat_program()
    client = AsyncOpenAI(base_url=args.base_url, api_key=args.api_key, http_client=http, max_retries=2)
    async with AsyncExitStack() as stack:
        tool_client = None
        if args.tool_interception_url:
            tool_client = await stack.enter_async_context(httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0)))
        tools: list[dict] = []
        dispatch: dict = {}
        servers: dict = {}
        if mcp_urls:
            tools, dispatch, servers = await connections.connect(mcp_urls, tool_timeout_s, stack)
        messages: list[dict[str, Any]] = (
            [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
        )
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt:
            messages.extend(prompt)
        compactor = program.Compactor(client, args.model, tools, False, None)
        compactor.note_good(messages)
        await program.run_chat_loop(args, compactor, messages, dispatch, servers, tool_client)


class InProcessChatHarness(NullHarness):
    """verifiers' `null` harness with its chat program run in process (module docstring).

    `http` is the HTTP client its model calls share and `connections` the MCP connections kept
    across episodes (both the owner's to close), instead of new ones per episode as a program makes."""

    def __init__(self, config: Any, http: httpx.AsyncClient, connections: ToolConnections) -> None:
        super().__init__(config)
        self.http, self.connections = http, connections
        self.launches = 0

    async def setup(self, runtime: Runtime) -> None:
        """Nothing to install: the program's dependencies are this process's."""

    async def launch(
        self,
        ctx: ModelContext,
        trace: Trace,
        runtime: Runtime,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: TaskData,
        tool_interception_url: str | None = None,
    ) -> ProgramResult:
        system_prompt, prompt = self.resolve_prompt(data)
        wire = prompt if isinstance(prompt, str) or prompt is None else [message_to_wire(m) for m in prompt]
        args = program_args(endpoint, secret, ctx.model, system_prompt, tool_interception_url)
        self.launches += 1
        try:
            await run_chat(args, wire, mcp_urls, self.config.tool_timeout, self.http, self.connections)
        except SystemExit as e:  # the program's exit on a lost model connection: its exit code, as a result
            code = e.code if isinstance(e.code, int) else 1
            return ProgramResult(exit_code=code, stdout="", stderr=f"chat program exited {code}: {e.__context__!r}")
        return ProgramResult(exit_code=0, stdout="", stderr="")
