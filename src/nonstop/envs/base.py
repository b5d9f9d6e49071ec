"""The environment seam: what an episode's world must offer the pipeline.

An environment turns a task row into an episode: `reset(row)` gives the first observation (the
prompt text), `step(action)` takes the text of one model turn and answers with the next
observation, an optional reward, whether the episode is done, and metadata (e.g. `success`).
Both are `async`, so an environment may wait on a tool, a subprocess or a server; the episode
runner (orchestrator/episodes.py) bounds every call by `EnvLimits.step_timeout_s`.

Two shapes, one runner:
- `Environment`: one agent (guess-the-number, a tool task). Its observations are appended to
  the agent's token sequence as environment tokens (loss mask 0).
- `MultiAgentEnvironment`: several roles taking turns (self-play Nim). `reset` and `step` say
  which role acts next and what each role observes; each role keeps its own token sequence, and
  the other roles' moves reach it only as observations. `SingleAgent` wraps an `Environment` as
  a multi-agent one with the role "agent", so the runner has a single token-exact path.

Tools are callables the environment exposes by name (`tools`): a tool takes its argument text
and returns the result text; `call_tool` runs one (sync or async) with a timeout and turns its
failure into an error observation for the model, counted in `ToolStats`, never a crash.

Invariants: observations are text appended after everything the episode already holds (earlier
turns are never re-encoded); a `done` step ends the episode, and its rewards are final; rewards
of a role are summed over its steps.

What an episode is played on and what it gives back, shared by every player (nonstop's runner,
the verifiers adapter): a `TurnEngine` completes token prefixes (the run's engines, or one
engine per role), and an `EpisodeResult` holds one `Sample` per role, environment tokens
tagged with `ENV_VERSION`.
"""

from __future__ import annotations

import asyncio
import inspect
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from nonstop.errors import NonstopError
from nonstop.tasks.data import Example
from nonstop.token_trace import ENV_VERSION as ENV_VERSION  # environments tag their tokens with it
from nonstop.types import GenerationRequest, Sample

Tool = Callable[[str], "str | Awaitable[str]"]
"""A tool the environment exposes: argument text in, result text out (sync or async)."""


class TurnEngine(Protocol):
    """What an episode needs of an engine: complete token prefixes (EngineClient, AsyncEngine)."""

    async def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]: ...


@dataclass
class EpisodeResult:
    """One finished episode, as the producer counts and trains it."""

    samples: list[Sample]  # one per role, in the environment's role order
    metadata: dict[str, Any]  # the environment's metadata of the last step
    turns: int
    truncated: bool  # cut by max_turns or max_episode_tokens

    @property
    def success(self) -> bool:
        """The environment's `success` flag, else whether the first role's reward is positive."""
        flag = self.metadata.get("success")
        return bool(flag) if flag is not None else self.samples[0].reward > 0

    @property
    def versions(self) -> set[int]:
        """The policy versions of the episode's model tokens."""
        return {v for s in self.samples for v, m in zip(s.versions, s.loss_mask) if m}


class EnvError(NonstopError, RuntimeError):
    """An environment could not go on with an episode (bad state, a failing backend)."""


@dataclass(frozen=True, slots=True)
class EnvLimits:
    """Bounds of one episode, enforced by the runner whatever the environment does."""

    max_turns: int
    """Model turns per role; an episode that reaches it ends (truncated) with the rewards so far."""
    max_episode_tokens: int
    """Tokens of one role's sequence, prompt included; a turn never samples past it."""
    turn_max_tokens: int
    """Tokens the model may write in one turn (a turn also ends at EOS or a stop string)."""
    step_timeout_s: float
    """Wall-clock bound of one reset/step call of the environment."""


@dataclass(slots=True)
class Step:
    """What an environment answers to one action."""

    observation: str = ""
    """Text appended to the episode after the action (as environment tokens); '' appends nothing."""
    reward: float | None = None
    done: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)


class Environment(Protocol):
    """One agent: reset from a task row, then one step per model turn."""

    @property
    def tools(self) -> Mapping[str, Tool]:
        """The tools this environment offers by name (may be empty)."""
        ...

    async def reset(self, row: Example) -> str:
        """The first observation: the episode's prompt text."""
        ...

    async def step(self, action: str) -> Step:
        """React to the text of one model turn."""
        ...


@dataclass(slots=True)
class Turn:
    """A multi-agent environment's answer: what each role observes now, who acts next."""

    observations: dict[str, str]
    """Text to append to each role's sequence (roles not named observe nothing)."""
    next_role: str | None
    """The role that writes the next turn; None when the episode is done."""
    rewards: dict[str, float] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.next_role is None


class MultiAgentEnvironment(Protocol):
    """Several roles in one episode, taking turns; each role's first observation is its prompt."""

    @property
    def roles(self) -> tuple[str, ...]: ...

    @property
    def tools(self) -> Mapping[str, Tool]: ...

    async def reset(self, row: Example) -> Turn:
        """Every role's first observation (non-empty: it is that role's prompt) and the first actor."""
        ...

    async def step(self, role: str, action: str) -> Turn:
        """React to `role`'s turn."""
        ...


class SingleAgent:
    """An `Environment` as a multi-agent environment with one role, 'agent'."""

    roles: tuple[str, ...] = ("agent",)

    def __init__(self, env: Environment) -> None:
        self.env = env
        self.tools = env.tools

    async def reset(self, row: Example) -> Turn:
        return Turn({"agent": await self.env.reset(row)}, "agent")

    async def step(self, role: str, action: str) -> Turn:
        s = await self.env.step(action)
        rewards = {"agent": s.reward} if s.reward is not None else {}
        return Turn({"agent": s.observation}, None if s.done else "agent", rewards, s.metadata)


@dataclass
class ToolStats:
    """Tool calls by tool name and outcome (ok, raised, timeout)."""

    calls: Counter[str] = field(default_factory=Counter)


async def call_tool(
    tools: Mapping[str, Tool], name: str, argument: str, timeout_s: float, stats: ToolStats | None = None
) -> str:
    """The tool's result text, or an error text the model sees ('error: ...'); counted by outcome."""
    tool = tools.get(name)
    if tool is None:
        outcome, text = "unknown", f"error: no tool {name!r}"
    else:
        try:
            result = tool(argument)
            if inspect.isawaitable(result):
                result = await asyncio.wait_for(result, timeout_s)
            outcome, text = "ok", str(result)
        except TimeoutError:
            outcome, text = "timeout", "error: timeout"
        except Exception as e:  # a tool is user code: its failure is an observation, not a crash
            outcome, text = "raised", f"error: {type(e).__name__}"
    if stats is not None:
        stats.calls[f"{name}:{outcome}"] += 1
    return text
