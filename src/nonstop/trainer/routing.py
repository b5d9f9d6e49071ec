"""Keep Routing in the trainer: compare, and optionally replay, the experts the engine chose.

In a mixture-of-experts model the engine and the trainer can route the same token to different
experts (other kernels, precision, batch), so the importance ratio would compare two different
sub-networks. The engine records the top-k experts of every input token (kept.Routes); here
the trainer's routers see them.

Contract:
- `moe_routers(model)`: the (name, module) of every top-k router (`...mlp.gate` with `top_k`,
  `num_experts`, `norm_topk_prob`, returning (router logits, top-k weights, top-k indices) as
  transformers' Qwen3-MoE / Qwen2-MoE routers do), in layer order; [] for a dense model;
- `route_tensor(samples, L, routers)`: the recorded routes as (B, L, layers, k) int16, aligned
  with the plain forward's right-padded prompt + completion rows (position p of row b: prompt
  token p, then completion token p - P_b); -1 where nothing was recorded (the last completion
  token, which predicts nothing in the loss, and padding). Every sample's routes are checked
  against the model and the token counts; a disagreement is a `RouteShapeError` naming it;
- `moe_experts(model, routers)`: the (name, module) of the experts beside each router
  (`...mlp.experts`, called as `experts(hidden, top_k_index, top_k_weights)`), in the same order;
  a router without one is a ValueError naming it;
- `RouterHooks(routers, experts, replay)`: a forward hook on every router and a forward pre-hook
  on every experts module. `arm(routes)` with the (N, layers, k) routes of the next forward's
  N = B x L router rows; during that forward each router compares its free choice (the top-k of
  the router logits it computed) with the recorded one and, with `replay`, returns the recorded
  experts with weights gathered from its own softmax at those indices (renormalised as the router
  does), so the router keeps its gradient; rows without a recorded route keep the free choice.
  Each experts module then reports the indices it was actually called with. Each layer's routes
  are used exactly once per armed forward: a second use, or a layer left unused at `disarm()`,
  raises. `disarm()` returns two fractions over routed tokens (the rows with a recorded route):
  'routing_free_mismatch_frac', the tokens whose free expert set differs from the engine's in at
  least one layer (under replay: given the replayed earlier layers), measured with and without
  replay; and 'routing_replayed_frac', the tokens whose experts the forward actually computed
  with equal the engine's in every layer, read at the experts, after every hook on the router:
  1.0 exactly when the replay applied, 1 - routing_free_mismatch_frac without replay. {} when
  no token had a route.
Unarmed, the hooks change nothing (evaluation, the KL reference, which is a separate copy).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from nonstop.errors import TrainerError
from nonstop.types import Sample


class RouteShapeError(TrainerError, ValueError):
    """Recorded routes that do not fit the trainer's model or batch; the message names the field."""


def moe_routers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    return [
        (name, m)
        for name, m in model.named_modules()
        if name.endswith("mlp.gate") and all(hasattr(m, a) for a in ("top_k", "num_experts", "norm_topk_prob"))
    ]


def router_shape(routers: list[tuple[str, torch.nn.Module]]) -> tuple[int, int, int]:
    """(layers, top_k, num_experts); moe_routers vouches for the attributes (Module typing cannot)."""
    first = routers[0][1]
    return len(routers), int(getattr(first, "top_k")), int(getattr(first, "num_experts"))


def route_tensor(samples: Sequence[Sample], length: int, routers: list[tuple[str, torch.nn.Module]]) -> torch.Tensor:
    layers, k, experts = router_shape(routers)
    out = torch.full((len(samples), length, layers, k), -1, dtype=torch.int16)  # 2 bytes: -1 marks "none"
    for b, s in enumerate(samples):
        r = s.routes
        if r is None:
            raise RouteShapeError(
                f"sample {b}: no routes recorded (sample.routes is None); trainer.routing_replay "
                "'r3' needs an engine that records MoE routes (the built-in engine does)"
            )
        if (r.num_layers, r.top_k, r.num_experts) != (layers, k, experts):
            raise RouteShapeError(
                f"sample {b}: sample.routes has {r.num_layers} layers x top-{r.top_k} of {r.num_experts} experts, but "
                f"the trainer's model has {layers} routers ({routers[0][0]} ...) x top-{k} of {experts} experts"
            )
        want_c = max(len(s.completion_ids) - 1, 0)
        if r.num_prompt_tokens != len(s.prompt_ids) or r.num_completion_tokens != want_c:
            raise RouteShapeError(
                f"sample {b}: sample.routes covers {r.num_prompt_tokens} prompt + {r.num_completion_tokens} completion "
                f"tokens, expected {len(s.prompt_ids)} + {want_c} (every input token but the last completion token)"
            )
        data = np.frombuffer(r.prompt + bytes(r.completion), dtype=np.uint8 if r.itemsize == 1 else "<u2")
        n = r.num_prompt_tokens + r.num_completion_tokens
        out[b, :n] = torch.from_numpy(data.astype(np.int16).reshape(n, layers, k))
    return out


