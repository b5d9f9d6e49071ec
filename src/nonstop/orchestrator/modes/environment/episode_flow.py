"""The producer of an environment run: groups of episodes into the buffer, with per-role advantages.

`produce_episodes(production, engine, env)` is `generate.produce` for environments (the same
`Production`, and the run's `EnvRun`): it waits for admission, draws task rows (each draw
recorded in the ledger), plays `rollout.group_size` episodes of each row concurrently on the
engines (episodes.py) and hands the row's group to the buffer.
A group holds one `Sample` per episode and role with model tokens, tagged with its episode index
and role, and carries its advantages (the trainer uses them as they are):

- baseline 'group' (one role, GRPO): per role, (r - mean) / (std + eps) over the group's
  episodes; a group whose rewards are all equal has no signal and is dropped ('uniform_reward')
  when rollout.filter_uniform_reward is set, like a single-turn group;
- baseline 'ema' (self-play, zero-sum): per role, r - b_role, where b_role is an exponential
  moving average of that role's rewards (starting at the first group's mean), updated after
  each group. A group mean is about 0 in a zero-sum game; a per-role baseline keeps the first
  mover's advantage out of the gradient.

An episode the environment failed (raised, timed out) fails its group: the group is dropped
('env_error'), settled in the ledger, its errors counted by kind in `EpisodeStats.errors`, and
the run goes on; `env.max_consecutive_errors` failed groups in a row end it (NoLearningSignal).
`EpisodeStats` also keeps per-role metrics (reward mean, win rate), the episodes that spanned
several policy versions, and, per trained step, the lag of each episode (trainer version minus
its oldest model token's version).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from nonstop.config import EnvConfig
from nonstop.envs import registry
from nonstop.envs.base import EnvLimits, EpisodeResult, TurnEngine
from nonstop.observe.clock import BusyClock
from nonstop.orchestrator.generate import NoLearningSignal, Production, admit_and_run, drop_uniform
from nonstop.orchestrator.modes.environment.episodes import EnvFactory, run_episodes
from nonstop.tasks.codec import Codec
from nonstop.tasks.data import Draw, Example
from nonstop.types import Group, Sample, SamplingParams

EPS = 1e-6


class RoleBaselines:
    """Advantages of a group's samples, per role, by the 'group' or 'ema' baseline."""

    def __init__(self, mode: str, decay: float) -> None:
        self.mode, self.decay = mode, decay
        self.ema: dict[str, float] = {}

    def assign(self, samples: list[Sample]) -> bool:
        """Set `advantage` on every sample; False when no sample has any signal (all zero)."""
        by_role: dict[str, list[Sample]] = {}
        for s in samples:
            by_role.setdefault(s.role, []).append(s)
        for role, group in by_role.items():
            rewards = [s.reward for s in group]
            mean = sum(rewards) / len(rewards)
            if self.mode == "ema":
                base = self.ema.get(role, mean)
                for s in group:
                    s.advantage = s.reward - base
                self.ema[role] = self.decay * base + (1.0 - self.decay) * mean
            else:
                sd = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
                for s in group:
                    s.advantage = (s.reward - mean) / (sd + EPS)
        return any(abs(s.advantage or 0.0) > EPS for s in samples)


@dataclass
class EpisodeStats:
    """Counters of an environment run; `report()` goes into every step record."""

    episodes: int = 0
    successes: int = 0
    truncated: int = 0
    turns: int = 0
    multi_version: int = 0  # episodes whose model tokens came from more than one policy_version
    errors: Counter[str] = field(default_factory=Counter)
    errors_in_row: int = 0
    role_rewards: dict[str, list[float]] = field(default_factory=dict)  # since the last report
    episode_lag: Counter[int] = field(default_factory=Counter)  # lag of each trained episode, so far

    def add(self, results: list[EpisodeResult]) -> None:
        for e in results:
            self.episodes += 1
            self.successes += e.success
            self.truncated += e.truncated
            self.turns += e.turns
            self.multi_version += len(e.versions) > 1
            for s in e.samples:
                self.role_rewards.setdefault(s.role, []).append(s.reward)

    def trained(self, groups: list[Group], policy_version: int) -> None:
        """Record the lag of each episode of a batch trained at `policy_version`."""
        for g in groups:
            oldest: dict[int, int] = {}
            for s in g.samples:
                if s.min_version >= 0:
                    oldest[s.episode] = min(oldest.get(s.episode, s.min_version), s.min_version)
            self.episode_lag.update(policy_version - v for v in oldest.values())

    def report(self, baselines: RoleBaselines | None = None) -> dict:
        roles = {
            role: {"reward_mean": sum(r) / len(r), "win_rate": sum(x > 0 for x in r) / len(r), "n": len(r)}
            for role, r in self.role_rewards.items()
            if r
        }
        for role, b in baselines.ema.items() if baselines else ():
            roles.setdefault(role, {})["baseline"] = b
        self.role_rewards = {}
        n = max(self.episodes, 1)
        return {
            "episodes": self.episodes,
            "success_rate": self.successes / n,
            "truncated": self.truncated,
            "turns_mean": self.turns / n,
            "multi_version": self.multi_version,
            "errors": dict(self.errors),
            "roles": roles,
            "episode_lag_hist": {str(k): v for k, v in sorted(self.episode_lag.items())},
        }


def baseline_mode(cfg: EnvConfig, roles: int) -> str:
    return cfg.baseline or ("ema" if roles > 1 else "group")


Player = Callable[
    [TurnEngine, list[Example], Codec, EnvLimits, SamplingParams], Awaitable[tuple[list[EpisodeResult], Counter[str]]]
]
"""Plays one episode per row on the engine: the finished ones, and the failed ones counted by kind."""


