"""The discrete-event model of a run: engines, trainer ranks, the buffer and weight sync.

`simulate(params, shape, seed)` plays a run of `shape.steps` trainer steps with the costs of
`params` (planner/params.py) and returns a `Prediction`: samples/s generated, engine and
trainer idle fractions and the per-token lag histogram, measured over the same window the real
run is measured on (RL start to the last publish). docs/planning.md states the equations.

The model, as docs/planning.md states it: admission bounded by depth (or max_queued) plus
refunds, one admission's calls sent together; engines as continuous batching on one event loop
(an idle one wakes after reading its calls, a busy one takes a call `pickup_passes` + 1
boundaries after it arrives and answers `return_passes` passes after a group's last token);
the orchestrator as one first-come-first-served server (answers, pauses, the learning loop's
work, sending calls); the trainer taking batches in arrival order under max_lag; with `cores`,
busy actors sharing the processors. Engines advance in macro steps: between two changes every
pass has the same rows and cost, so a 32K-token completion is a few events, not 32K.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import random
from collections import Counter, deque
from dataclasses import dataclass, field

from nonstop.engine.blocks import attention_reads
from nonstop.orchestrator.buffer import refill_ahead_groups
from nonstop.planner.params import PlanParams, Prediction, Shape
from nonstop.planner.trainer_side import TrainerSide


@dataclass
class SimGroup:
    lens: list[int]
    remaining: int = 0
    versions: Counter[int] = field(default_factory=Counter)
    min_version: int = 0
    engine: SimEngine | None = None  # the engine it was sent to


@dataclass
class SimEngine:
    index: int
    waiting: deque[SimGroup] = field(default_factory=deque)
    arriving: list[list] = field(default_factory=list)  # [group, boundaries before it may join]: not yet submitted
    # heap of (end pass, id, start pass, group)
    rows: list[tuple[int, int, int, SimGroup]] = field(default_factory=list)
    passes: int = 0  # passes completed
    version: int = 0
    marks: list[int] = field(default_factory=lambda: [0])  # pass index from which marks_v[i] holds
    marks_v: list[int] = field(default_factory=lambda: [0])
    in_flight: int = 0  # samples admitted to this engine and not yet finished
    gen: int = 0  # plan generation: stale events are ignored
    t_start: float = 0.0
    tau: float = 0.0
    end: float | None = None  # when the current plan ends (None: idle)
    wake_at: float | None = None  # an idle engine that got a call starts its first pass then
    busy_s: float = 0.0


class Simulation(TrainerSide):
    def __init__(self, p: PlanParams, shape: Shape, seed: int = 0) -> None:
        if not p.groups_lens and not (p.len_median > 0 and p.len_max > 0):
            raise ValueError("the planner needs completion lengths: groups_lens, or len_median and len_max")
        self.p, self.s, self.rng = p, shape, random.Random(seed)
        self.events: list[tuple[float, int, str, object]] = []
        self.order = itertools.count()
        self.t = 0.0
        self.engines = [SimEngine(i) for i in range(shape.engines)]
        self.admitted = self.refunded = self.steps = self.trained_groups = 0
        self.delivered = 0  # groups buffered for the trainer, less those it dropped for lag
        self.drop_rate = 0.0  # the buffer's moving average of scored groups dropped (refill_ahead)
        self.queue: deque[SimGroup] = deque()
        self.batch: list[SimGroup] = []
        self.trainer_version = self.published = 0
        self.trainer_busy = False
        self.trainer_waiting = True
        self.trainer_busy_s = 0.0
        self.in_ahead = False  # the trainer runs forwards ahead of its batch (trainer.forward_ahead)
        self.handed = 0  # the batch's groups whose forward ran ahead
        self.ahead_done = 0.0  # uncontended seconds of the coming step already done ahead
        self.step_left = 0.0  # uncontended seconds of the step under way
        self.step_since = self.step_start = 0.0
        self.step_speed = 1.0
        self.step_gen = 0
        self.orch_free = 0.0  # the orchestrator is busy until then
        self.handling: list[SimGroup] = []  # finished groups in the orchestrator's current busy stretch
        self.until_pause = self.rng.random() * p.pause_every  # groups handled before its next pause
        self.samples_done: list[tuple[float, int]] = []
        self.lag: Counter[int] = Counter()
        self.dropped_for_lag = 0
        self.last_publish = 0.0

    # -- event plumbing -------------------------------------------------------------------

    def at(self, t: float, kind: str, arg: object = None) -> None:
        heapq.heappush(self.events, (t, next(self.order), kind, arg))

    def run(self) -> Prediction:
        self.admit()
        while self.events and self.steps < self.s.steps:
            self.t, _, kind, arg = heapq.heappop(self.events)
            getattr(self, f"on_{kind}")(arg)
        wall = self.last_publish
        samples = sum(n for t, n in self.samples_done if t <= wall)
        engines = sum(min(e.busy_s, wall) for e in self.engines) / max(len(self.engines), 1)
        return Prediction(
            samples / wall if wall > 0 else 0.0,
            1 - engines / wall if wall else 0.0,
            1 - self.trainer_busy_s / wall if wall else 0.0,
            dict(sorted(self.lag.items())),
            wall,
            self.dropped_for_lag,
        )

    # -- producer and buffer --------------------------------------------------------------

    def limit(self) -> float:
        if self.s.depth is None:
            return self.steps * self.s.prompts_per_step + self.s.max_queued + self.refunded
        bound = (self.steps + self.s.depth + 1) * self.s.prompts_per_step
        if not self.s.refill_ahead:
            return bound + self.refunded
        return (
            bound + self.refunded + refill_ahead_groups(bound - self.delivered, self.drop_rate, self.s.prompts_per_step)
        )

    def admit(self) -> None:
        while self.limit() - self.admitted >= 1:
            k = int(min(self.s.prompts_per_step, self.limit() - self.admitted))
            self.admitted += k
            free = max(self.t, self.orch_free)  # the producer runs when the event loop is free
            first = self.rng.choice(self.p.admit_delays) if self.p.admit_delays else self.p.admit_delay_s
            for j in range(k):  # one admission's calls are sent one after another, in one turn
                self.at(free + first + j * self.p.admit_gap_s, "dispatch", SimGroup(self.sample_lens()))
            if self.p.send_s > 0:  # sending the calls keeps the event loop busy (the delays above include it)
                self.orchestrate(self.p.send_s * k)

    def sample_lens(self) -> list[int]:
        g = self.s.group_size
        if not self.p.groups_lens:
            mu = math.log(self.p.len_median)
            return [min(self.p.len_max, max(1, round(self.rng.lognormvariate(mu, self.p.len_sigma)))) for _ in range(g)]
        lens = self.rng.choice(self.p.groups_lens)
        return list(lens) if len(lens) == g else [self.rng.choice(lens) for _ in range(g)]

    def on_dispatch(self, g: SimGroup) -> None:
        e = min(self.engines, key=lambda x: (x.in_flight, x.index))
        e.in_flight += len(g.lens)
        g.engine = e
        if e.end is None and not e.rows and self.p.wake_s + self.p.wake_call_s > 0:
            e.waiting.append(g)  # an idle engine reads the calls waiting for it before its first pass
            e.wake_at = (self.t + self.p.wake_s if e.wake_at is None else e.wake_at) + self.p.wake_call_s
            e.gen += 1
            self.at(e.wake_at, "wake", (e, e.gen))
            return
        if self.p.pickup_passes and e.end is not None:
            e.arriving.append([g, self.p.pickup_passes])  # joins at boundary pickup_passes + 1 from now
        else:
            e.waiting.append(g)
        self.interrupt(e)

    def on_deliver(self, g: SimGroup) -> None:
        dropped = self.rng.random() < self.p.drop_frac
        self.drop_rate += (float(dropped) - self.drop_rate) / self.s.prompts_per_step
        if dropped:
            self.refunded += 1
            self.admit()
            return
        self.delivered += 1
        self.queue.append(g)
        self.take()

    # -- engines --------------------------------------------------------------------------

    def interrupt(self, e: SimEngine) -> None:
        """Something changed for `e`: it re-plans at its next pass boundary (now, if idle)."""
        if e.end is None:
            if e.wake_at is None:  # a waking engine plans when it wakes
                self.plan(e)
            return
        # passes completed by the next boundary (none while a weight apply still runs before the plan)
        done = max(0, math.ceil((self.t - e.t_start) / e.tau - 1e-9)) if e.tau > 0 else 0
        boundary = e.t_start + done * e.tau
        if boundary >= e.end - 1e-12:
            return  # the plan already ends at the next boundary
        e.gen += 1
        e.end = boundary
        self.at(boundary, "engine", (e, e.gen, e.passes + done))

    def on_wake(self, arg: tuple[SimEngine, int]) -> None:
        e, gen = arg
        if gen != e.gen:
            return  # another call reached it first: it reads that one too
        e.wake_at = None
        self.plan(e)

    def on_engine(self, arg) -> None:
        e, gen, passes = arg
        if gen != e.gen:
            return
        e.busy_s += self.t - e.t_start
        e.passes = passes
        self.plan(e)

    def plan(self, e: SimEngine) -> None:
        finished = []
        while e.rows and e.rows[0][0] <= e.passes:
            _, _, start, g = heapq.heappop(e.rows)
            self.count_tokens(e, g, start, e.passes)
            g.remaining -= 1
            if g.remaining == 0:
                finished.append(g)
        t = self.t
        if self.published > e.version and (e.rows or e.waiting):
            e.version = self.published
            e.marks.append(e.passes)
            e.marks_v.append(e.version)
            t += self.p.apply_s
        self.join(e)
        for a in e.arriving:  # one more boundary passed: those due join at the next one
            a[1] -= 1
        e.waiting.extend(g for g, left in e.arriving if left <= 0)
        e.arriving = [a for a in e.arriving if a[1] > 0]
        if not e.rows:  # an engine with nothing to decode takes them at once (its loop is free)
            e.waiting.extend(g for g, _ in e.arriving)
            e.arriving.clear()
            self.join(e)
        if not e.rows:
            e.busy_s += t - self.t
            self.returned(finished)
            if e.end is not None:
                e.end = None
                self.busy_changed(e)
            return
        was_idle = e.end is None
        e.end = t  # busy from here on, so sharing() counts it
        b = len(e.rows)
        pending = (e.waiting or e.arriving) and self.p.pickup_passes
        stop = min(e.rows[0][0], e.passes + 1) if pending else e.rows[0][0]
        # every row's keys grow by one a pass and the blocks keep their rows: the plan's mean reads
        reads = self.reads(e) + b * (stop - e.passes - 1) / 2 if self.p.pass_read_s else 0.0
        e.tau = (self.p.pass_s + self.p.pass_row_s * b + self.p.pass_read_s * reads) * self.sharing()
        e.busy_s += t - self.t  # the apply
        e.t_start = t
        e.gen += 1
        e.end = t + (stop - e.passes) * e.tau
        self.at(e.end, "engine", (e, e.gen, stop))
        if finished:  # the engine's loop runs its next pass before it sends the answers
            self.at(t + self.p.return_passes * e.tau, "returned", finished)
        if was_idle:
            self.busy_changed(e)

    def reads(self, e: SimEngine) -> float:
        """Cached positions the next decode pass of `e` reads (engine/blocks.py), its rows in
        descending length as the engine keeps them."""
        base = self.p.prompt_len + e.passes + 1
        return attention_reads(sorted((round(base - start) for _, _, start, _ in e.rows), reverse=True))

    def on_returned(self, finished: list[SimGroup]) -> None:
        self.returned(finished)

    def returned(self, finished: list[SimGroup]) -> None:
        """Finished groups' answers reach the orchestrator: it handles each, first come first served."""
        for g in finished:
            assert g.engine is not None  # sent before it finished
            g.engine.in_flight -= len(g.lens)
            self.samples_done.append((self.t, len(g.lens)))
            self.orchestrate(self.p.orch_group_s)
            self.handling.append(g)  # buffered when this busy stretch of the orchestrator ends
            self.until_pause -= 1
            if self.p.pause_every > 0 and self.until_pause <= 0:
                self.until_pause += self.p.pause_every
                self.orchestrate(self.p.pause_s)

    def join(self, e: SimEngine) -> None:
        """Waiting groups whose rows fit join the batch at this pass boundary."""
        while e.waiting and len(e.rows) + len(e.waiting[0].lens) <= self.s.slots:
            g = e.waiting.popleft()
            g.remaining, g.min_version = len(g.lens), e.version
            for n in g.lens:
                heapq.heappush(e.rows, (e.passes + max(n, 1), next(self.order), e.passes, g))

    def sharing(self) -> float:
        """How much slower every actor runs because busy actors outnumber the cores (1: not at all)."""
        if self.p.cores is None:
            return 1.0
        busy = (
            sum(e.end is not None for e in self.engines)
            + self.s.trainer_ranks * self.trainer_busy
            + (self.t < self.orch_free)
        )
        return max(1.0, busy / self.p.cores)

    def busy_changed(self, source: SimEngine | None = None) -> None:
        """An actor started or stopped: with shared cores every busy actor's pace changes."""
        if self.p.cores is None:
            return
        for e in self.engines:
            if e is not source and e.end is not None:
                self.interrupt(e)
        self.replan_step()

    # -- orchestrator ---------------------------------------------------------------------

    def orchestrate(self, cost: float) -> float:
        """Queue `cost` seconds of the orchestrator's work; returns when it is done."""
        idle = self.orch_free <= self.t
        self.orch_free = max(self.t, self.orch_free) + max(cost, 0.0)
        self.at(self.orch_free, "orch_idle", self.orch_free)
        if idle and cost > 0:
            self.busy_changed()
        return self.orch_free

    def on_orch_idle(self, until: float) -> None:
        if until == self.orch_free:  # no work queued behind it: the stretch ends
            for g in self.handling:
                self.at(self.t + self.p.deliver_delay_s, "deliver", g)
            self.handling = []
            self.busy_changed()

    @staticmethod
    def count_tokens(e: SimEngine, g: SimGroup, start: int, end: int) -> None:
        """Tokens of one row, made at passes start..end-1, by the version live at each pass."""
        i = bisect.bisect_right(e.marks, start) - 1
        while start < end:
            stop = e.marks[i + 1] if i + 1 < len(e.marks) else end
            if min(stop, end) > start:
                g.versions[e.marks_v[i]] += min(stop, end) - start
            start = max(start, min(stop, end))
            i += 1


def simulate(params: PlanParams, shape: Shape, seed: int = 0) -> Prediction:
    return Simulation(params, shape, seed).run()
