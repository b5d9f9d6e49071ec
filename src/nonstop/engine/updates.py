"""Weight updates on the engine side: the gate between a transport and the live model.

A `WeightGate` holds the engine's end of a weight transport and separates *receiving* a new
version from *applying* it:
- `poll()` asks the receiver for a newer complete version and returns the version waiting to
  be applied (None when there is none); it never blocks on the trainer;
- `apply()` makes the waiting version live and returns it.

In `never_stop` mode the receiver updates the live model directly (transports receive in the
background and then re-point the model's tensors at a complete version, no copy), so `poll()`
applies at once and `apply()` only hands the version over. Every other mode needs to
know that weights are waiting without letting them touch the model decoding right now, so the
receiver updates a staging copy of the model and `apply()` copies the staging parameters
into the live ones (one foreach copy: the stall of a swap). The staging copy costs one more
copy of the parameters in memory; the mode's docs say so. A model on a GPU, or in another dtype
than the transport's (transport.dtype: float32, or the engine's own), is staged in that dtype on the
receiving device, and `apply()` copies (and casts) the staging parameters into the model. The
staging copy is on the host unless the transport has a GPU path (transport/device.py): then
`receive_on(device, dtype)` puts it on the engine's GPU, so an update goes GPU to GPU; a model of
the transport's dtype on that GPU in `never_stop` mode needs none.

`WeightSwaps` is the scheduler's side of the update modes (engine/scheduler.py's `Scheduler`
mixes it in and holds the attributes declared on it): before every forward pass it polls the gate
and, by `engine.update_mode`, swaps at once (never_stop; save_resume saves and restores the
in-flight rows' KV around the copy; abort_retry marks them for a re-prefill under the new
weights), holds admissions until in-flight rows finish (drain), or waits for an empty batch
(blocking). A swap empties the prefix cache (its KV is the old weights') and, with
`engine.group_cancel`, sends every group more than `engine.max_lag` versions behind back to the
queue from its prompt.
"""

from __future__ import annotations

import copy
import time
from collections import deque
from collections.abc import Callable
from typing import Literal

import torch

from nonstop.config import EngineConfig
from nonstop.engine.prefix import PrefixCache
from nonstop.engine.runner import Runner
from nonstop.engine.sequence import Seq, SeqGroup
from nonstop.transport.base import WeightReceiver

UpdateMode = Literal["never_stop", "abort_retry", "save_resume", "drain", "blocking"]
UPDATE_MODES: tuple[UpdateMode, ...] = ("never_stop", "abort_retry", "save_resume", "drain", "blocking")


class WeightGate:
    def __init__(self, live: torch.nn.Module, staged_mode: bool) -> None:
        """`staged_mode`: the update mode applies versions later than it receives them."""
        self.live = live
        self.staged_mode = staged_mode
        self.receiver: WeightReceiver | None = None
        self.waiting: int | None = None
        self._live_params: list[torch.Tensor] = list(live.parameters())
        self._target: torch.nn.Module | None = None
        self._staged_params: list[torch.Tensor] = []
        self._same_kind = True
        self.receive_on(torch.device("cpu"))

    def receive_on(self, device: torch.device, dtype: torch.dtype = torch.float32) -> None:
        """Place the tensors transports fill (`dtype`, the trainer's layout) on `device`: the live
        model itself when it is of that dtype there and the mode applies at once, else a staging copy
        (made when first asked for). Call before a transport attaches: it keeps references."""
        self._receive_device, self._receive_dtype = device, dtype
        self._target = None

    @property
    def target(self) -> torch.nn.Module:
        if self._target is None:
            live, device, dtype = self._live_params[0], self._receive_device, self._receive_dtype
            if not self.staged_mode and live.device == device and live.dtype == dtype:
                self._target = self.live
            else:
                self._target = copy.deepcopy(self.live).to(device, dtype)
            self._staged_params = list(self._target.parameters())
            self._same_kind = all(
                a.device == b.device and a.dtype == b.dtype for a, b in zip(self._live_params, self._staged_params)
            )
        return self._target

    @property
    def staged(self) -> bool:
        return self.target is not self.live

    def poll(self) -> int | None:
        if self.receiver is not None:
            version = self.receiver.maybe_update(self.target)
            if version is not None:
                self.waiting = version
        return self.waiting

    @torch.no_grad()
    def apply(self) -> int:
        if self.waiting is None:
            raise RuntimeError("WeightGate.apply: no version is waiting")
        if self.staged and self._same_kind:
            torch._foreach_copy_(self._live_params, self._staged_params)
        elif self.staged:  # staging in the transport's dtype (host, or the GPU) -> the model's device and dtype
            for live, staged in zip(self._live_params, self._staged_params):
                live.copy_(staged, non_blocking=True)
            if self._live_params[0].device.type == "cuda":
                torch.cuda.current_stream(self._live_params[0].device).synchronize()
        version, self.waiting = self.waiting, None
        return version


class WeightSwaps:
    """The update modes' swap, a mixin of the scheduler: when a waiting version goes live."""

    # set by Scheduler (engine/scheduler.py); declared here for the type checker only
    cfg: EngineConfig
    gate: WeightGate | None
    runner: Runner
    prefix: PrefixCache | None
    rows: list[Seq]
    waiting: deque[SeqGroup]
    reprefill: list[Seq]
    draining: bool
    policy_version: int
    stats: dict[str, float]
    has_work: Callable[[], bool]
    _evict: Callable[[SeqGroup], None]

    def apply_newest_if_idle(self) -> None:
        """An engine with nothing to run applies the newest published version now, as its next
        forward pass would first: asked what it decodes with, an idle engine (a replacement that
        has not served yet) answers with the weights its next request gets, not its start weights."""
        if not self.has_work():
            self._poll_weights()

    def _poll_weights(self) -> None:
        if self.gate is None or (self.cfg.update_mode == "blocking" and self.rows):
            return
        t0 = time.perf_counter()  # in never_stop the transport re-points the live model's tensors in poll()
        if self.gate.poll() is None:
            return
        if self.cfg.update_mode == "drain" and self.rows:
            self.draining = True  # admissions wait; the swap happens once in-flight rows finish
            return
        self._swap(t0)

    def _swap(self, t0: float) -> None:
        mode, paused = self.cfg.update_mode, []
        if mode == "save_resume" and self.rows:
            paused = [(s, self.runner.save(s.row, s.length)) for s in self.rows]
            self.stats["paused_seqs"] += len(paused)
        assert self.gate is not None  # _poll_weights swaps only with a gate
        self.policy_version = self.gate.apply()
        if self.prefix is not None:  # cached prefixes are the old weights' KV
            self.prefix.clear()
        for s, saved in paused:
            self.runner.restore(s.row, saved)
        if mode == "abort_retry" and self.rows:
            self.reprefill = list(self.rows)
            self.stats["aborted_seqs"] += len(self.rows)
        self.draining = False
        dt = time.perf_counter() - t0
        self.stats["swaps"] += 1
        self.stats["swap_s"] += dt
        self.stats["max_swap_s"] = max(self.stats["max_swap_s"], dt)
        if self.cfg.group_cancel and self.cfg.max_lag is not None:
            self._cancel_lagging(self.cfg.max_lag)

    def _cancel_lagging(self, max_lag: int) -> None:
        groups = {id(s.group): s.group for s in self.rows}.values()
        lagging = [g for g in groups if self.policy_version - g.min_version > max_lag]
        for g in lagging:
            self._evict(g)
            g.reset()
            self.stats["groups_cancelled"] += 1
        self.waiting.extendleft(reversed(lagging))
