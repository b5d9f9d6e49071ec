"""Continuous batching: per-request parameters, shared prefill, limits, stops, async callers."""

import asyncio
import pickle

import pytest

from nonstop.config import EngineConfig
from nonstop.engine.aio import AsyncEngine, TokenEvent
from nonstop.engine.core import RequestError, TorchEngine
from nonstop.hf import load_model, load_tokenizer
from nonstop.kept import KeptIds
from nonstop.types import GenerationRequest, SamplingParams


def _engine(tiny_dir, **settings):
    tok = load_tokenizer(str(tiny_dir))
    detok = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    eng = TorchEngine(
        load_model(str(tiny_dir)),
        [tok.eos_token_id],
        tok.pad_token_id,
        settings=EngineConfig(**settings),
        detokenize=detok,
    )
    return eng, tok


PROMPTS = ["1+2=", "33+44=", "5=", "123+456=", "9+9=", "70+1=", "8+88=", "4+44=", "6+60=", "2+22="]


def test_continuous_batching_greedy_equals_decoding_each_request_alone(tiny_dir):
    # 3 slots for 10 requests of different lengths: most requests join a batch already in flight
    eng, tok = _engine(tiny_dir, max_concurrent_seqs=3)
    reqs = [
        GenerationRequest(i, tok(p)["input_ids"], 1, SamplingParams(3 + 2 * (i % 4), 0.0))
        for i, p in enumerate(PROMPTS)
    ]
    # sampled rows with truncation share the batch with the greedy ones
    noisy = [
        GenerationRequest(100 + i, tok(p)["input_ids"], 1, SamplingParams(7, 1.3, top_k=5, seed=i))
        for i, p in enumerate(PROMPTS[:4])
    ]
    together = eng.generate(reqs + noisy)
    assert eng.scheduler.stats["decode_steps"] < sum(r.params.max_new_tokens for r in reqs)  # rows were batched
    for req, got in zip(reqs, together):
        alone_eng, _ = _engine(tiny_dir, max_concurrent_seqs=1)
        alone = alone_eng.generate([req])[0][0]
        assert got[0].completion_ids == alone.completion_ids
        assert got[0].logprobs == pytest.approx(alone.logprobs, abs=1e-4)


def test_seeded_request_samples_the_same_tokens_whatever_shares_its_batch(tiny_dir):
    eng, tok = _engine(tiny_dir, max_concurrent_seqs=8)
    req = GenerationRequest(0, tok("12+3=")["input_ids"], 2, SamplingParams(8, 1.0, seed=42, top_p=0.9))
    alone = eng.generate([req])[0]
    others = [GenerationRequest(i, tok(p)["input_ids"], 2, SamplingParams(6, 0.9)) for i, p in enumerate(PROMPTS[:3])]
    crowded = eng.generate([*others, req])[-1]
    assert [s.completion_ids for s in crowded] == [s.completion_ids for s in alone]
    assert alone[0].completion_ids != alone[1].completion_ids or alone[0].logprobs != alone[1].logprobs


def test_group_shares_one_prefill(tiny_dir):
    eng, tok = _engine(tiny_dir)
    prompt = tok("45+54=")["input_ids"]
    out = eng.generate([GenerationRequest(0, prompt, 6, SamplingParams(5, 0.0))])[0]
    assert eng.scheduler.stats["prefill_tokens"] == len(prompt) and eng.scheduler.stats["prefills"] == 1
    assert len({tuple(s.completion_ids) for s in out}) == 1  # greedy siblings agree


def test_decode_attention_reads_are_counted_per_pass(tiny_dir):
    """One prompt of P tokens, 3 siblings of 4 tokens: the first token comes from the prefill, then 3
    decode passes over 3 rows (one block) that attend to P + 1, P + 2 and P + 3 cached positions."""
    eng, tok = _engine(tiny_dir)
    prompt = tok("45+54=")["input_ids"]
    eng.generate([GenerationRequest(0, prompt, 3, SamplingParams(4, 1.0, seed=1, stop_token_ids=[]))])
    P = len(prompt)
    assert eng.scheduler.stats["attention_reads"] == 3 * ((P + 1) + (P + 2) + (P + 3))


def test_limits_are_clear_errors_and_the_engine_survives(tiny_dir):
    eng, tok = _engine(tiny_dir, max_concurrent_seqs=4, max_seq_len=32)
    long_prompt = tok("1+" * 14 + "1=")["input_ids"]
    with pytest.raises(RequestError, match="max_seq_len of 32"):
        eng.generate([GenerationRequest(0, long_prompt, 1, SamplingParams(4, 0.0))])
    with pytest.raises(RequestError, match="max_concurrent_seqs"):
        eng.generate([GenerationRequest(0, tok("1=")["input_ids"], 5, SamplingParams(4, 0.0))])
    with pytest.raises(RequestError, match="top_p"):
        eng.generate([GenerationRequest(0, tok("1=")["input_ids"], 1, SamplingParams(4, 1.0, top_p=0.0))])
    assert not eng.has_work()
    assert len(eng.generate([GenerationRequest(0, tok("1=")["input_ids"], 2, SamplingParams(4, 0.0))])[0]) == 2


def test_cached_token_budget_bounds_admission(tiny_dir):
    eng, tok = _engine(tiny_dir, max_concurrent_seqs=16, max_cached_tokens=40)
    reqs = [GenerationRequest(i, tok(p)["input_ids"], 2, SamplingParams(6, 1.0)) for i, p in enumerate(PROMPTS)]
    peak = []
    done = []
    for r in reqs:
        eng.submit(r, done.append)
    while eng.has_work():
        eng.step()
        peak.append(eng.scheduler.reserved_tokens)
        assert sum(s.length for s in eng.scheduler.rows) <= 40
    assert len(done) == len(reqs) and max(peak) <= 40 and eng.scheduler.reserved_tokens == 0
    with pytest.raises(RequestError, match="max_cached_tokens"):
        eng.generate([GenerationRequest(0, tok("123+456=")["input_ids"], 4, SamplingParams(8, 0.0))])


