"""TRL's reward contract in the scoring stage: detected by signature, called once per group with the
rows' columns as lists and chat rows as messages; None drops one reward for one sample, and a
sample every reward leaves None is counted and left out of training."""

from __future__ import annotations

import asyncio
import json

import pytest

from nonstop.api import resolve
from nonstop.config import LocalRuntimeConfig, ScoringConfig, load_config
from nonstop.runtime.local import LocalBackend
from nonstop.scoring.calls import WeightedRewards, takes_batch
from nonstop.scoring.compose import build_scorer
from nonstop.scoring.runners import make_runner
from nonstop.scoring.stage import FunctionComponent, ScoringStage
from nonstop.types import Group, Sample
from support.trl_rewards import never, recorded, says_yes, wrong_length

CHAT = ({"role": "user", "content": "Is 7 prime?"},)


def _group(texts, extra, messages=None, index=0):
    samples = [Sample([1, 2], list(range(10, 10 + n)), [-0.1] * n, [0] * n, "stop", text=t) for t, n in texts]
    prompt = "<|im_start|>user\nIs 7 prime?<|im_end|>\n" if messages else "Is 7 prime?"
    return Group(index, prompt, "yes", samples, extra=extra, messages=messages)


def _stage(fn, pool="thread"):
    cfg = ScoringConfig(pool=pool)
    runner = make_runner(cfg, None, print)
    return ScoringStage([FunctionComponent("reward", fn, fn, runner, cfg.timeout_s)], cfg, runner)


def _score(stage, *groups):
    async def go():
        await stage.start()
        try:
            return [await stage.score(g) for g in groups]
        finally:
            await stage.close()

    return asyncio.run(go())


def test_detected_by_a_parameter_named_completions():
    assert takes_batch(recorded) and takes_batch(says_yes)
    assert not takes_batch(lambda completion, answer: 1.0)
    assert not takes_batch(lambda completion, **kwargs: 1.0)  # nonstop's keyword form
    assert takes_batch(WeightedRewards([lambda completion, answer: 0.0, says_yes], [1.0, 1.0]))


