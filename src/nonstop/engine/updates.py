"""Weight updates on the engine side: the gate between a transport and the live model.

A `WeightGate` holds the engine's end of a weight transport and separates *receiving* a new
version from *applying* it:
- `poll()` asks the source for a newer complete version and returns the version waiting to
  be applied (None when there is none); it never blocks on the trainer;
- `apply()` makes the waiting version live and returns it.

In `never_stop` mode the source updates the live model directly (transports receive in the
background and then re-point the model's tensors at a complete version, no copy), so `poll()`
applies at once and `apply()` only hands the version over. Every other mode needs to
know that weights are waiting without letting them touch the model decoding right now, so the
source updates a staging copy of the model and `apply()` copies the staging parameters
into the live ones (one foreach copy: the stall of a swap). The staging copy costs one more
copy of the parameters in memory; the mode's docs say so. A model on a GPU or in a lower
precision is always staged (on the host, in float32: what transports write), and `apply()`
copies (and casts) the staging parameters onto the device.
"""

from __future__ import annotations

import copy
from typing import Literal

import torch

from nonstop.transport.base import WeightSource

UpdateMode = Literal["never_stop", "abort_retry", "save_resume", "drain", "blocking"]
UPDATE_MODES: tuple[UpdateMode, ...] = ("never_stop", "abort_retry", "save_resume", "drain", "blocking")


class WeightGate:
    def __init__(self, live: torch.nn.Module, staged: bool) -> None:
        self.live = live
        # the staging copy is what transports fill: host memory, float32 (the trainer's layout)
        self.target = copy.deepcopy(live).to("cpu", torch.float32) if staged else live
        self.source: WeightSource | None = None
        self.waiting: int | None = None
        self._live_params: list[torch.Tensor] = list(live.parameters())
        self._staged_params: list[torch.Tensor] = list(self.target.parameters())
        self._same_kind = all(a.device == b.device and a.dtype == b.dtype
                              for a, b in zip(self._live_params, self._staged_params))

    @property
    def staged(self) -> bool:
        return self.target is not self.live

    def poll(self) -> int | None:
        if self.source is not None:
            version = self.source.maybe_update(self.target)
            if version is not None:
                self.waiting = version
        return self.waiting

    @torch.no_grad()
    def apply(self) -> int:
        if self.waiting is None:
            raise RuntimeError("WeightGate.apply: no version is waiting")
        if self.staged and self._same_kind:
            torch._foreach_copy_(self._live_params, self._staged_params)
        elif self.staged:  # host float32 -> the model's device and dtype
            for live, staged in zip(self._live_params, self._staged_params):
                live.copy_(staged, non_blocking=True)
            if self._live_params[0].device.type == "cuda":
                torch.cuda.current_stream(self._live_params[0].device).synchronize()
        version, self.waiting = self.waiting, None
        return version
