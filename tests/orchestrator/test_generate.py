"""The generate stage's bound on engine calls: an unbounded buffer admits far more groups than the
engines hold, and the calls past the bound wait before their engine call, not inside it."""

import asyncio
import json
import time

import pytest

from nonstop.config import EngineConfig, RolloutConfig, load_config
from nonstop.engine.aio import AsyncEngine
from nonstop.engine.core import TorchEngine
from nonstop.hf import load_model, load_tokenizer
from nonstop.observe.clock import EVALUATION, Clock
from nonstop.observe.spans import SpanLog
from nonstop.orchestrator.buffer import RolloutBuffer
from nonstop.orchestrator.generate import Production, RolloutStats, produce
from nonstop.orchestrator.ledger import Ledger
from nonstop.scoring.compose import build_scorer
from nonstop.sizing.defaults import engine_calls_bound
from nonstop.tasks.codec import Codec
from nonstop.tasks.data import Example, PromptStream


def _most_at_once(spans_path) -> tuple[int, int]:
    """(groups, the most groups inside an engine call at the same time) from the `group` spans."""
    groups = [json.loads(line) for line in open(spans_path) if '"ev":"group"' in line.replace(" ", "")]
    edges = sorted([(g["t_gen0"], 1) for g in groups] + [(g["t_gen1"], -1) for g in groups])
    inside = most = 0
    for _, d in edges:  # at equal times the end (-1) sorts first: a call that ends as one starts
        inside += d
        most = max(most, inside)
    return len(groups), most


@pytest.mark.parametrize("bound", [3, None])
def test_an_unbounded_buffer_keeps_engine_calls_within_the_bound(tiny_dir, tmp_path, bound):
    tok = load_tokenizer(str(tiny_dir))
    model = load_model(str(tiny_dir))
    engine = AsyncEngine(
        TorchEngine(model, [tok.eos_token_id], tok.pad_token_id, settings=EngineConfig(max_concurrent_seqs=4))
    )
    rows = [Example(i, f"{i}+1=", str(i + 1)) for i in range(24)]
    rollout = RolloutConfig(prompts_per_step=4, group_size=2, filter_uniform_reward=False, max_new_tokens=6)
    ledger = Ledger()
    buffer = RolloutBuffer(4, None, None, 64, ledger)  # depth null: all 24 groups admitted at once
    spans = SpanLog(tmp_path / "spans.jsonl")
    scorer = build_scorer(load_config(None, ["task.reward=exact_match"]), None, Codec(tok).decode)
    production = Production(
        buffer,
        PromptStream(rows, seed=0, max_epochs=1),
        ledger,
        Codec(tok),
        rollout,
        Clock(),
        RolloutStats(),
        spans,
        max_in_flight=bound,
    )
    asyncio.run(produce(production, engine, scorer, 5))
    spans.close()
    groups, most = _most_at_once(tmp_path / "spans.jsonl")
    assert groups == 24 and buffer.queued == 24 + 1  # every group delivered, then the close marker
    if bound is None:
        assert most > 3  # without the bound every admitted group waits inside its engine call
    else:
        assert most == bound


def test_the_bound_is_twice_what_the_engines_decode_together():
    cfg = load_config(None, ["engine.max_concurrent_seqs=64", "rollout.group_size=8", "runtime.num_engines=2"])
    assert engine_calls_bound(cfg) == 2 * 2 * 64 // 8
    assert engine_calls_bound(load_config(None, ["engine.max_concurrent_seqs=4", "rollout.group_size=16"])) == 1


def test_idle_fractions_leave_evaluations_out():
    """A side's idle share is over the wall time outside evaluations (observe/clock.py)."""
    clock = Clock(start=time.perf_counter() - 100.0)  # 100 s of RL wall
    clock.add("training", 60.0)
    assert clock.idle_fraction("training") == pytest.approx(0.4, abs=1e-3)
    clock.add(EVALUATION, 20.0)  # 20 s of it held for evaluations: 60 busy of 80
    assert clock.idle_fraction("training") == pytest.approx(0.25, abs=1e-3)
    old = Clock(start=time.perf_counter() - 10.0, busy_s={"generation": 5.0, "training": 1.0})  # an older checkpoint's
    old.add(EVALUATION, 5.0)
    assert old.idle_fraction("generation") == pytest.approx(0.0, abs=1e-3)
