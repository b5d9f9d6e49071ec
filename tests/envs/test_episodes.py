"""Episodes through a real engine: token-exact sequences, masks at every boundary, versions
across a weight update, self-play roles, environment faults counted and settled."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import torch

from nonstop.config import RolloutConfig, load_config
from nonstop.engine.aio import AsyncEngine
from nonstop.engine.core import TorchEngine
from nonstop.envs import guess, nim
from nonstop.envs.base import ENV_VERSION, EnvLimits, SingleAgent
from nonstop.envs.calculator import Calculator
from nonstop.hf import load_model, load_tokenizer
from nonstop.observe.clock import Clock
from nonstop.orchestrator.buffer import RolloutBuffer
from nonstop.orchestrator.generate import Production, RolloutStats
from nonstop.orchestrator.ledger import Ledger
from nonstop.orchestrator.modes.environment.episode_flow import (
    EnvRun,
    EpisodeStats,
    RoleBaselines,
    env_player,
    produce_episodes,
)
from nonstop.orchestrator.modes.environment.episodes import encode_observation, run_episode, run_episodes
from nonstop.tasks.codec import Codec
from nonstop.tasks.data import Example, PromptStream
from nonstop.types import GenerationRequest, Sample, SamplingParams
from support import EXAMPLES_DIR

NEW = 5
LIMITS = EnvLimits(max_turns=3, max_episode_tokens=64, turn_max_tokens=3, step_timeout_s=5.0)


class Recording:
    """A real in-process engine that keeps every request and answer (and can publish new weights
    after its first call, so the next turn runs on them)."""

    def __init__(self, engine: AsyncEngine, publish_after_first: dict | None = None) -> None:
        self.engine, self.calls = engine, []
        self.new_state = publish_after_first

    async def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        out = await self.engine.generate(requests)
        self.calls.append((requests[0].prompt_ids, out[0][0]))
        if self.new_state is not None:
            self.engine.engine.weights = _Publisher(self.new_state)
            self.new_state = None
        return out


class _Publisher:
    """A weight receiver with one new version ready: the engine takes it at its next forward pass."""

    def __init__(self, state) -> None:
        self.state = state

    def maybe_update(self, model):
        if self.state is None:
            return None
        model.load_state_dict(self.state)
        self.state = None
        return NEW


class RecordingEnv:
    """Wraps a built-in environment and keeps what it appended (the test's independent record)."""

    def __init__(self, env) -> None:
        self.env, self.tools, self.observations = env, env.tools, []

    async def reset(self, row):
        return await self.env.reset(row)

    async def step(self, action):
        s = await self.env.step(action)
        self.observations.append(s.observation)
        return s


@pytest.fixture
def engine(tiny_dir):
    tok = load_tokenizer(str(tiny_dir))
    return AsyncEngine(TorchEngine(load_model(str(tiny_dir)), [tok.eos_token_id], tok.pad_token_id)), Codec(tok)


def _rebuild(codec, prompt_ids, calls, observations):
    """(ids, mask) from what the engine sampled and what the environment appended, in turn order."""
    ids, mask = list(prompt_ids), []
    for (_, sample), obs in zip(calls, observations):
        ids += sample.completion_ids
        mask += [True] * len(sample.completion_ids)
        extra = encode_observation(codec, obs)
        ids += extra
        mask += [False] * len(extra)
    return ids, mask


@pytest.mark.parametrize("params", [SamplingParams(3, 1.0), SamplingParams(3, 1.0, top_k=4)], ids=["full", "top_k"])
def test_episode_ids_are_the_engine_samples_and_env_appends_with_the_mask_at_every_boundary(engine, params):
    eng, codec = engine
    rec, env = Recording(eng), RecordingEnv(guess.GuessNumber())
    result = asyncio.run(run_episode(rec, SingleAgent(env), Example(0, "?", "9"), codec, LIMITS, params))
    s = result.samples[0]
    assert result.turns == len(rec.calls) == 3 and result.truncated  # 9 is out of range: never found
    ids, mask = _rebuild(codec, s.prompt_ids, rec.calls, env.observations)
    assert s.prompt_ids == codec.encode("?")
    assert s.prompt_ids + s.completion_ids == ids
    assert s.loss_mask == mask and len(s.logprobs) == len(s.versions) == len(ids) - len(s.prompt_ids)
    # every turn's request was the episode so far, token for token: nothing was encoded again
    pos = 0
    for prefix, sample in rec.calls:
        assert prefix == s.prompt_ids + s.completion_ids[:pos]
        n = len(sample.completion_ids)
        assert s.logprobs[pos : pos + n] == sample.logprobs and s.versions[pos : pos + n] == sample.versions
        pos += n + len(encode_observation(codec, env.observations[rec.calls.index((prefix, sample))]))
    env_pos = [t for t, m in enumerate(s.loss_mask) if not m]
    assert env_pos and all(s.versions[t] == ENV_VERSION and s.logprobs[t] == 0.0 for t in env_pos)
    if params.top_k:
        assert len(s.sampling_mask) == len(s.completion_ids)
        assert all(s.sampling_mask[t] == [s.completion_ids[t]] for t in env_pos)
        assert all(len(s.sampling_mask[t]) == 4 for t, m in enumerate(s.loss_mask) if m)


def test_an_episode_spanning_a_weight_update_carries_both_versions(engine, tiny_dir):
    eng, codec = engine
    new = load_model(str(tiny_dir))
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    rec = Recording(eng, publish_after_first=new.state_dict())
    result = asyncio.run(
        run_episode(rec, SingleAgent(guess.GuessNumber()), Example(0, "?", "9"), codec, LIMITS, SamplingParams(3, 1.0))
    )
    s = result.samples[0]
    first, later = rec.calls[0][1], [c[1] for c in rec.calls[1:]]
    assert set(first.versions) == {0} and all(set(x.versions) == {NEW} for x in later)
    assert result.versions == {0, NEW} and s.min_version == 0
    stats = EpisodeStats()
    stats.add([result])
    assert stats.multi_version == 1


def test_selfplay_nim_keeps_one_sequence_per_role_and_zero_sum_rewards(engine):
    eng, codec = engine
    done, errors = asyncio.run(
        run_episodes(
            eng,
            nim.Nim,
            [Example(i, "n", "5,first") for i in range(6)],
            codec,
            EnvLimits(8, 64, 2, 5.0),
            SamplingParams(2, 1.0),
        )
    )
    assert not errors and len(done) == 6
    for e in done:
        first, second = e.samples
        assert (first.role, second.role) == ("first", "second") and first.episode == second.episode
        assert first.reward == -second.reward and abs(first.reward) == 1.0
        assert codec.decode(first.prompt_ids) == "n5:" and codec.decode(second.prompt_ids) == "n"
        # the other role's moves reach a sequence only as observations (mask 0)
        for s in (first, second):
            text = "".join(codec.decode([t]) for t, m in zip(s.completion_ids, s.loss_mask) if not m)
            assert all(part[:-1].isdigit() for part in text.split(":")[:-1]) if text else True


class Flaky(guess.GuessNumber):
    """guess_number, except that rows answered 'raise' or 'slow' make every step raise or hang."""

    async def reset(self, row):
        self.mode = row.answer if row.answer in ("raise", "slow") else ""
        return await super().reset(Example(row.index, row.prompt, "1" if self.mode else row.answer))

    async def step(self, action):
        if self.mode == "raise":
            raise KeyError("broken environment")
        if self.mode == "slow":
            await asyncio.sleep(30)
        return await super().step(action)


def test_env_errors_and_timeouts_are_counted_and_settled_and_the_run_goes_on(engine):
    """Rows 0-1 raise, row 2 times out, the rest play guess_number: the faulty groups are dropped
    ('env_error'), settled in the ledger, and every other group reaches the buffer."""
    eng, codec = engine
    rows = [Example(i, "?", {0: "raise", 1: "raise", 2: "slow"}.get(i, str(1 + i % 7))) for i in range(8)]
    cfg = load_config(None, ["env.name=guess_number", "env.max_consecutive_errors=5"])
    rollout = RolloutConfig(prompts_per_step=8, group_size=2, filter_uniform_reward=False)
    ledger, stats, ep = Ledger(), RolloutStats(), EpisodeStats()
    buffer = RolloutBuffer(8, None, None, 64, ledger)
    asyncio.run(
        produce_episodes(
            Production(buffer, PromptStream(rows, seed=0, max_epochs=1), ledger, codec, rollout, Clock(), stats),
            eng,
            EnvRun(
                cfg.env,
                env_player(lambda: SingleAgent(Flaky())),
                env_player(lambda: SingleAgent(Flaky())),
                EnvLimits(3, 64, 3, 0.3),
                RoleBaselines("group", 0.9),
                ep,
            ),
        )
    )
    assert ep.errors == Counter({"env_raised": 4, "env_timeout": 2})
    assert buffer.drops["env_error"] == 3
    assert ledger.report()["outcomes"] == {"env_error": 3} and ledger.report()["in_flight"] == 5
    assert buffer.queued == 5 + 1  # five groups and the close marker
    assert ep.episodes == 10


def test_reject_episode_drops_exactly_the_stale_episodes():
    def sample(episode, version, role=""):
        return Sample(
            [1],
            [3, 4, 5],
            [-1.0] * 3,
            [version, ENV_VERSION, version],
            "stop",
            loss_mask=[True, False, True],
            role=role,
            episode=episode,
            advantage=0.5,
        )

    async def go():
        ledger = Ledger()
        buf = RolloutBuffer(2, None, 1, 64, ledger, episodes=True)
        from nonstop.tasks.data import Draw

        groups = []
        for i, versions in enumerate([[0, 2, 3], [0, 0, 0]]):
            d = Draw(0, Example(i, "n", "5,first"))
            ledger.draw(d)
            g_samples = [s for e, v in enumerate(versions) for s in (sample(e, v, "first"), sample(e, v + 1, "second"))]
            groups.append(__import__("nonstop.types", fromlist=["Group"]).Group(i, "n", "", g_samples))
            await buf.put(groups[-1])
        await buf.step_done(3)  # lag of an episode = 3 - its oldest model token's version
        batch_task = asyncio.create_task(buf.take())
        await asyncio.sleep(0.05)
        await buf.close()
        return await batch_task, buf, ledger

    batch, buf, ledger = asyncio.run(go())
    assert len(batch) == 1 and sorted({s.episode for s in batch[0].samples}) == [1, 2]  # episode 0 (v0) dropped
    assert len(batch[0].samples) == 4 and {s.role for s in batch[0].samples} == {"first", "second"}
    assert buf.drops == Counter({"max_lag_episode": 1, "max_lag": 1})  # group 1: every episode stale
    assert ledger.report()["episodes_dropped"] == {"max_lag": 1} and ledger.report()["outcomes"] == {"max_lag": 1}


def test_role_baselines_group_and_ema_by_hand():
    def s(role, r):
        return Sample([1], [2], [0.0], [0], "stop", reward=r, role=role)

    g = [s("a", 1.0), s("a", 0.0), s("b", 0.5), s("b", 0.5)]
    assert RoleBaselines("group", 0.9).assign(g)
    assert [round(x.advantage, 4) for x in g] == [1.0, -1.0, 0.0, 0.0]  # (r - 0.5) / 0.5 per role; b has none
    b = RoleBaselines("ema", 0.5)
    first = [s("first", 1.0), s("second", -1.0), s("first", 1.0), s("second", -1.0)]
    b.assign(first)  # the first group's mean starts each baseline: no advantage yet
    assert [x.advantage for x in first] == [0.0] * 4 and b.ema == {"first": 1.0, "second": -1.0}
    nxt = [s("first", -1.0), s("second", 1.0)]
    assert b.assign(nxt)
    assert [x.advantage for x in nxt] == [-2.0, 2.0] and b.ema == {"first": 0.0, "second": 0.0}


def test_calculator_tool_result_comes_back_as_an_observation():
    async def go():
        env = Calculator()
        assert await env.reset(Example(0, "23*7=", "161")) == "23*7="
        call = await env.step("c")
        bad = await env.step("c2+2")
        answer = await env.step("161")
        return env, call, bad, answer

    env, call, bad, answer = asyncio.run(go())
    assert call.observation == "[161]" and not call.done
    assert bad.observation == "[error: ValueError]"
    assert answer.done and answer.reward == 1.0 and answer.metadata == {"success": True, "tool_calls": 2}
    assert env.stats.calls == Counter({"calc:ok": 1, "calc:raised": 1})


def test_env_section_builds_the_run_side_and_names_bad_fields():
    from nonstop.envs.registry import env_factory, eval_name

    cfg = load_config(None, ["env.name=nim"]).env
    assert EnvRun.build(cfg).baselines.mode == "ema" and env_factory(eval_name(cfg))().roles == ("agent",)
    assert EnvRun.build(load_config(None, ["env.name=calculator"]).env).baselines.mode == "group"
    from nonstop.config import ConfigError

    with pytest.raises(ConfigError, match="env.name: unknown environment 'chess'"):
        EnvRun.build(load_config(None, ["env.name=chess"]).env)
    with pytest.raises(ConfigError, match="env.max_turns"):
        load_config(None, ["env.max_turns=0"])


def test_trainer_recomputes_the_behaviour_logprobs_of_every_turn_and_ignores_env_tokens(engine, tiny_dir):
    """On policy, the trainer's logprob of each model token of a later turn (which saw earlier
    turns and environment tokens) equals the engine's: the trained sequence is the sampled one.
    Environment tokens are out of the loss: garbage in their logprobs changes nothing."""
    from nonstop.config import TrainerConfig
    from nonstop.trainer.core import Trainer
    from nonstop.types import Group

    eng, codec = engine
    rows = [Example(i, "?", "9") for i in range(3)]
    done, _ = asyncio.run(
        run_episodes(eng, lambda: SingleAgent(guess.GuessNumber()), rows, codec, LIMITS, SamplingParams(3, 1.0))
    )
    for k, e in enumerate(done):
        e.samples[0].advantage = [1.0, -0.5, 0.25][k]
    groups = [Group(0, "?", "9", [done[0].samples[0], done[1].samples[0]]), Group(1, "?", "9", [done[2].samples[0]])]
    trainer = Trainer(
        load_model(str(tiny_dir)), TrainerConfig(lr=1e-2), temperature=1.0, pad_token_id=codec.tokenizer.pad_token_id
    )
    batch = trainer.batch_of(groups)  # groups of different sizes: the samples carry their advantages
    assert batch["advantages"].tolist() == [1.0, -0.5, 0.25]
    with torch.no_grad():
        logp = trainer.logprobs(batch)
    m = batch["mask"]
    assert int(m.sum()) == sum(sum(e.samples[0].loss_mask) for e in done) and int((~m).sum()) > 0
    assert torch.allclose(logp[m], batch["behaviour"][m], atol=1e-4)
    garbage = [
        Group(
            g.prompt_index,
            g.prompt,
            g.answer,
            [
                Sample(
                    s.prompt_ids,
                    s.completion_ids,
                    [lp if mk else -50.0 for lp, mk in zip(s.logprobs, s.loss_mask)],
                    s.versions,
                    s.finish_reason,
                    loss_mask=s.loss_mask,
                    advantage=s.advantage,
                )
                for s in g.samples
            ],
        )
        for g in groups
    ]
    twin = Trainer(
        load_model(str(tiny_dir)), TrainerConfig(lr=1e-2), temperature=1.0, pad_token_id=codec.tokenizer.pad_token_id
    )
    a, b = trainer.step(groups), twin.step(garbage)
    assert a["loss"] == b["loss"] and a["ratio_max"] == pytest.approx(1.0, abs=1e-4)
    assert a["lag_hist"] == {"0": a["tokens"]}  # environment tokens (version -1) are not in the histogram


def test_environment_examples_validate_and_name_builtin_environments():
    import importlib.util

    examples = sorted((EXAMPLES_DIR / "envs").glob("*.yaml"))
    assert len(examples) == 9
    for path in examples:
        cfg = load_config(path)
        assert cfg.env is not None
        prefixes = ("verifiers/", "textarena/", "reasoning_gym/")
        extra = cfg.env.name.partition("/")[0] if cfg.env.name.startswith(prefixes) else None
        if extra is not None and importlib.util.find_spec(extra) is None:
            continue  # that optional extra is not installed here
        EnvRun.build(cfg.env)


@pytest.mark.slow
def test_cli_run_on_selfplay_nim_settles_every_row_and_reports_episodes(tiny_dir, tmp_path):
    """The real pipeline (engine and trainer processes, shm transport) on self-play Nim with
    `reject: episode`: steps train on two-role groups, the ledger settles each drawn row once,
    and the summary carries the episode counters, per-role metrics and per-episode lags."""
    import json

    from support.cli import nonstop, sets, small_model_args

    out = nonstop(
        [
            "train",
            *sets(
                {
                    "env.name": "nim",
                    "env.max_turns": 5,
                    "env.turn_max_tokens": 2,
                    "env.eval_rows": 20,
                    "buffer.reject": "episode",
                    "buffer.max_lag": 1,
                    "rollout.prompts_per_step": 4,
                    "rollout.group_size": 2,
                    "rollout.filter_uniform_reward": False,
                    "run.max_steps": 4,
                    "run.eval_every": 2,
                    "checkpoint.every_steps": None,
                    "run.out_dir": tmp_path,
                    "run.name": "nim",
                }
            ),
            *small_model_args(tiny_dir),
        ],
        tmp_path,
        timeout_s=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    s = json.loads((tmp_path / "nim" / "summary.json").read_text())
    ep, ledger = s["episodes"], s["prompts"]
    assert s["steps"] == 4 and ep["episodes"] >= 4 * 4 * 2 and not ep["errors"]
    assert ledger["duplicated"] == 0 and ledger["unknown"] == 0
    assert ledger["outcomes"].get("trained", 0) == 16 and sum(ep["episode_lag_hist"].values()) > 0
    assert set(int(k) for k in ep["episode_lag_hist"]) <= {0, 1}
    lines = [json.loads(x) for x in (tmp_path / "nim" / "metrics.jsonl").read_text().splitlines()]
    assert all(set(r["episodes"]["roles"]) <= {"first", "second"} for r in lines if "episodes" in r)
    assert any(set(r["episodes"]["roles"]) == {"first", "second"} for r in lines if "episodes" in r)
    assert all(0.0 <= r["eval_accuracy"] <= 1.0 for r in lines if "eval_accuracy" in r)


def test_episodes_over_before_any_model_turn_are_dropped_and_settled(engine):
    from nonstop.envs.base import Turn

    class OverAtOnce:
        roles, tools = ("agent",), {}

        async def reset(self, row):
            return Turn({"agent": "?"}, None, {"agent": 1.0})

        async def step(self, role, action):
            raise AssertionError("no turn is ever played")

    eng, codec = engine
    rows = [Example(i, "?", "1") for i in range(3)]
    ledger, ep = Ledger(), EpisodeStats()
    buffer = RolloutBuffer(3, None, None, 64, ledger)
    asyncio.run(
        produce_episodes(
            Production(
                buffer,
                PromptStream(rows, seed=0, max_epochs=1),
                ledger,
                codec,
                RolloutConfig(prompts_per_step=3, group_size=2),
                Clock(),
                RolloutStats(),
            ),
            eng,
            EnvRun(
                load_config(None, ["env.name=nim"]).env,
                env_player(OverAtOnce),
                env_player(OverAtOnce),
                LIMITS,
                RoleBaselines("group", 0.9),
                ep,
            ),
        )
    )
    assert buffer.drops == Counter({"no_model_tokens": 3}) and ledger.report()["outcomes"] == {"no_model_tokens": 3}
    assert buffer.queued == 1  # only the close marker


def test_env_counters_and_role_baselines_survive_a_checkpoint_round_trip():
    """What recovery.py writes into the checkpoint (as JSON) restores the episode counters, the
    per-episode lag histogram and each role's EMA baseline of a resumed run."""
    import json

    cfg = load_config(None, ["env.name=nim"]).env
    run = EnvRun.build(cfg)
    run.baselines.assign(
        [
            Sample([1], [2], [-1.0], [0], "stop", reward=r, role=role, episode=i)
            for i, (role, r) in enumerate([("first", 1.0), ("second", -1.0), ("first", -1.0)])
        ]
    )
    st = run.stats
    st.episodes, st.successes, st.truncated, st.turns, st.multi_version = 9, 4, 1, 30, 2
    st.errors.update({"env_raised": 3})
    st.episode_lag.update({0: 5, 1: 7})
    saved = json.loads(json.dumps(run.state_dict()))
    again = EnvRun.build(cfg)
    again.load_state_dict(saved)
    assert again.state_dict() == run.state_dict() and again.stats.episode_lag == Counter({0: 5, 1: 7})
    assert again.baselines.ema == run.baselines.ema and set(again.baselines.ema) == {"first", "second"}


def test_an_environment_run_plays_the_environments_own_rows():
    """A run with a built-in environment trains and evaluates on that environment's rows, not the
    task's (a merge once loaded the task's addition rows first, and guess_number read '52' as its
    hidden number)."""

    from nonstop.config import load_config
    from nonstop.envs.registry import builtin_task
    from nonstop.orchestrator.launch import run_rows
    from nonstop.tasks.data import load_task

    examples = EXAMPLES_DIR / "envs"
    for name in ("guess_number", "calculator", "nim_selfplay"):
        cfg = load_config(examples / f"{name}.yaml")
        assert cfg.env is not None
        env_rows, task_rows = builtin_task(cfg.env), load_task(cfg.task)
        assert env_rows is not None
        got = run_rows(cfg)
        assert [ex.prompt for ex in got.train[:5]] == [ex.prompt for ex in env_rows.train[:5]], name
        assert [ex.prompt for ex in got.train[:5]] != [ex.prompt for ex in task_rows.train[:5]], name
    given = load_task(load_config().task)
    assert run_rows(cfg, given) is given


def test_episode_groups_without_signal_count_toward_max_consecutive_uniform(engine):
    """An environment whose every episode scores the same never gives a learning signal: after
    `rollout.max_consecutive_uniform` such groups in a row the run stops with a reason, as a
    single-turn task's does, instead of generating until its time budget (or forever)."""
    from nonstop.envs.base import Turn
    from nonstop.orchestrator.generate import NoLearningSignal

    class AlwaysZero:
        roles, tools = ("agent",), {}

        async def reset(self, row):
            return Turn({"agent": "?"}, "agent", {})

        async def step(self, role, action):
            return Turn({}, None, {"agent": 0.0})

    eng, codec = engine
    rows = [Example(i, "?", "1") for i in range(16)]
    ledger, stats = Ledger(), RolloutStats()
    buffer = RolloutBuffer(4, None, None, 64, ledger)
    with pytest.raises(NoLearningSignal, match="rollout.max_consecutive_uniform"):
        asyncio.run(
            produce_episodes(
                Production(
                    buffer,
                    PromptStream(rows, seed=0, max_epochs=1),
                    ledger,
                    codec,
                    RolloutConfig(prompts_per_step=2, group_size=2, max_consecutive_uniform=3),
                    Clock(),
                    stats,
                ),
                eng,
                EnvRun(
                    load_config(None, ["env.name=nim"]).env,
                    env_player(AlwaysZero),
                    env_player(AlwaysZero),
                    LIMITS,
                    RoleBaselines("group", 0.9),
                    EpisodeStats(),
                ),
            )
        )
    assert stats.uniform_in_row >= 3 and buffer.drops["uniform_reward"] == stats.uniform_in_row