def env_player(make_env: EnvFactory) -> Player:
    """The player of a nonstop environment: `run_episodes` (episodes.py)."""

    async def play(
        engine: TurnEngine, rows: list[Example], codec: Codec, limits: EnvLimits, params: SamplingParams
    ) -> tuple[list[EpisodeResult], Counter[str]]:
        return await run_episodes(engine, make_env, rows, codec, limits, params)

    return play


@dataclass
class EnvRun:
    """The environment side of a run: what to play in training and in evaluation, and its counters."""

    cfg: EnvConfig
    play: Player
    play_eval: Player
    limits: EnvLimits
    baselines: RoleBaselines
    stats: EpisodeStats

    @classmethod
    def build(cls, cfg: EnvConfig, base_model: Path | str | None = None) -> EnvRun:
        """`base_model` (its tokenizer) renders the prompts of a verifiers taskset (env.name 'verifiers/...')."""
        if cfg.name.startswith(registry.VERIFIERS):
            from nonstop.envs.verifiers.env import player  # optional: the verifiers extra, only for such a run

            play = player(cfg, None if base_model is None else str(base_model))
            return cls(
                cfg,
                play,
                play,
                registry.limits(cfg),
                RoleBaselines(baseline_mode(cfg, 1), cfg.ema_decay),
                EpisodeStats(),
            )
        make_env = registry.env_factory(cfg.name, "env.name", cfg)
        return cls(
            cfg,
            env_player(make_env),
            env_player(registry.env_factory(registry.eval_name(cfg), "env.eval_name", cfg)),
            registry.limits(cfg),
            RoleBaselines(baseline_mode(cfg, len(make_env().roles)), cfg.ema_decay),
            EpisodeStats(),
        )

    def report(self) -> dict:
        return self.stats.report(self.baselines)

    def state_dict(self) -> dict:
        """The counters and per-role baselines a resumed run continues from (JSON-ready)."""
        st = self.stats
        return {
            "episodes": st.episodes,
            "successes": st.successes,
            "truncated": st.truncated,
            "turns": st.turns,
            "multi_version": st.multi_version,
            "errors": dict(st.errors),
            "episode_lag": {str(k): v for k, v in st.episode_lag.items()},
            "ema": dict(self.baselines.ema),
        }

    def load_state_dict(self, state: dict) -> None:
        st = self.stats
        st.episodes, st.successes, st.truncated = state["episodes"], state["successes"], state["truncated"]
        st.turns, st.multi_version = state["turns"], state["multi_version"]
        st.errors = Counter(state["errors"])
        st.episode_lag = Counter({int(k): v for k, v in state["episode_lag"].items()})
        self.baselines.ema = {k: float(v) for k, v in state["ema"].items()}

    async def close(self) -> None:
        """Stop what the players started (a verifiers agent player's interception and tool servers)."""
        for play in {id(p): p for p in (self.play, self.play_eval)}.values():
            close = getattr(play, "aclose", None)
            if close is not None:
                await close()

    async def evaluate(self, engine: TurnEngine, rows: list[Example], codec: Codec, params: SamplingParams) -> float:
        """Success rate over one episode per held-out row (a failed episode counts as a failure)."""
        done, _ = await self.play_eval(engine, rows, codec, self.limits, params)
        return sum(e.success for e in done) / max(len(rows), 1)


async def produce_episodes(production: Production, engine: TurnEngine, env: EnvRun) -> None:
    """Each admitted row becomes `group_size` concurrent episodes of `env` on `engine` (a
    RoleEngines with env.policies); its group goes to the buffer as soon as they all end, while
    the engines keep decoding the turns of other episodes."""
    p, rollout, limits = production, production.rollout, env.limits
    buffer, stats, episode_stats = p.buffer, p.stats, env.stats
    params = SamplingParams(
        limits.turn_max_tokens, rollout.temperature, top_k=rollout.top_k, top_p=rollout.top_p, min_p=rollout.min_p
    )
    busy = BusyClock(p.clock)

    async def one_group(draw: Draw, t_admit: float) -> None:
        ex = draw.example
        busy.enter()
        try:
            results, errors = await env.play(engine, [ex] * rollout.group_size, p.codec, limits, params)
        finally:
            busy.leave()
        stats.samples += len(results)
        episode_stats.add(results)
        group = Group(
            ex.index,
            ex.prompt,
            ex.answer,
            [s for e in results for s in e.samples if any(s.loss_mask)],
            epoch=draw.epoch,
        )
        if errors:
            episode_stats.errors.update(errors)
            episode_stats.errors_in_row += 1
            await buffer.drop(group, "env_error")
            if episode_stats.errors_in_row >= env.cfg.max_consecutive_errors:
                raise NoLearningSignal(
                    f"the environment failed {episode_stats.errors_in_row} episode groups in a row "
                    f"(env.max_consecutive_errors); errors so far: {dict(episode_stats.errors)}"
                )
            return
        episode_stats.errors_in_row = 0
        if not group.samples:  # every episode ended before any model turn: nothing to train
            await buffer.drop(group, "no_model_tokens")
            return
        has_signal = env.baselines.assign(group.samples)
        if not has_signal and rollout.filter_uniform_reward:
            await drop_uniform(buffer, group, stats, rollout.max_consecutive_uniform)
            return
        stats.uniform_in_row = 0
        stats.groups_delivered += 1
        await buffer.put(group)

    await admit_and_run(buffer, p.stream, p.ledger, stats, rollout.prompts_per_step, one_group, "episodes")
