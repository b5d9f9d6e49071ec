"""Adapters, with real calls: reasoning-gym as a task source (skipped without the extra), episodes over HTTP."""

from __future__ import annotations

import asyncio

import pytest

from nonstop.config import load_config
from nonstop.engine.aio import AsyncEngine
from nonstop.engine.core import TorchEngine
from nonstop.envs.registry import builtin_task, env_factory
from nonstop.hf import load_model, load_tokenizer
from nonstop.orchestrator.modes.environment.episode_flow import EnvRun
from nonstop.tasks.codec import Codec
from nonstop.types import SamplingParams


def test_reasoning_gym_rows_and_rewards_are_the_generator_and_its_scorer(tiny_dir):
    reasoning_gym = pytest.importorskip("reasoning_gym")
    cfg = load_config(
        None,
        [
            "env.name=reasoning_gym/basic_arithmetic",
            "env.train_rows=16",
            "env.eval_rows=8",
            "env.max_turns=2",
            "env.turn_max_tokens=4",
            "env.max_episode_tokens=120",
        ],
    ).env
    data = builtin_task(cfg)
    train = reasoning_gym.create_dataset("basic_arithmetic", size=16, seed=1)
    assert [(r.prompt, r.answer) for r in data.train] == [(e["question"], str(e["answer"])) for e in train]
    run = EnvRun.build(cfg)

    async def scripted():  # the right answer ends the episode with reward 1; a wrong one is retried
        env = env_factory(cfg.name, "env.name", cfg)()
        await env.reset(data.train[0])
        wrong = await env.step("agent", "nonsense")
        right = await env.step("agent", data.train[0].answer)
        return wrong, right

    wrong, right = asyncio.run(scripted())
    assert wrong.next_role == "agent" and wrong.observations["agent"].strip() == "Wrong, try again."
    assert right.done and right.rewards == {"agent": 1.0}

    tok = load_tokenizer(str(tiny_dir))
    engine = AsyncEngine(TorchEngine(load_model(str(tiny_dir)), [tok.eos_token_id], tok.pad_token_id))
    codec = Codec(tok)
    done, errors = asyncio.run(run.play(engine, data.eval, codec, run.limits, SamplingParams(4, 1.0)))
    assert not errors and len(done) == 8
    evals = {e["question"]: e for e in reasoning_gym.create_dataset("basic_arithmetic", size=8, seed=2)}
    ds = reasoning_gym.create_dataset("basic_arithmetic", size=8, seed=2)
    for row, e in zip(data.eval, done):
        s = e.samples[0]
        assert s.prompt_ids == codec.encode(row.prompt)
        first_turn = []
        for t, m in zip(s.completion_ids, s.loss_mask):
            if not m:
                break
            first_turn.append(t)
        expected = float(ds.score_answer(codec.decode(first_turn).strip(), evals[row.prompt]))
        assert s.reward >= expected  # the best of the turns' scores, the first turn's included


def test_episodes_over_http_against_the_server_keep_its_ids_logprobs_and_versions(tiny_dir):
    """A guess_number episode whose turns go to a real server on 127.0.0.1 through the OpenAI-style
    completions endpoint: the episode is the server's sampled ids plus the env's appends, with the
    server's behaviour logprobs and versions on the model tokens."""
    from test_episodes import Recording, RecordingEnv, _rebuild

    from nonstop.config import EngineConfig
    from nonstop.envs import guess
    from nonstop.envs.base import EnvLimits, SingleAgent
    from nonstop.envs.http import ClientEngine
    from nonstop.orchestrator.modes.environment.episodes import run_episode
    from nonstop.serve.client import HttpClient
    from nonstop.tasks.data import Example
    from support.served import serving

    tok = load_tokenizer(str(tiny_dir))
    engine = TorchEngine(
        load_model(str(tiny_dir)), [tok.eos_token_id], tok.pad_token_id, settings=EngineConfig(max_seq_len=64)
    )

    async def main():
        async with serving(AsyncEngine(engine), tok, "tiny") as url:
            client = HttpClient(url, model="tiny")
            try:
                rec, env = Recording(ClientEngine(client)), RecordingEnv(guess.GuessNumber())
                result = await run_episode(
                    rec,
                    SingleAgent(env),
                    Example(0, "?", "9"),
                    Codec(tok),
                    EnvLimits(3, 48, 3, 5.0),
                    SamplingParams(3, 1.0),
                )
                return rec, env, result
            finally:
                await client.close()

    rec, env, result = asyncio.run(main())
    s = result.samples[0]
    assert result.turns == 3 and len(rec.calls) == 3
    ids, mask = _rebuild(Codec(tok), s.prompt_ids, rec.calls, env.observations)
    assert s.prompt_ids + s.completion_ids == ids and s.loss_mask == mask
    served = [(t, lp, v) for _, x in rec.calls for t, lp, v in zip(x.completion_ids, x.logprobs, x.versions)]
    kept = [(t, lp, v) for t, lp, v, m in zip(s.completion_ids, s.logprobs, s.versions, s.loss_mask) if m]
    assert kept == served and all(v == 0 for _, _, v in kept)