@pytest.mark.parametrize("pool", ["loop", "thread"])
def test_standard_rows_one_call_per_group_with_every_column_as_a_list(tmp_path, pool):
    log = tmp_path / "calls.jsonl"
    extra = {"kind": "plain", "row_id": 4, "log": str(log)}
    group = _group([("a", 1), ("bb", 2), ("cccc", 4)], extra)
    assert _score(_stage(recorded, pool), group) == [True]
    (call,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert call["prompts"] == ["Is 7 prime?"] * 3 and call["completions"] == ["a", "bb", "cccc"]
    assert call["completion_ids"] == [[10], [10, 11], [10, 11, 12, 13]]
    assert call["columns"] == ["answer", "kind", "log", "row_id"] and call["row_ids"] == [4, 4, 4]
    assert [s.reward for s in group.samples] == [1.0, 2.0, 3.0]


def test_conversational_rows_get_messages_and_assistant_completions(tmp_path):
    log = tmp_path / "calls.jsonl"
    group = _group([("yes", 1), ("no", 1)], {"kind": "chat", "log": str(log)}, messages=CHAT)
    assert _score(_stage(recorded), group) == [True]
    (call,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert call["prompts"] == [list(CHAT)] * 2
    assert call["completions"] == [[{"role": "assistant", "content": "yes"}], [{"role": "assistant", "content": "no"}]]
    plain = _group([("yes", 1), ("no", 1)], {"kind": "chat"}, messages=CHAT)
    assert _score(_stage(says_yes), plain) == [True] and [s.reward for s in plain.samples] == [1.0, 0.0]


def test_none_drops_one_reward_and_all_none_leaves_the_sample_out():
    """says_yes is None for kind 'half', recorded for kind 'none' too: weighted sums over the rest."""
    fn, _ = resolve([says_yes, recorded, lambda completion, answer: 0.25], [2.0, 1.0, 0.0])
    stage = _stage(fn)
    g_half = _group([("yes", 1), ("no", 3)], {"kind": "half"})
    g_none = _group([("yes", 2), ("no", 1), ("yes!", 5)], {"kind": "none"}, index=1)
    g_all = _group([("yes", 2), ("no", 4)], {"kind": "plain"}, index=2)
    assert _score(stage, g_half, g_none, g_all) == [True, True, True]
    assert [s.reward for s in g_half.samples] == [1.0, 3.0]  # says_yes dropped: recorded x 1 (+ 0 x 0.25)
    assert [s.reward for s in g_all.samples] == [2.0 + 2.0, 0.0 + 3.0]
    # kind 'none': says_yes and recorded both None; the third reward (weight 0) still applies
    assert [s.reward for s in g_none.samples] == [0.0, 0.0, 0.0] and "reward_all_none" not in stage.errors


def test_a_sample_no_reward_applies_to_is_counted_and_carries_no_loss():
    def some_none(completions, **kwargs):
        return [None if c == "skip" else float(len(c)) for c in completions]

    stage = _stage(some_none)
    group = _group([("skip", 2), ("ab", 2), ("abcd", 3), ("skip", 1)], {"kind": "x"})
    every = _group([("skip", 2), ("skip", 3)], {"kind": "x"}, index=1)
    assert _score(stage, group, every) == [True, True]
    assert stage.errors == {"reward_all_none": 4}
    assert [s.reward for s in group.samples] == [3.0, 2.0, 4.0, 3.0]  # the others' mean: advantage 0
    assert [s.loss_mask for s in group.samples] == [[False] * 2, [True] * 2, [True] * 3, [False]]
    assert [s.reward for s in every.samples] == [0.0, 0.0]
    assert all(not any(s.loss_mask) for s in every.samples)


def test_weighted_nonstop_rewards_keep_working_and_a_failure_fails_the_sample():
    fn, name = resolve([lambda completion, answer: float(completion == answer), "partial_credit"], [1.0, 2.0])
    assert name.startswith("1*python:") and name.endswith(" + 2*partial_credit")
    group = _group([("yes", 1), ("yet", 1)], {})
    assert _score(_stage(fn), group) == [True]
    assert [s.reward for s in group.samples] == [1.0 + 2.0, 2.0 * 0.5 * 2 / 3]
    assert fn(completion="yes", answer="yes") == 3.0  # also callable one sample at a time

    def boom(completions, **kwargs):
        raise RuntimeError("verifier down")

    bad = _stage(WeightedRewards([says_yes, boom], [1.0, 1.0]))
    short = _stage(wrong_length)
    assert _score(bad, _group([("yes", 1)], {"kind": "x"})) == [False]
    assert _score(short, _group([("yes", 1), ("no", 1)], {"kind": "x"})) == [False]
    assert bad.errors == {"reward_raised": 1} and "verifier down" in (bad.last_error or "")
    assert short.errors == {"reward_bad_output": 2} and "returned 3 values for 2 samples" in (short.last_error or "")


def test_everything_none_from_a_name_in_worker_processes():
    """A TRL reward named in task.reward runs in reward worker processes (scoring.pool process)."""

    async def go():
        backend = LocalBackend(LocalRuntimeConfig())
        try:
            cfg = load_config(overrides=["task.reward=support.trl_rewards:never", "scoring.pool=process"])
            stage = build_scorer(cfg, backend, lambda ids: "")
            await stage.start()
            group = _group([("a", 1), ("b", 2)], {"kind": "x"}, messages=CHAT)
            ok = await stage.score(group)
            await stage.close()
            return stage, group, ok
        finally:
            await backend.shutdown()

    stage, group, ok = asyncio.run(go())
    assert ok and stage.errors == {"reward_all_none": 2} and never(["a"]) == [None]
    assert all(not any(s.loss_mask) for s in group.samples)