def moe_experts(
    model: torch.nn.Module, routers: list[tuple[str, torch.nn.Module]]
) -> list[tuple[str, torch.nn.Module]]:
    out = []
    for name, _ in routers:
        experts = name.removesuffix("gate") + "experts"
        try:
            out.append((experts, model.get_submodule(experts)))
        except AttributeError:
            raise ValueError(
                f"{name}: no {experts} beside the router; Keep Routing reads the experts each token was computed "
                "with from a module called as experts(hidden, top_k_index, top_k_weights)"
            ) from None
    return out


class RouterHooks:
    def __init__(
        self, routers: list[tuple[str, torch.nn.Module]], experts: list[tuple[str, torch.nn.Module]], replay: bool
    ) -> None:
        if len(experts) != len(routers):
            raise ValueError(f"{len(routers)} routers but {len(experts)} experts modules")
        self.routers, self.experts, self.replay = routers, experts, replay
        self.routes: torch.Tensor | None = None
        self.used: list[int] = []  # per layer: router calls in the armed forward
        self.computed: list[int] = []  # per layer: experts calls in the armed forward
        self.free_differs: torch.Tensor | None = None  # (N,) bool: the free choice differs in some layer
        self.replayed: torch.Tensor | None = None  # (N,) bool: the experts computed with equal the recorded ones
        self.handles = [m.register_forward_hook(self._hook(i)) for i, (_, m) in enumerate(routers)]
        self.handles += [
            m.register_forward_pre_hook(self._experts_hook(i), with_kwargs=True) for i, (_, m) in enumerate(experts)
        ]

    def arm(self, routes: torch.Tensor) -> None:
        """routes: (N, layers, k) integers, -1 where nothing was recorded."""
        layers, k, _ = router_shape(self.routers)
        if routes.shape[1:] != (layers, k):
            raise RouteShapeError(f"routes {list(routes.shape)}: expected (tokens, {layers} layers, top-{k})")
        self.routes, self.used, self.computed = routes, [0] * len(self.routers), [0] * len(self.experts)
        self.free_differs = self.replayed = None

    def reset(self) -> None:
        """Disarm without checks (after a forward that raised)."""
        self.routes = None

    def disarm(self) -> dict[str, float]:
        routes, used, computed = self.routes, self.used, self.computed
        self.routes = None
        if routes is None:
            return {}
        for modules, counts, what in ((self.routers, used, "used"), (self.experts, computed, "checked")):
            wrong = [modules[i][0] for i, n in enumerate(counts) if n != 1]
            if wrong:
                raise RuntimeError(
                    f"recorded routes {what} {[n for n in counts if n != 1]} times instead of once by "
                    f"{', '.join(wrong)}: the forward did not pass every MoE layer exactly once"
                )
        routed = routes[:, 0, 0] >= 0  # (N,)
        n = int(routed.sum())
        if not n:
            return {}
        assert self.free_differs is not None and self.replayed is not None
        return {
            "routing_free_mismatch_frac": float(self.free_differs[routed].sum()) / n,
            "routing_replayed_frac": float(self.replayed[routed].sum()) / n,
        }

    def close(self) -> None:
        for h in self.handles:
            h.remove()

    def _hook(self, layer: int):
        def hook(module: torch.nn.Module, inputs, output):
            if self.routes is None:
                return None
            name = self.routers[layer][0]
            if self.used[layer]:
                raise RuntimeError(f"{name}: recorded routes used twice in one forward")
            self.used[layer] += 1
            logits, _, free = output  # (N, E), (N, k), (N, k)
            recorded = self.routes[:, layer].long()  # (N, k)
            if recorded.shape != free.shape:
                raise RouteShapeError(
                    f"{name}: recorded routes {list(recorded.shape)} for a router that chose "
                    f"{list(free.shape)} (tokens x k): the batch and its routes disagree"
                )
            has = recorded[:, 0] >= 0
            rec = torch.where(has[:, None], recorded, free)
            free_differs = (free.sort(-1).values != rec.sort(-1).values).any(-1)  # (N,)
            self.free_differs = free_differs if self.free_differs is None else self.free_differs | free_differs
            if not self.replay:
                return None
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            weights = probs.gather(1, rec)  # (N, k): gradient flows to the router through its scores
            if module.norm_topk_prob:
                weights = weights / weights.sum(-1, keepdim=True)
            return logits, weights.to(logits.dtype), rec

        return hook

    def _experts_hook(self, layer: int):
        # What the experts receive, not what the router hook returned: the check must see any
        # change made after it (another hook, a block that re-routes), so that it fails whenever
        # the replay did not reach the computation.
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict):
            if self.routes is None:
                return None
            name = self.experts[layer][0]
            if self.computed[layer]:
                raise RuntimeError(f"{name}: recorded routes checked twice in one forward")
            self.computed[layer] += 1
            chosen = args[1] if len(args) > 1 else kwargs["top_k_index"]  # (N, k)
            recorded = self.routes[:, layer].long()
            if recorded.shape != chosen.shape:
                raise RouteShapeError(
                    f"{name}: recorded routes {list(recorded.shape)} for experts called with "
                    f"{list(chosen.shape)} (tokens x k): the batch and its routes disagree"
                )
            same = (chosen.sort(-1).values == recorded.sort(-1).values).all(-1)  # (N,); rows without a route: False
            self.replayed = same if self.replayed is None else self.replayed & same
            return None

        return hook
