import asyncio

import pytest

from nonstop.orchestrator.buffer import RolloutBuffer
from nonstop.types import Group, Sample


def _group(version, idx=0):
    return Group(idx, "p", "a", [Sample([1], [2, 3], [-1.0, -1.0], [version, version + 1], "stop")])


async def _admit_nowait(buf, k):
    """Admit if admission is open now; None if it would wait (that waiting call is withdrawn).

    Decided by the event loop's order, not by a clock: the admit task runs its first step before
    this coroutine resumes, and an open admission returns within that step without suspending."""
    task = asyncio.ensure_future(buf.admit(k))
    await asyncio.sleep(0)
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return None


def test_depth0_is_synchronous():
    async def go():
        buf = RolloutBuffer(groups_per_step=2, depth=0, max_lag=0, max_queued=100)
        assert await _admit_nowait(buf, 2) == 2
        waiting = asyncio.ensure_future(buf.admit(5))
        await asyncio.sleep(0)
        assert not waiting.done()  # the next batch waits for the trainer ...
        await buf.step_done(1)
        assert await waiting == 2  # ... and starts once it published

    asyncio.run(go())


def test_depth1_allows_one_batch_ahead_and_depth_k_more():
    async def go():
        for depth in (1, 3):
            buf = RolloutBuffer(groups_per_step=4, depth=depth, max_lag=depth, max_queued=100)
            admitted = 0
            while (k := await _admit_nowait(buf, 4)) is not None:
                admitted += k
            assert admitted == 4 * (depth + 1)

    asyncio.run(go())


def test_lagging_groups_are_dropped_counted_and_refunded():
    async def go():
        buf = RolloutBuffer(groups_per_step=2, depth=1, max_lag=1, max_queued=100)
        assert await _admit_nowait(buf, 2) == 2
        assert await _admit_nowait(buf, 2) == 2
        await buf.step_done(1)
        await buf.step_done(2)
        await buf.step_done(3)
        for v in (0, 2, 3):  # min versions 0, 2, 3; trainer at 3: lags 3, 1, 0
            await buf.put(_group(v))
        batch = await buf.take()
        assert [g.min_version for g in batch] == [2, 3]
        assert buf.drops == {"max_lag": 1}
        assert buf.refunded == 1

    asyncio.run(go())


def test_refund_tops_up_a_short_batch():
    async def go():
        buf = RolloutBuffer(groups_per_step=2, depth=0, max_lag=0, max_queued=100)
        assert await _admit_nowait(buf, 2) == 2
        await buf.drop(_group(0), "uniform_reward")
        assert await _admit_nowait(buf, 2) == 1  # exactly the refunded group
        assert buf.drops == {"uniform_reward": 1}

    asyncio.run(go())


def test_unbounded_stream_enforces_max_lag():
    async def go():
        buf = RolloutBuffer(groups_per_step=1, depth=None, max_lag=2, max_queued=1000)
        for _ in range(50):
            assert await _admit_nowait(buf, 1) == 1
        for v in range(10):
            await buf.put(_group(v))
        for version in range(1, 9):
            await buf.step_done(version)
        taken = await buf.take()
        lag = buf.policy_version - taken[0].min_version
        assert lag <= 2 and buf.drops["max_lag"] == 6  # versions 0..5 are more than 2 behind 8

    asyncio.run(go())


def test_unbounded_stream_admits_at_most_max_queued_groups_ahead_of_the_trainer():
    """depth None still waits for admission once max_queued groups are admitted and untrained
    (otherwise the producer never yields and admits without end)."""

    async def go():
        buf = RolloutBuffer(groups_per_step=2, depth=None, max_lag=8, max_queued=5)
        assert await _admit_nowait(buf, 4) == 4
        assert await _admit_nowait(buf, 4) == 1
        assert await _admit_nowait(buf, 4) is None
        await buf.step_done(1)  # two groups trained: two more may be admitted
        assert await _admit_nowait(buf, 4) == 2

    asyncio.run(go())


def test_without_refill_a_batch_trains_on_the_groups_with_signal_among_its_prompts():
    async def go():
        buf = RolloutBuffer(groups_per_step=3, depth=0, max_lag=0, max_queued=100, refill=False)
        assert await _admit_nowait(buf, 3) == 3
        await buf.put(_group(0, idx=1))
        await buf.drop(_group(0, idx=2), "uniform_reward")  # no signal: an empty slot, not a refund
        await buf.put(_group(0, idx=3))
        assert await _admit_nowait(buf, 3) is None  # nothing refunded: no extra prompt is generated
        assert [g.prompt_index for g in await buf.take()] == [1, 3]
        assert buf.drops == {"uniform_reward": 1} and buf.refunded == 0
        await buf.step_done(1)
        assert await _admit_nowait(buf, 3) == 3

    asyncio.run(go())


def test_without_refill_a_batch_without_any_signal_is_generated_again():
    async def go():
        buf = RolloutBuffer(groups_per_step=2, depth=0, max_lag=0, max_queued=100, refill=False)
        assert await _admit_nowait(buf, 2) == 2
        take = asyncio.create_task(buf.take())
        for i in range(2):
            await buf.drop(_group(0, idx=i), "uniform_reward")
        assert await _admit_nowait(buf, 2) == 2  # the whole batch's admission came back
        assert not take.done()
        await buf.put(_group(0, idx=7))
        await buf.drop(_group(0, idx=8), "lag_or_error_reasons_refund")  # other drops still refill
        assert await _admit_nowait(buf, 2) == 1
        await buf.put(_group(0, idx=9))
        assert [g.prompt_index for g in await take] == [7, 9]

    asyncio.run(go())


