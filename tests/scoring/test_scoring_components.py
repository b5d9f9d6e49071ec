"""Scoring components: process rewards (hand-computed), the reward model actor (batching, killed
mid-call and restarted), the distillation teacher actor (killed and replaced), the generative judge
over real HTTP, math_verify; actor methods named by string only in the runtime."""

import asyncio
import os
import re
import signal
from pathlib import Path

import pytest
import torch

import nonstop
from nonstop.config import DistillConfig, LocalRuntimeConfig, TrainerConfig, load_config
from nonstop.engine.aio import AsyncEngine
from nonstop.engine.core import TorchEngine
from nonstop.hf import load_model, load_tokenizer
from nonstop.models.tiny import make_char_tokenizer
from nonstop.runtime.local import LocalBackend
from nonstop.scoring.compose import build_scorer
from nonstop.scoring.judge import parse_verdict
from nonstop.scoring.pool import ActorPool, CallFailed
from nonstop.scoring.process import split_steps, step_end_tokens, token_rewards
from nonstop.scoring.rewards import resolve_reward
from nonstop.scoring.teacher import TeacherComponent, TeacherWorker
from nonstop.trainer.core import Trainer
from nonstop.types import Group, Sample
from support.served import serving

TOK = make_char_tokenizer()


def decode(ids):
    return TOK.decode(ids, skip_special_tokens=True)


def _group(texts, answer="42", prompt="40+02="):
    samples = [
        Sample(TOK(prompt)["input_ids"], TOK(t)["input_ids"], [-0.1] * len(t), [0] * len(t), "stop", text=t)
        for t in texts
    ]
    return Group(0, prompt, answer, samples)


def test_steps_and_their_last_tokens_by_hand():
    assert split_steps("a\nbb\nc", "\n") == ["a\n", "bb\n", "c"]
    assert split_steps("a\nbb\n", "\n") == ["a\n", "bb\n"]
    assert split_steps("abc", "\n") == ["abc"]
    ids = TOK("a;bb;c")["input_ids"]  # one token per character: a ; b b ; c
    assert step_end_tokens(ids, ["a;", "bb;", "c"], decode) == [1, 4, 5]
    assert token_rewards(ids, ["a;", "bb;", "c"], [1.0, -0.5, 2.0], 0.5, decode) == [0, 0.5, 0, 0, -0.25, 1.0]


def test_process_rewards_through_the_stage_and_into_the_loss(tiny_dir):
    cfg = load_config(
        overrides=[
            "scoring.process_reward.fn=support.scoring_helpers:step_scores",
            "scoring.process_reward.delimiter=+",
            "scoring.process_reward.coef=2",
        ]
    )

    async def go():
        stage = build_scorer(cfg, None, decode)
        await stage.start()
        g = _group(["4+1", "1+4+"], answer="42")
        assert await stage.score(g)
        return g

    g = asyncio.run(go())
    # "4+1": steps "4+" (has 4: 1.0) ends at t=1, "1" (-0.5) at t=2; coef 2
    assert g.samples[0].token_rewards == [0.0, 2.0, -1.0]
    # "1+4+": steps "1+" (-0.5) at t=1, "4+" (1.0) at t=3
    assert g.samples[1].token_rewards == [0.0, -1.0, 0.0, 2.0]
    # equal outcome rewards give zero advantages: only the process term can move the weights
    tok = load_tokenizer(str(tiny_dir))
    for s in g.samples:
        s.reward, s.logprobs = 1.0, [-4.0] * len(s.completion_ids)
    trainer = Trainer(load_model(str(tiny_dir)), TrainerConfig(lr=1e-2), 1.0, tok.pad_token_id)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.step([g])
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    plain = Trainer(load_model(str(tiny_dir)), TrainerConfig(lr=1e-2), 1.0, tok.pad_token_id)
    for s in g.samples:
        s.token_rewards = None
    assert plain.step([g])["grad_norm"] == 0.0


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    """A tiny Qwen2 sequence classifier with one label, made on the fly, and the char tokenizer."""
    from transformers import AutoModelForSequenceClassification, Qwen2Config

    path = tmp_path_factory.mktemp("rm")
    config = Qwen2Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_labels=1,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(path)
    TOK.save_pretrained(path)
    return path


@pytest.mark.slow
def test_reward_model_actor_batches_and_survives_being_killed(reward_model_dir):
    from transformers import AutoModelForSequenceClassification

    cfg = load_config(
        overrides=[
            f"scoring.reward_model.path={reward_model_dir}",
            "scoring.reward_model.weight=2",
            "scoring.reward_model.batch_size=64",
            "task.reward=partial_credit",
        ]
    )
    model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir).eval()

    def expected(g):
        with torch.no_grad():
            return [
                2 * float(model(input_ids=torch.tensor([TOK(g.prompt + s.text)["input_ids"]])).logits[0, 0])
                + resolve_reward("partial_credit")(s.text, g.answer)
                for s in g.samples
            ]

    async def go():
        backend = LocalBackend(LocalRuntimeConfig())
        try:
            stage = build_scorer(cfg, backend, decode)
            await stage.start()
            rm = next(c for c in stage.components if c.name == "reward_model")
            groups = [_group(["42", "4", "x1"]), _group(["7", "77"], answer="7", prompt="3+4=")]
            oks = await asyncio.gather(*(stage.score(g) for g in groups))
            calls_together = rm.batcher.calls
            victim = rm.pool.alive()[0]
            os.kill(victim.pid, signal.SIGKILL)  # dies between two groups, unannounced
            g3 = _group(["9", "19"], answer="9", prompt="4+5=")
            ok3 = await stage.score(g3)
            return stage, rm, [*groups, g3], [*oks, ok3], calls_together
        finally:
            await backend.shutdown()

    stage, rm, groups, oks, calls_together = asyncio.run(go())
    assert all(oks)
    assert calls_together <= 2  # the two groups went in at most two forward passes
    for g in groups:
        assert [s.reward for s in g.samples] == pytest.approx(expected(g), abs=1e-4)
    assert rm.pool.restarts == 1 and stage.retried == {"reward_model_worker_died": 1} and not stage.errors