def test_a_finished_sequence_frees_its_share_before_its_group_ends(tiny_dir):
    """A group whose siblings end at uneven lengths: once two of its four end, a waiting group of two
    fits the token budget (which holds exactly the long group), joins while the long sibling still
    decodes, and finishes before it."""
    stops = list(range(10, 60))  # a random tiny model hits one of these within a few tokens, unevenly
    tail = None
    for seed in range(20):  # a seed whose group has a long tail: its longest sibling far past its second
        eng, tok = _engine(tiny_dir, max_concurrent_seqs=4)
        req = GenerationRequest(
            0, tok("12+34=")["input_ids"], 4, SamplingParams(40, 1.0, seed=seed, stop_token_ids=stops)
        )
        lengths = sorted(len(s.completion_ids) for s in eng.generate([req])[0])
        if lengths[1] + 8 < lengths[3]:
            tail = req
            break
    assert tail is not None, "no seed of 20 gave a long-tailed group"
    budget = tail.n * (len(tail.prompt_ids) + 40)
    eng, tok = _engine(tiny_dir, max_concurrent_seqs=4, max_cached_tokens=budget)
    short = GenerationRequest(1, tok("1+2=")["input_ids"], 2, SamplingParams(5, 0.0, stop_token_ids=[]))
    order: list[int] = []
    eng.submit(tail, lambda samples: order.append(0))
    eng.submit(short, lambda samples: order.append(1))
    joined_beside = False
    while eng.has_work():
        eng.step()
        rows = {s.group.request.request_id for s in eng.scheduler.rows}
        joined_beside |= rows == {0, 1}
        assert eng.scheduler.reserved_tokens <= budget
    assert joined_beside and order == [1, 0]
    assert eng.scheduler.reserved_tokens == 0


def test_stop_token_ids_and_stop_strings(tiny_dir):
    eng, tok = _engine(tiny_dir)
    prompt = tok("7+8=")["input_ids"]
    free = eng.generate([GenerationRequest(0, prompt, 1, SamplingParams(12, 0.0))])[0][0]
    assert len(free.completion_ids) >= 4
    third = free.completion_ids[2]
    cut = eng.generate([GenerationRequest(0, prompt, 1, SamplingParams(12, 0.0, stop_token_ids=[third]))])[0][0]
    first_hit = free.completion_ids.index(third)
    assert cut.completion_ids == free.completion_ids[: first_hit + 1] and cut.finish_reason == "stop"
    text = tok.decode(free.completion_ids[1:3])
    by_text = eng.generate([GenerationRequest(0, prompt, 1, SamplingParams(12, 0.0, stop=[text]))])[0][0]
    assert text in tok.decode(by_text.completion_ids) and by_text.finish_reason == "stop"
    assert text not in tok.decode(by_text.completion_ids[:-1])
    assert len(by_text.completion_ids) <= 3


def test_keep_sampling_mask_is_compact_and_reads_as_lists(tiny_dir):
    eng, tok = _engine(tiny_dir)
    params = SamplingParams(24, 1.5, top_k=100, top_p=0.95, seed=0)
    s = eng.generate([GenerationRequest(0, tok("3+4=")["input_ids"], 1, params)])[0][0]
    mask = s.sampling_mask
    assert isinstance(mask, KeptIds) and len(mask) == len(s.completion_ids) == 24
    as_lists = [list(m) for m in mask]
    assert all(0 < len(m) <= 100 and m == sorted(m) for m in as_lists) and mask == as_lists
    # each position costs the smaller of 2 bytes per kept id and a 128-bit mask, + offset and kind
    assert mask.nbytes == sum(min(2 * len(m), 16) for m in as_lists) + 4 * 25 + 24
    assert len(pickle.dumps(mask)) < len(pickle.dumps(as_lists)) / 4
    assert pickle.loads(pickle.dumps(mask)) == as_lists
    small = eng.generate([GenerationRequest(0, tok("3+4=")["input_ids"], 1, SamplingParams(6, 1.0, top_k=3))])[0][0]
    assert small.sampling_mask.nbytes == 6 * (2 * 3 + 4 + 1) + 4 and all(len(m) == 3 for m in small.sampling_mask)


def test_async_callers_share_one_loop_and_finish_independently(tiny_dir):
    eng, tok = _engine(tiny_dir, max_concurrent_seqs=8)

    async def main():
        aio = AsyncEngine(eng)
        order = []

        async def call(name, max_new):
            req = GenerationRequest(0, tok("11+22=")["input_ids"], 2, SamplingParams(max_new, 1.0, stop_token_ids=[]))
            out = await aio.generate([req])
            order.append(name)
            return out

        long_task = asyncio.create_task(call("long", 40), name="long")
        await asyncio.sleep(0)
        short = await call("short", 2)
        assert order == ["short"] and not long_task.done()  # the short group did not wait for the long one
        long = await long_task
        events = [e async for e in aio.stream(GenerationRequest(1, tok("1=")["input_ids"], 1, SamplingParams(5, 0.0)))]
        await aio.close()
        return short, long, events

    short, long, events = asyncio.run(main())
    assert all(len(s.completion_ids) <= 2 for s in short[0])
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    final = events[-1][0]
    assert [e.token_id for e in tokens] == final.completion_ids and [e.logprob for e in tokens] == final.logprobs
