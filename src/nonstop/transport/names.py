"""Name and shape mapping between a fused-expert trainer and a per-expert engine.

transformers 5 holds the experts of a mixture-of-experts block fused, one tensor per block:
`...experts.gate_up_proj` (E, 2I, H) — per expert the gate rows, then the up rows — and
`...experts.down_proj` (E, H, I). Checkpoints on disk, and engines written per expert, hold
`...experts.{e}.gate_proj.weight` (I, H), `...experts.{e}.up_proj.weight` (I, H) and
`...experts.{e}.down_proj.weight` (H, I). The transport always carries the trainer's (fused)
layout; `PerExpertParameters` is the engine-side target when the engine's model is per
expert: it receives the fused tensors and points every per-expert weight at its slice of
them (each slice is contiguous, so nothing is copied). Any other name must match exactly.
Tied weights travel once (`named_parameters` lists a shared tensor once) and reach every
module that shares them, on both ends.
"""

from __future__ import annotations

import re

import torch

from nonstop.types import TensorSpec

_FUSED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


def per_expert_slices(name: str, fused: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The per-expert (name, view) pairs of one fused expert tensor; [] if `name` is not fused."""
    m = _FUSED.match(name)
    if m is None:
        return []
    prefix, out = m["prefix"], []
    for e in range(fused.shape[0]):
        if m["kind"] == "down_proj":
            out.append((f"{prefix}.{e}.down_proj.weight", fused[e]))
        else:
            half = fused.shape[1] // 2
            out += [
                (f"{prefix}.{e}.gate_proj.weight", fused[e, :half]),
                (f"{prefix}.{e}.up_proj.weight", fused[e, half:]),
            ]
    return out


def needs_expert_mapping(layout: list[TensorSpec], model: torch.nn.Module) -> bool:
    """True when the trainer sends fused experts that this engine holds per expert."""
    ours = {n for n, _ in model.named_parameters()}
    return any(_FUSED.match(s.name) and s.name not in ours for s in layout)


class PerExpertParameters:
    """Engine target: fused expert tensors received, per-expert weights viewing into them."""

    def __init__(self, model: torch.nn.Module, layout: list[TensorSpec]) -> None:
        params = dict(model.named_parameters())
        self.named: list[tuple[str, torch.Tensor]] = []
        self.fused: list[tuple[str, torch.Tensor, list[torch.nn.Parameter]]] = []
        for spec in layout:
            if spec.name in params or not _FUSED.match(spec.name):
                if spec.name in params:
                    self.named.append((spec.name, params[spec.name]))
                continue  # an unknown name is reported by check_layout
            fused = torch.empty(spec.shape, dtype=getattr(torch, spec.dtype))
            slices = per_expert_slices(spec.name, fused)
            missing = [n for n, _ in slices if n not in params]
            if missing:
                raise ValueError(f"engine has neither {spec.name} nor its per-expert weights (e.g. {missing[0]})")
            targets = []
            with torch.no_grad():
                for n, view in slices:
                    if tuple(view.shape) != tuple(params[n].shape):
                        raise ValueError(
                            f"{n}: engine {list(params[n].shape)} vs {list(view.shape)} sliced from "
                            f"the trainer's {spec.name} {list(spec.shape)}"
                        )
                    view.copy_(params[n])  # until the first update the engine keeps its own weights
                    targets.append(params[n])
            self.named.append((spec.name, fused))
            self.fused.append((spec.name, fused, targets))
        self.applied()

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        return self.named

    def applied(self) -> None:
        # The transport may have re-pointed the fused tensors; re-derive the per-expert views
        # (outside inference_mode, so the engine's parameters stay ordinary tensors).
        with torch.inference_mode(False):
            for name, fused, targets in self.fused:
                for p, (_, view) in zip(targets, per_expert_slices(name, fused)):
                    p.data = view
