"""The scoring stage: concurrency, timeouts, retries, failures counted by reason, backpressure."""

import asyncio
import math
import os
import threading
import time

import pytest

from nonstop.config import LocalRuntimeConfig, ScoringConfig, load_config
from nonstop.runtime.local import LocalBackend
from nonstop.scoring.compose import build_scorer
from nonstop.scoring.rewards import RewardError, exact_match, partial_credit, resolve_reward
from nonstop.scoring.runners import make_runner
from nonstop.scoring.stage import FunctionComponent, ScoringStage, percentile
from nonstop.types import Group, Sample


def _group(texts, answer="42", index=0, extra=None):
    samples = [Sample([1], [5], [-0.1], [0], "stop", text=t) for t in texts]
    return Group(index, "40+02=", answer, samples, extra=extra or {})


def _stage(fn, backend=None, **scoring):
    cfg = ScoringConfig(**scoring)
    runner = make_runner(cfg, backend, print)
    return ScoringStage([FunctionComponent("reward", fn, fn, runner, cfg.timeout_s)], cfg, runner)


def test_builtin_rewards():
    assert exact_match(" 42 ", "42") == 1.0 and exact_match("43", "42") == 0.0
    assert partial_credit("42", "42") == 1.0
    assert partial_credit("43", "42") == pytest.approx(0.25)
    assert partial_credit("", "42") == 0.0


def test_resolve_reward_by_import_path_and_errors():
    assert resolve_reward("exact_match") is exact_match
    assert resolve_reward("nonstop.scoring.rewards:partial_credit") is partial_credit
    # the built-ins' name before they moved to scoring/: a config.yaml written then still resumes
    assert resolve_reward("nonstop.orchestrator.score:partial_credit") is partial_credit
    with pytest.raises(RewardError, match="task.reward: unknown reward"):
        resolve_reward("nope")
    with pytest.raises(RewardError, match="cannot import"):
        resolve_reward("nonstop.scoring.rewards:missing")


def test_percentile_nearest_rank():
    xs = [float(i) for i in range(1, 101)]
    assert percentile(xs, 0.5) == 50.0 and percentile(xs, 0.99) == 99.0 and percentile([], 0.5) == 0.0


@pytest.mark.parametrize("pool", ["loop", "thread"])
def test_raising_and_non_finite_rewards_are_counted_and_group_dropped(pool):
    def flaky(completion, answer):
        if completion == "boom":
            raise ZeroDivisionError("bad")
        return math.nan if completion == "nan" else 1.0

    async def go():
        stage = _stage(flaky, pool=pool)
        await stage.start()
        assert await stage.score(_group(["42", "1"])) is True
        assert await stage.score(_group(["42", "boom", "boom"])) is False
        assert await stage.score(_group(["nan", "1"])) is False
        await stage.close()
        return stage

    stage = asyncio.run(go())
    assert stage.errors == {"reward_raised": 2, "reward_not_finite": 1}
    assert "ZeroDivisionError" in stage.last_error or "nan" in stage.last_error


def test_fail_fast_raises_at_the_first_failing_group():
    async def go():
        cfg = ScoringConfig(pool="loop")
        fn = lambda c, a: math.inf if c == "x" else 0.0  # noqa: E731
        stage = ScoringStage(
            [FunctionComponent("reward", fn, fn, make_runner(cfg, None, print), 1.0)], cfg, fail_fast=True
        )
        assert await stage.score(_group(["y", "z"])) is True
        with pytest.raises(RewardError, match=r"inf(.|\n)*task.reward_fail_fast"):
            await stage.score(_group(["y", "x"]))

    asyncio.run(go())