def test_refill_ahead_admits_the_expected_replacements_before_the_drops():
    """Half of the first scored groups were dropped: admission anticipates that share of the groups
    still needed (and a margin), on top of the refunds, instead of waiting for each drop."""

    async def go():
        plain = RolloutBuffer(groups_per_step=4, depth=1, max_lag=2, max_queued=100)
        ahead = RolloutBuffer(groups_per_step=4, depth=1, max_lag=2, max_queued=100, refill_ahead=True)
        for buf in (plain, ahead):
            assert await _admit_nowait(buf, 8) == 8  # two batches: the depth-1 bound
            for i in range(2):
                await buf.put(_group(0, idx=i))
            for i in range(2, 4):
                await buf.drop(_group(0, idx=i), "uniform_reward")
        # drop rate, a moving average over one step's groups (1/4): 0, 0, 1/4, 7/16
        assert ahead.drop_rate == pytest.approx(7 / 16)
        assert await _admit_nowait(plain, 99) == 2  # the refunds only
        # the refunds, and for the 6 groups still needed their expected drops plus a margin of two
        # standard deviations (2 x sqrt(6 x 7/16 x 9/16) = 2.43), capped at a quarter of a batch (1):
        # (6 x 7/16 + 1) / (9/16) = 6.44 -> 6 ahead
        assert await _admit_nowait(ahead, 99) == 2 + 6
        assert await _admit_nowait(ahead, 99) is None

    asyncio.run(go())


def test_refill_ahead_stops_once_enough_groups_arrived_and_caps_the_drop_rate():
    async def go():
        buf = RolloutBuffer(groups_per_step=2, depth=1, max_lag=2, max_queued=100, refill_ahead=True)
        assert await _admit_nowait(buf, 4) == 4
        for i in range(4):
            await buf.drop(_group(0, idx=i), "reward_error")
        # drop rate 15/16, capped at 3/4; margin capped at half a group: (4 x 3/4 + 0.5) / (1/4) = 14 ahead
        assert await _admit_nowait(buf, 99) == 4 + 14
        for i in range(5):  # one more than the two batches the bound asks for
            await buf.put(_group(0, idx=10 + i))
        assert await _admit_nowait(buf, 99) is None  # nothing still needed: no admission ahead
        await buf.step_done(1)
        assert len(await buf.take()) == 2

    asyncio.run(go())


def test_refill_ahead_needs_a_bounded_depth_of_at_least_one():
    for depth in (0, None):
        with pytest.raises(ValueError, match="refill_ahead needs a bounded depth of at least 1"):
            RolloutBuffer(groups_per_step=2, depth=depth, max_lag=2, max_queued=100, refill_ahead=True)


def test_take_hands_the_first_groups_ahead_while_it_waits_for_the_rest():
    async def go():
        buf = RolloutBuffer(groups_per_step=4, depth=1, max_lag=2, max_queued=100)
        parts = []
        arrived = asyncio.Event()

        async def ahead(part):
            parts.append([g.prompt_index for g in part])
            arrived.set()

        for i in (0, 1):
            await buf.put(_group(0, i))
        taking = asyncio.ensure_future(buf.take(ahead, ahead_min=2))
        await arrived.wait()  # the queue ran dry at two groups: they go ahead, once
        assert parts == [[0, 1]] and not taking.done()
        await buf.put(_group(0, 2))
        await asyncio.sleep(0)
        assert parts == [[0, 1]]  # one new group is under ahead_min
        await buf.put(_group(0, 3))
        assert [g.prompt_index for g in await taking] == [0, 1, 2, 3]  # the batch is the one take forms without it
        assert parts == [[0, 1]]  # a whole batch goes to the step, not ahead

        for i in (4, 5, 6, 7):  # the batch already there: nothing goes ahead
            await buf.put(_group(0, i))
        assert [g.prompt_index for g in await buf.take(ahead, ahead_min=1)] == [4, 5, 6, 7]
        assert parts == [[0, 1]]

    asyncio.run(go())


def test_a_held_admission_opens_the_next_batch_only_when_released():
    async def go():
        for depth in (0, 1):
            buf = RolloutBuffer(groups_per_step=2, depth=depth, max_lag=2, max_queued=100)
            admitted = 0
            while (k := await _admit_nowait(buf, 2)) is not None:
                admitted += k
            assert admitted == 2 * (depth + 1)
            buf.hold_admission()  # a step that evaluates begins
            await buf.refund(1)  # a group of the batches admitted so far is replaced while held
            assert await _admit_nowait(buf, 2) == 1
            await buf.step_done(1)  # the step ends: without the hold the next batch would start now
            assert await _admit_nowait(buf, 2) is None
            assert buf.policy_version == 1  # the max-lag rule counts from the new version all the same
            waiting = asyncio.ensure_future(buf.admit(2))
            await asyncio.sleep(0)
            assert not waiting.done()
            await buf.release_admission()  # the evaluation ended
            assert await waiting == 2

    asyncio.run(go())
