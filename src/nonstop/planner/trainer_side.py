"""The trainer's half of the planner's discrete-event model (planner/model.py).

`TrainerSide` is a mixin of `Simulation`: it takes batches from the buffer in arrival order under
max_lag, runs the forwards ahead of a batch that is not whole (trainer.forward_ahead), plays each
step as uncontended work slowed by the busy actors sharing the cores, then the loop's hand-off, the
publish, and an evaluation every `eval_every` steps. Its methods read and change the simulation's
state; the event handlers are the `on_*` methods the simulation's loop dispatches to.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import TYPE_CHECKING

from nonstop.planner.params import PlanParams, Shape

if TYPE_CHECKING:
    from nonstop.planner.model import SimEngine, SimGroup


class TrainerSide:
    # the simulation's state this half reads and changes (Simulation.__init__ sets every field)
    p: PlanParams
    s: Shape
    t: float
    engines: list[SimEngine]
    queue: deque[SimGroup]
    batch: list[SimGroup]
    steps: int
    trained_groups: int
    delivered: int
    refunded: int
    dropped_for_lag: int
    published: int
    last_publish: float
    lag: Counter[int]
    trainer_version: int
    trainer_busy: bool
    trainer_waiting: bool
    trainer_busy_s: float
    in_ahead: bool
    handed: int
    ahead_done: float
    step_left: float
    step_since: float
    step_start: float
    step_speed: float
    step_gen: int

    if TYPE_CHECKING:  # the simulation's own methods this half calls (planner/model.py)

        def at(self, t: float, kind: str, arg: object = None) -> None: ...
        def admit(self) -> None: ...
        def orchestrate(self, cost: float) -> float: ...
        def interrupt(self, e: SimEngine) -> None: ...
        def sharing(self) -> float: ...

    def take(self) -> None:
        if not self.trainer_waiting or self.in_ahead:
            return
        while self.queue and len(self.batch) < self.s.prompts_per_step:
            g = self.queue.popleft()
            if self.s.max_lag is not None and self.published - g.min_version > self.s.max_lag:
                self.dropped_for_lag += 1
                self.delivered -= 1
                self.refunded += 1
                self.admit()
                continue
            self.batch.append(g)
        if len(self.batch) == self.s.prompts_per_step:
            self.trainer_waiting = False
            samples = sum(len(g.lens) for g in self.batch)
            self.at(self.orchestrate(self.p.call_sample_s * samples), "step_start")
        elif self.s.forward_ahead and self.p.ahead_frac > 0 and len(self.batch) > self.handed:
            # the queue ran dry before the batch is whole: the trainer runs the forwards of the groups
            # it holds, and takes more only after them (orchestrator/buffer.py take)
            tokens = sum(sum(g.versions.values()) for g in self.batch[self.handed :])
            self.handed = len(self.batch)
            cost = self.p.ahead_frac * self.p.step_token_s * tokens
            self.ahead_done += cost
            self.in_ahead = True
            self.work(cost)

    def on_step_start(self, _: object) -> None:
        tokens = sum(sum(g.versions.values()) for g in self.batch)
        self.work(max(self.p.step_s + self.p.step_token_s * tokens / self.s.trainer_ranks - self.ahead_done, 0.0))
        self.handed, self.ahead_done = 0, 0.0

    def work(self, seconds: float) -> None:
        """The trainer starts `seconds` of uncontended work: a step, or forwards run ahead of one."""
        self.step_left = seconds
        self.step_start = self.step_since = self.t
        self.step_speed = 1.0
        self.set_trainer_busy(True)
        self.replan_step()
        if seconds <= 0:  # nothing left to do (replan_step schedules nothing then)
            self.step_gen += 1
            self.at(self.t, "step_end", self.step_gen)

    def replan_step(self) -> None:
        """The step's remaining work at the current pace (actors busy now)."""
        if not self.trainer_busy or self.step_left <= 0:
            return
        self.step_left -= (self.t - self.step_since) * self.step_speed
        self.step_since = self.t
        self.step_speed = 1.0 / self.sharing()
        self.step_gen += 1
        self.at(self.t + max(self.step_left, 0.0) / self.step_speed, "step_end", self.step_gen)

    def set_trainer_busy(self, busy: bool) -> None:
        self.trainer_busy = busy
        if self.p.cores is not None:
            for e in self.engines:
                if e.end is not None:
                    self.interrupt(e)

    def on_step_end(self, gen: int) -> None:
        if gen != self.step_gen:
            return
        self.step_left = 0.0
        dt = self.t - self.step_start
        if self.in_ahead:
            self.in_ahead = False
            self.trainer_busy_s += dt
            self.set_trainer_busy(False)
            self.take()
            return
        for g in self.batch:
            for v, n in g.versions.items():
                self.lag[self.trainer_version - v] += n
        self.trained_groups += len(self.batch)
        self.batch = []
        self.trainer_version += 1
        self.trainer_busy_s += dt
        self.set_trainer_busy(False)
        self.at(self.orchestrate(self.p.loop_s), "publish_start")  # the loop takes the result, calls the publish

    def on_publish_start(self, _: object) -> None:
        self.trainer_busy_s += self.p.publish_s
        self.set_trainer_busy(True)
        self.at(self.t + self.p.publish_s, "publish_end")

    def on_publish_end(self, _: object) -> None:
        self.published = self.trainer_version
        self.steps += 1
        self.last_publish = self.t
        self.set_trainer_busy(False)
        for e in self.engines:
            if e.rows or e.waiting:
                self.interrupt(e)
        evaluate = self.s.eval_every and self.steps % self.s.eval_every == 0
        self.at(self.orchestrate(self.p.eval_s if evaluate else 0.0), "trainer_ready")
        self.admit()

    def on_trainer_ready(self, _: object) -> None:
        self.trainer_waiting = True
        self.take()