def test_thread_pool_scores_groups_concurrently_and_off_the_loop():
    """Eight groups of a 50 ms reward overlap; the loop keeps ticking while they run."""
    live, peak = [0], [0]
    lock = threading.Lock()

    def slow(completion, answer):
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        time.sleep(0.05)
        with lock:
            live[0] -= 1
        return 1.0

    async def go():
        stage = _stage(slow, pool="thread", concurrency=16)
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.005)
                ticks += 1

        t = asyncio.get_running_loop().create_task(ticker(), name="ticker")
        results = await asyncio.gather(*(stage.score(_group(["a", "b"], index=i)) for i in range(8)))
        t.cancel()
        m = stage.metrics()
        await stage.close()
        return results, ticks, m

    results, ticks, m = asyncio.run(go())
    assert all(results)
    assert peak[0] >= 8  # 16 samples in flight at most; at least half overlapped
    assert ticks >= 5  # the loop was never blocked for the whole scoring
    assert m["reward_latency_p50_s"] >= 0.05 and m["scoring_pending"] == 0 and m["scoring_pending_peak"] == 8


def test_a_slow_rewards_rows_run_side_by_side_and_a_cheap_ones_as_one_job():
    """PooledCalls: a group's rows go to the pool as one job until the function measures slower
    than SPLIT_ROW_S per row, then as one job per row on separate threads; a cheap function keeps
    one job per group. Outcomes stay in row order either way."""
    from nonstop.scoring.calls import SPLIT_ROW_S, PooledCalls
    from nonstop.scoring.threads import DaemonThreads
    from nonstop.types import RewardRow

    seen: dict[str, list[set[str]]] = {"slow": [], "cheap": []}

    def make(name, sleep_s):
        def fn(completion, answer):
            seen[name][-1].add(threading.current_thread().name)
            time.sleep(sleep_s)
            return float(completion)

        return fn

    slow, cheap = make("slow", 5 * SPLIT_ROW_S), make("cheap", 0.0)
    rows = [RewardRow("p", str(i), "a", {}) for i in range(8)]

    async def go():
        calls = PooledCalls(DaemonThreads(8, "test-reward"))
        for name, fn in (("slow", slow), ("cheap", cheap)):
            for _ in range(3):
                seen[name].append(set())
                assert await calls("sample", fn, rows) == [float(i) for i in range(8)]
        calls.threads.shutdown()
        return calls

    calls = asyncio.run(go())
    assert len(seen["slow"][0]) == 1 and all(len(threads) > 1 for threads in seen["slow"][1:]), seen
    assert all(len(threads) == 1 for threads in seen["cheap"]), seen
    assert calls.splits(slow) and not calls.splits(cheap)


def test_daemon_threads_hand_back_a_batch_in_order_with_its_first_error():
    """run_all: results in call order; a raising call fails the batch with its exception; a batch
    abandoned by a timeout finishes in its threads without disturbing the loop."""
    from nonstop.scoring.threads import DaemonThreads

    def slow_square(i):
        time.sleep(0.01 * (4 - i))  # the first call finishes last
        return i * i

    def boom():
        raise KeyError("bad row")

    async def go():
        pool = DaemonThreads(4, "test-batch")
        assert await pool.run_all([lambda: 1]) == [1] and len(pool.threads) == 1  # threads start as needed
        assert await pool.run_all([lambda i=i: slow_square(i) for i in range(4)]) == [0, 1, 4, 9]
        assert len(pool.threads) == 4
        assert await pool.run_all([lambda: time.sleep(0.01) for _ in range(6)]) == [None] * 6
        assert len(pool.threads) == 4  # the cap
        assert await pool.run_all([]) == []
        with pytest.raises(KeyError, match="bad row"):
            await pool.run_all([lambda: 1, boom])
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(pool.run_all([lambda: time.sleep(0.2)]), 0.01)
        await asyncio.sleep(0.3)  # the abandoned call ends meanwhile; its result goes nowhere
        assert await pool.run_all([lambda: "still serving"]) == ["still serving"]
        pool.shutdown()

    asyncio.run(go())


def test_loop_pool_blocks_the_loop():
    """The comparison point of bench/scoring.py: scoring on the loop stops everything else."""

    async def go():
        stage = _stage(lambda c, a: time.sleep(0.05) or 1.0, pool="loop")
        t0 = time.perf_counter()
        await asyncio.gather(*(stage.score(_group(["a", "b"], index=i)) for i in range(4)))
        return time.perf_counter() - t0

    assert asyncio.run(go()) >= 4 * 2 * 0.05