def test_reasoning_gym_task_options_reach_the_generator_and_the_warmup_player(tiny_dir):
    """`env.task_options` are the dataset's own config (an unknown one is refused, naming the field);
    the warm-up's weak player answers each question in the dataset's format, right about 30% of
    the time, so the warmed base is weak, not blank."""
    import random

    reasoning_gym = pytest.importorskip("reasoning_gym")
    from nonstop.config import ConfigError
    from nonstop.envs.registry import demo_of

    opts = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    cfg = load_config(None, ["env.name=reasoning_gym/chain_sum", "env.train_rows=64", "env.eval_rows=8"])
    cfg = cfg.model_copy(update={"env": cfg.env.model_copy(update={"task_options": opts})}).env
    data = builtin_task(cfg)
    made = reasoning_gym.create_dataset("chain_sum", size=64, seed=1, **opts)
    assert [(r.prompt, r.answer) for r in data.train] == [(e["question"], str(e["answer"])) for e in made]
    assert all(len(r.prompt.split(":")[1].split()) == 4 for r in data.train)  # 'a + b =': two one-digit terms

    demo = demo_of(cfg)
    rng = random.Random(0)
    said = [demo(data.train[i % 64], rng, 1) for i in range(2000)]
    assert all(len(d) == 2 and not d[0][1] and d[1][1] for d in said)  # the question, then one player turn
    right = sum(d[1][0] == data.train[i % 64].answer for i, d in enumerate(said)) / len(said)
    assert 0.3 <= right < 0.45  # 30% chosen right, plus the other answers that happen to coincide
    assert {d[1][0] for d in said} <= {r.answer for r in data.train}

    bad = cfg.model_copy(update={"task_options": {"max_digit": 1}, "train_rows": 3})
    with pytest.raises(ConfigError, match="env.task_options"):
        builtin_task(bad)


@pytest.mark.slow
def test_reasoning_gym_example_trains_through_the_cli(tiny_dir, tmp_path):
    """examples/envs/reasoning_gym_arithmetic.yaml through the real `nonstop train` (engine and
    trainer processes), a few steps on the tiny model: steps train on scored episodes, held-out
    accuracy is measured, every drawn row settles once."""
    import json

    pytest.importorskip("reasoning_gym")
    from support import EXAMPLES_DIR
    from support.cli import nonstop, sets, small_model_args

    out = nonstop(
        [
            "train",
            str(EXAMPLES_DIR / "envs" / "reasoning_gym_arithmetic.yaml"),
            *small_model_args(tiny_dir),
            *sets(
                {
                    "env.train_rows": 64,
                    "env.eval_rows": 16,
                    "run.max_steps": 3,
                    "run.eval_every": 2,
                    "rollout.prompts_per_step": 4,
                    "rollout.group_size": 4,
                    "rollout.filter_uniform_reward": False,
                    "run.out_dir": tmp_path,
                    "run.name": "rg",
                }
            ),
        ],
        tmp_path,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads((tmp_path / "rg" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["prompts"]["duplicated"] == 0
    assert summary["episodes"]["episodes"] > 0 and summary["final_accuracy"] is not None
