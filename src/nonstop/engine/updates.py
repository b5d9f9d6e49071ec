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
"""

from __future__ import annotations

import copy
from typing import Literal

import torch

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