def test_thread_timeout_is_counted_retried_and_the_stage_goes_on():
    calls = []

    def hang_first(completion, answer):
        calls.append(completion)
        if len(calls) == 1:
            time.sleep(1.0)
        return 1.0

    async def go():
        stage = _stage(hang_first, pool="thread", timeout_s=0.2, retries=1)
        ok = await stage.score(_group(["a"]))
        never = _stage(lambda c, a: time.sleep(1.0) or 1.0, pool="thread", timeout_s=0.1, retries=2)
        bad = await never.score(_group(["a"]))
        await stage.close()
        await never.close()
        return stage, ok, never, bad

    stage, ok, never, bad = asyncio.run(go())
    assert ok and stage.retried == {"reward_timeout": 1} and not stage.errors
    assert not bad and never.retried == {"reward_timeout": 2} and never.errors == {"reward_timeout": 1}
    assert "did not return within 0.1 s" in never.last_error


def test_backpressure_holds_admission_while_groups_wait():
    async def go():
        release = asyncio.Event()

        async def gated(completion, answer):
            await release.wait()
            return 1.0

        stage = _stage(gated, pool="thread", max_pending_groups=2)
        tasks = [
            asyncio.get_running_loop().create_task(stage.score(_group(["a"], index=i)), name=f"g{i}") for i in range(2)
        ]
        await asyncio.sleep(0.05)
        waiting = asyncio.get_running_loop().create_task(stage.ready(), name="admission")
        await asyncio.sleep(0.05)
        held = not waiting.done()
        release.set()
        await asyncio.wait_for(waiting, 1.0)
        await asyncio.gather(*tasks)
        return held

    assert asyncio.run(go())


def test_keyword_arguments_extra_fields_async_and_group_rewards(tmp_path):
    cfg = load_config(
        overrides=[
            "task.reward=support.scoring_helpers:kwargs_reward",
            "scoring.group_reward=support.scoring_helpers:rank_reward",
            "scoring.group_reward_weight=10",
        ]
    )

    async def go():
        stage = build_scorer(cfg, None, lambda ids: "")
        await stage.start()
        g = _group(["1", "22", "333"], extra={"difficulty": 3, "source": "x"})
        ok = await stage.score(g)
        a = build_scorer(
            load_config(overrides=["task.reward=support.scoring_helpers:async_reward"]), None, lambda ids: ""
        )
        g2 = _group(["42", "41"])
        ok2 = await a.score(g2)
        bad = build_scorer(
            load_config(overrides=["scoring.group_reward=support.scoring_helpers:wrong_count"]), None, lambda ids: ""
        )
        ok3 = await bad.score(_group(["1", "2"]))
        return g, ok, g2, ok2, ok3, bad

    g, ok, g2, ok2, ok3, bad = asyncio.run(go())
    assert ok and [s.reward for s in g.samples] == [3.52, 13.52, 23.52]
    assert ok2 and [s.reward for s in g2.samples] == [1.0, 0.0]
    assert not ok3 and bad.errors == {"group_reward_bad_output": 1}
    assert "returned 1 values for 2 samples" in bad.last_error


def test_calling_conventions_hold_for_callable_objects_builtins_and_repeated_calls():
    """A function's parameters decide how it is called, at every call (the signature is inspected
    once per function): a callable object that does not hash, a builtin without a signature
    (called as fn(completion, answer)), and two functions of the same name but other parameters."""
    from nonstop.scoring.calls import sample_call
    from nonstop.types import RewardRow

    class Scorer:  # defines __eq__ without __hash__: unhashable
        def __eq__(self, other):
            return self is other

        def __call__(self, completion, prompt):
            return float(prompt.endswith("=")) + len(completion)

    row = RewardRow("1+1=", "abc", "2", {"level": 3})

    def by_keyword(completion, level):
        return float(level)

    def legacy(c, a):
        return float(a == "2")

    for _ in range(3):
        assert sample_call(Scorer(), row) == 4.0
        assert sample_call(by_keyword, row) == 3.0
        assert sample_call(legacy, row) == 1.0
        assert sample_call(max, row) == "abc"  # no signature: max("abc", "2")
    by_keyword = lambda completion, **kw: float(len(kw))  # noqa: E731 (same name, other parameters)
    assert sample_call(by_keyword, row) == 4.0  # prompt, answer, extra and level