@pytest.mark.slow
def test_teacher_actor_answers_as_its_worker_and_is_replaced_when_killed(tiny_dir):
    teacher = TeacherWorker(str(tiny_dir), temperature=0.7, batch_size=8)
    group = _group(["42", "4", "x1"])
    want = teacher.logprobs([(s.prompt_ids, s.completion_ids) for s in group.samples])
    log: list[str] = []

    async def go():
        backend = LocalBackend(LocalRuntimeConfig())
        component = TeacherComponent(DistillConfig(teacher=str(tiny_dir), batch_size=2), 0.7, backend, log.append)
        try:
            await component.start()
            first = await component.contribute(group)
            victim = component.pool.alive()[0]
            os.kill(victim.pid, signal.SIGKILL)  # dies between two calls, unannounced
            with pytest.raises(CallFailed) as failed:
                await component.contribute(group)
            second = await component.contribute(group)  # on the fresh actor
            return first, second, failed.value.reason, victim, component.pool
        finally:
            await component.close()
            await backend.shutdown()

    first, second, reason, victim, pool = asyncio.run(go())
    for got in (first, second):
        assert got.teacher is not None and got.teacher.startswith(f"{tiny_dir}@")
        assert got.teacher_logprobs is not None
        for lp, w in zip(got.teacher_logprobs, want):
            assert lp == pytest.approx(w, abs=1e-5)
    assert reason == "worker_died" and pool.restarts == 1 and not victim.is_alive()
    assert any("starting a fresh one" in line for line in log)


def test_actor_methods_are_named_by_string_only_in_the_runtime():
    """The typed seams: scoring reaches its actors through typed clients (nonstop.clients), and the
    pool over them has no string-method call to offer."""
    src = Path(nonstop.__file__).parent
    named = [
        f"{path.relative_to(src)}:{n}"
        for path in sorted(src.rglob("*.py"))
        if path.relative_to(src).parts[0] != "runtime"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        # `x.call("method")` or a bare `call("method")`, not a name ending in call (`format_call("calc")`).
        if re.search(r'(?<![\w])call\("', line)
    ]
    assert named == []
    assert not hasattr(ActorPool, "call")


def test_judge_over_a_real_openai_compatible_server(tiny_dir):
    tok = load_tokenizer(str(tiny_dir))
    engine = TorchEngine(
        load_model(str(tiny_dir)),
        [tok.eos_token_id],
        tok.pad_token_id,
        detokenize=lambda ids: tok.decode(ids, skip_special_tokens=True),
    )

    async def go():
        async with serving(AsyncEngine(engine), tok, "judge") as url:
            any_char = build_scorer(
                load_config(
                    overrides=[
                        f"scoring.judge.url={url}",
                        "scoring.judge.pattern=(.)",
                        "scoring.judge.missing_score=0",
                        "scoring.judge.max_tokens=1",
                        "task.reward=exact_match",
                    ]
                ),
                None,
                decode,
            )
            never = build_scorer(
                load_config(overrides=[f"scoring.judge.url={url}", "scoring.judge.pattern=NEVER", "scoring.retries=0"]),
                None,
                decode,
            )
            down = build_scorer(
                load_config(overrides=["scoring.judge.url=http://127.0.0.1:9", "scoring.retries=1"]), None, decode
            )
            for st in (any_char, never, down):
                await st.start()
            g = _group(["42", "41"])
            results = (await any_char.score(g), await never.score(_group(["1"])), await down.score(_group(["1"])))
            for st in (any_char, never, down):
                await st.close()
            return g, results, never, down

    g, (ok, ok_never, ok_down), never, down = asyncio.run(go())
    # a verdict that is one character, a digit or not: exact_match + (digit or 0)
    assert ok and g.samples[0].reward >= 1.0 and g.samples[1].reward < 10
    assert not ok_never and never.errors == {"judge_unparsed": 1}
    assert not ok_down and down.retried == {"judge_unreachable": 1} and down.errors == {"judge_unreachable": 1}


def test_parse_verdict():
    import re

    assert parse_verdict("Score: 7/10", re.compile(r"(\d+)/10")) == 7.0
    assert parse_verdict("no", re.compile(r"\d+")) is None
    assert parse_verdict("-0.5 then 3", re.compile(r"-?\d+(?:\.\d+)?")) == -0.5


def test_math_verify_reward():
    pytest.importorskip("math_verify")
    fn = resolve_reward("math_verify")
    assert fn("so the answer is $\\frac{1}{2}$", "0.5") == 1.0
    assert fn("\\boxed{3}", "4") == 0.0
