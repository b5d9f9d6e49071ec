"""Adapters to other projects' environments, with real calls (skipped when the extra is absent)."""

from __future__ import annotations

import asyncio

import pytest

from nonstop.config import load_config
from nonstop.engine.aio import AsyncEngine
from nonstop.engine.core import TorchEngine
from nonstop.envs.registry import builtin_task
from nonstop.hf import load_model, load_tokenizer
from nonstop.orchestrator.episode_flow import EnvRun
from nonstop.orchestrator.episodes import run_episodes
from nonstop.orchestrator.generate import Codec
from nonstop.types import SamplingParams

reasoning_gym = pytest.importorskip("reasoning_gym")


def test_reasoning_gym_rows_and_rewards_are_the_generator_and_its_scorer(tiny_dir):
    cfg = load_config(None, ["env.name=reasoning_gym/basic_arithmetic", "env.train_rows=16", "env.eval_rows=8",
                             "env.max_turns=2", "env.turn_max_tokens=4", "env.max_episode_tokens=120"]).env
    data = builtin_task(cfg)
    train = reasoning_gym.create_dataset("basic_arithmetic", size=16, seed=1)
    assert [(r.prompt, r.answer) for r in data.train] == [(e["question"], str(e["answer"])) for e in train]
    run = EnvRun.build(cfg)

    async def scripted():  # the right answer ends the episode with reward 1; a wrong one is retried
        env = run.make_env()
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
    done, errors = asyncio.run(run_episodes(engine, run.make_env, data.eval, codec, run.limits, SamplingParams(4, 1.0)))
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