def test_process_pool_replaces_hung_and_dead_workers(tmp_path, monkeypatch):
    """A hang past its timeout kills the worker; a worker that dies is replaced; both are retried."""
    monkeypatch.setenv("NONSTOP_TEST_FLAGS", str(tmp_path))

    async def go():
        backend = LocalBackend(LocalRuntimeConfig())
        try:
            cfg = load_config(
                overrides=[
                    "task.reward=support.scoring_helpers:fault_once",
                    "scoring.pool=process",
                    "scoring.workers=1",
                    "scoring.timeout_s=3",
                    "scoring.retries=1",
                ]
            )
            stage = build_scorer(cfg, backend, lambda ids: "")
            await stage.start()
            first = stage.runner.pool.alive()[0]
            hung = await stage.score(_group(["a", "b"], answer="7"))
            replaced = stage.runner.pool.alive()[0] is not first and not first.is_alive()
            died = await stage.score(_group(["a"], answer="8"))
            fine = await stage.score(_group(["a"], answer="9"))
            return stage, (hung, died, fine), replaced
        finally:
            await backend.shutdown()

    stage, oks, replaced = asyncio.run(go())
    assert all(oks) and replaced and not stage.errors
    assert stage.retried == {"reward_timeout": 1, "reward_worker_died": 1}
    assert stage.runner.pool.restarts == 2


def test_process_pool_refuses_a_lambda_with_the_fix():
    cfg = load_config(overrides=["scoring.pool=process"])
    with pytest.raises(RewardError, match="cannot be sent to worker processes.*scoring.pool=thread"):
        build_scorer(cfg, LocalBackend(LocalRuntimeConfig()), lambda ids: "", reward=lambda c, a: 1.0)


def test_auto_pool_moves_a_slow_sync_reward_to_worker_processes_and_keeps_the_rest_on_threads():
    """Pool 'auto': a function measured slower than 2 ms per sample moves to worker processes once
    they are up (its rewards then carry another process id); a cheap one, and a slow lambda that
    cannot reach the workers, stay in this process; each decision is said once in the log."""
    from nonstop.scoring.runners import AutoRunner
    from support.scoring_helpers import slow_pid

    me = float(os.getpid())

    async def go():
        backend = LocalBackend(LocalRuntimeConfig())
        lines: list[str] = []
        try:
            cfg = ScoringConfig(pool="auto", workers=1)
            runner = make_runner(cfg, backend, lines.append)
            assert isinstance(runner, AutoRunner)
            slow_lambda = lambda c, a: time.sleep(0.005) or float(os.getpid())  # noqa: E731
            parts = [
                FunctionComponent("reward", "support.scoring_helpers:slow_pid", slow_pid, runner, 30.0),
                FunctionComponent("cheap", "exact_match", exact_match, runner, 30.0),
                FunctionComponent("local", slow_lambda, slow_lambda, runner, 30.0),
            ]
            stage = ScoringStage(parts, cfg, runner)
            seen: list[set[float]] = []
            for i in range(200):
                g = _group(["42", "x", "42", "y"], index=i)
                assert await stage.score(g)
                seen.append({s.reward - (1.0 if s.text == "42" else 0.0) for s in g.samples})
                if runner.process is not None and len(seen) > 3 and seen[-1] != seen[-2]:
                    break
                await asyncio.sleep(0.02)  # the workers start meanwhile
            moved = runner.process is not None
            await stage.close()
            return seen, moved, runner, lines
        finally:
            await backend.shutdown()

    seen, moved, runner, lines = asyncio.run(go())
    assert moved and len(runner.moved) == 1 and len(runner.kept) == 1
    # reward + local: the slow_pid part is this process's id at first, the worker's in the end
    assert seen[0] == {2 * me} and len(seen[-1]) == 1 and seen[-1] != {2 * me}
    assert sum("move to 1 worker processes" in x for x in lines) == 1
    assert sum("stays on threads" in x and "cannot be sent" in x for x in lines) == 1
