"""Episodes: multi-turn, multi-agent rollouts through the engines, token-exact.

`run_episode(engine, env, row, ...)` plays one episode of a `MultiAgentEnvironment` (a
single-agent `Environment` comes wrapped in `envs.base.SingleAgent`). Each role keeps one token
sequence: its prompt (its first observation) and then, in order, what the engine sampled for it
and what the environment appended. A model turn is one engine request whose prompt is the
role's whole sequence so far, as token ids: the engine continues that sequence and earlier turns
are never decoded and encoded again. Only the new observation text is encoded, without special
tokens, and appended.

Per completion token of a role's `Sample` (prompt = the role's first observation):
- model tokens: loss mask True, the engine's behaviour logprob and policy_version (so one
  episode may span several versions), its Keep Sampling Mask entry when sampling truncated;
- environment tokens: loss mask False, logprob 0.0, version -1 (no policy wrote them; the
  buffer's and the trainer's lag rules look at model tokens only), kept set = the token itself.
So `prompt_ids + completion_ids` is exactly the concatenation of the engine's samples and the
environment's appends, and the mask flips exactly at every boundary (tests/envs/test_episodes.py).
With separate policies per role (env.policies), `engine` is a `RoleEngines`: each role's turns
go to its own policy's engines and its Sample carries `policy` (modes/own_policies/policies.py).

Limits (`EnvLimits`): a role's turns stop at `max_turns` and its sequence at
`max_episode_tokens` (the episode then ends truncated with the rewards it had); every reset and
step is bounded by `step_timeout_s`. An environment that raises or times out fails its episode
with `EpisodeError(kind)`; the producer (episode_flow.py) drops the episode's group, counted by
kind and settled in the ledger, and the run goes on. What an episode plays on (`TurnEngine`) and
gives back (`EpisodeResult`) is the environments' seam (envs/base.py), shared with the verifiers
adapter.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from nonstop.envs.base import EnvLimits, EpisodeResult, MultiAgentEnvironment, Turn, TurnEngine
from nonstop.errors import RunError
from nonstop.tasks.codec import Codec
from nonstop.tasks.data import Example
from nonstop.token_trace import TokenTrace
from nonstop.types import GenerationRequest, Sample, SamplingParams


@dataclass(frozen=True)
class RoleEngines:
    """A TurnEngine per role (env.policies): a role named in `own` plays its own policy's engines,
    and its samples carry `policy=role`; every other role plays `shared` (policy ''). Used as a
    TurnEngine itself it is the shared policy (evaluation plays that one)."""

    shared: TurnEngine
    own: Mapping[str, TurnEngine] = field(default_factory=dict)

    def engine(self, role: str) -> TurnEngine:
        return self.own.get(role, self.shared)

    def policy(self, role: str) -> str:
        return role if role in self.own else ""

    async def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        return await self.shared.generate(requests)


class EpisodeError(RunError, RuntimeError):
    """The environment failed an episode; `kind` is 'env_raised' or 'env_timeout'."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class Track(TokenTrace):
    """One role's token sequence and per-token metadata, grown turn by turn."""

    role: str = ""
    reward: float = 0.0

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.ids)

    def to_sample(self, episode: int, truncated: bool, codec: Codec, policy: str = "") -> Sample:
        return self.sample(
            reward=self.reward,
            text=codec.decode(self.ids),
            finish_reason="length" if truncated else "stop",
            role=self.role,
            episode=episode,
            policy=policy,
        )


_request_ids = itertools.count(1 << 40)  # apart from the prompt indices single-turn requests use


async def _env_call(call, timeout_s: float, what: str) -> Turn:
    try:
        return await asyncio.wait_for(call, timeout_s)
    except TimeoutError:
        raise EpisodeError(
            "env_timeout", f"environment {what} took longer than {timeout_s} s (env.step_timeout_s)"
        ) from None
    except EpisodeError:
        raise
    except Exception as e:  # an environment is user code: its failure ends this episode only
        raise EpisodeError("env_raised", f"environment {what} raised {type(e).__name__}: {e}") from e


def encode_observation(codec: Codec, text: str) -> list[int]:
    """The ids of new environment text alone: no special tokens, nothing before it re-encoded."""
    return list(codec.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


async def run_episode(
    engine: TurnEngine,
    env: MultiAgentEnvironment,
    row: Example,
    codec: Codec,
    limits: EnvLimits,
    params: SamplingParams,
    episode: int = 0,
) -> EpisodeResult:
    """`engine` plays every role, or (RoleEngines) each role its own policy's engine."""
    engines = engine if isinstance(engine, RoleEngines) else RoleEngines(engine)
    turn = await _env_call(env.reset(row), limits.step_timeout_s, "reset")
    tracks: dict[str, Track] = {}
    for role in env.roles:
        prompt = turn.observations.get(role, "")
        if not prompt:
            raise EpisodeError("env_raised", f"environment reset gave role {role!r} no first observation (its prompt)")
        tracks[role] = Track(prompt_ids=codec.encode(prompt), role=role)
    rewards: Counter[str] = Counter(turn.rewards)
    truncated, turns = False, 0
    while turn.next_role is not None:
        track = tracks[turn.next_role]
        budget = min(limits.turn_max_tokens, limits.max_episode_tokens - len(track))
        if track.turns >= limits.max_turns or budget <= 0:
            truncated = True
            break
        request = GenerationRequest(next(_request_ids), track.prefix(), 1, replace(params, max_new_tokens=budget))
        sample = (await engines.engine(track.role).generate([request]))[0][0]
        track.append_model(sample)
        turns += 1
        action = codec.decode(sample.completion_ids)
        turn = await _env_call(env.step(track.role, action), limits.step_timeout_s, "step")
        rewards.update(turn.rewards)
        for role, text in turn.observations.items():
            ids = encode_observation(codec, text)
            if len(tracks[role]) + len(ids) > limits.max_episode_tokens:
                truncated = True
                turn = Turn({}, None, {}, turn.metadata)
                break
            tracks[role].append_env(ids)
    for role, track in tracks.items():
        track.reward = float(rewards.get(role, 0.0))
    return EpisodeResult(
        [tracks[r].to_sample(episode, truncated, codec, engines.policy(r)) for r in env.roles],
        dict(turn.metadata),
        turns,
        truncated,
    )


EnvFactory = Callable[[], MultiAgentEnvironment]


async def run_episodes(
    engine: TurnEngine,
    make_env: EnvFactory,
    rows: list[Example],
    codec: Codec,
    limits: EnvLimits,
    params: SamplingParams,
) -> tuple[list[EpisodeResult], Counter[str]]:
    """One episode per row, concurrently; failed episodes are counted by kind and left out."""
    results = await asyncio.gather(
        *(run_episode(engine, make_env(), r, codec, limits, params, i) for i, r in enumerate(rows)),
        return_exceptions=True,
    )
    errors: Counter[str] = Counter()
    done: list[EpisodeResult] = []
    for r in results:
        if isinstance(r, EpisodeError):
            errors[r.kind] += 1
        elif isinstance(r, BaseException):
            raise r
        else:
            done.append(r)
    return done, errors
