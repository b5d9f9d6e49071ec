"""The decoder's parameters as the runner reads them: `Layer`, one decoder block's Parameter
objects (attention, q/k norms, a gated MLP or a `_Moe` block), and `check_supported`, which
refuses with `UnsupportedModel` a model outside the Llama family the runner implements.

They hold references to the model's own Parameter objects, never copies, so a weight update
that copies into them (or rebinds their storage) is seen by the next forward pass. `_Moe`
routes as transformers does: softmax in float32 over the router logits, top-k, optional
renormalisation; engine/runner.py's `KVRunner` is their only user.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from nonstop.errors import EngineError


class UnsupportedModel(EngineError, ValueError):
    """The model's architecture is outside what the lean runner implements."""


class _Moe:
    """Parameter objects of one mixture-of-experts block: router, fused experts, shared expert."""

    def __init__(self, mlp: Any) -> None:
        self.router: torch.Tensor = mlp.gate.weight  # (E, hidden)
        self.top_k: int = mlp.gate.top_k
        self.num_experts: int = mlp.gate.num_experts
        self.norm_topk: bool = bool(mlp.gate.norm_topk_prob)
        self.gate_up: torch.Tensor = mlp.experts.gate_up_proj  # (E, 2I, hidden): gate rows, then up rows
        self.down: torch.Tensor = mlp.experts.down_proj  # (E, hidden, I)
        shared = getattr(mlp, "shared_expert", None)
        self.shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        if shared is not None:  # Qwen2-MoE: sigmoid(shared_expert_gate(h)) x a gated MLP, added to the experts
            self.shared = (
                mlp.shared_expert_gate.weight,
                shared.gate_proj.weight,
                shared.up_proj.weight,
                shared.down_proj.weight,
            )

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h (N, hidden) -> top-k expert ids (N, k) long and their weights (N, k) in h's dtype."""
        probs = torch.softmax(F.linear(h, self.router), dim=-1, dtype=torch.float32)  # (N, E)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        return experts, weights.to(h.dtype)

    def __call__(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h (N, hidden) -> the block's output (N, hidden) and the chosen experts (N, k)."""
        experts, weights = self.route(h)
        out = torch.zeros_like(h)
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)  # token slots grouped by expert: one gather per expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens, w = order // self.top_k, weights.reshape(-1)[order]
        start = 0
        for e, n in enumerate(counts):
            if n:
                rows = tokens[start : start + n]
                gate, up = F.linear(h[rows], self.gate_up[e]).chunk(2, dim=-1)
                out.index_add_(0, rows, F.linear(F.silu(gate) * up, self.down[e]) * w[start : start + n, None])
                start += n
        if self.shared is not None:
            ws, wg, wu, wd = self.shared
            out = out + torch.sigmoid(F.linear(h, ws)) * F.linear(F.silu(F.linear(h, wg)) * F.linear(h, wu), wd)
        return out, experts


class Layer:
    """Parameter objects of one decoder block (references, so updates are seen)."""

    ln1: torch.Tensor
    ln2: torch.Tensor
    eps1: float
    eps2: float
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    bq: torch.Tensor | None
    bk: torch.Tensor | None
    bv: torch.Tensor | None
    bo: torch.Tensor | None
    wg: torch.Tensor
    wu: torch.Tensor
    wd: torch.Tensor
    qn: torch.Tensor | None
    kn: torch.Tensor | None
    qk_eps: float
    moe: _Moe | None

    def __init__(self, block: Any) -> None:
        """`block`: a Llama-family decoder layer, its submodules found by name (nn.Module types
        attribute lookups only as Tensor | Module; check_supported vouches for the names)."""
        attn, mlp = block.self_attn, block.mlp
        self.ln1, self.ln2 = block.input_layernorm.weight, block.post_attention_layernorm.weight
        self.eps1 = block.input_layernorm.variance_epsilon
        self.eps2 = block.post_attention_layernorm.variance_epsilon
        self.wq, self.bq = attn.q_proj.weight, attn.q_proj.bias
        self.wk, self.bk = attn.k_proj.weight, attn.k_proj.bias
        self.wv, self.bv = attn.v_proj.weight, attn.v_proj.bias
        self.wo, self.bo = attn.o_proj.weight, attn.o_proj.bias
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.qn = None if q_norm is None else q_norm.weight
        self.kn = None if k_norm is None else k_norm.weight
        self.qk_eps = q_norm.variance_epsilon if q_norm is not None else 0.0
        self.moe = _Moe(mlp) if hasattr(mlp, "experts") else None
        if self.moe is None:
            self.wg, self.wu, self.wd = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight

    def qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Qwen3's per-head RMSNorm of queries and keys (..., heads, D), before rotation."""
        if self.qn is None or self.kn is None:
            return q, k
        D = q.shape[-1]
        return F.rms_norm(q, (D,), self.qn, self.qk_eps), F.rms_norm(k, (D,), self.kn, self.qk_eps)


def check_supported(model: torch.nn.Module) -> None:
    cfg = model.config
    problems = []
    if not hasattr(model, "model") or not hasattr(model.model, "layers"):
        problems.append("no model.layers")
    if getattr(cfg, "hidden_act", None) not in ("silu", "swish"):
        problems.append(f"hidden_act {getattr(cfg, 'hidden_act', None)!r} (needs silu)")
    if getattr(cfg, "use_sliding_window", False):
        problems.append("sliding-window attention")
    for i, block in enumerate(getattr(getattr(model, "model", None), "layers", [])):
        mlp = block.mlp
        if hasattr(mlp, "experts"):
            gate, experts = getattr(mlp, "gate", None), mlp.experts
            if not all(hasattr(gate, a) for a in ("weight", "top_k", "num_experts", "norm_topk_prob")) or not all(
                hasattr(experts, a) for a in ("gate_up_proj", "down_proj")
            ):
                problems.append(
                    f"layers.{i}.mlp: a {type(mlp).__name__} without a top-k router (gate) and fused "
                    "experts (gate_up_proj, down_proj)"
                )
            elif getattr(mlp, "shared_expert", None) is not None and not hasattr(mlp, "shared_expert_gate"):
                problems.append(f"layers.{i}.mlp: a shared expert without shared_expert_gate")
        elif not all(hasattr(mlp, a) for a in ("gate_proj", "up_proj", "down_proj")):
            problems.append(f"layers.{i}.mlp: {type(mlp).__name__} is neither a gated MLP nor a MoE block")
    if problems:
        raise UnsupportedModel(
            f"{type(model).__name__}: the engine's runner supports Llama-family decoders; "
            f"this model has {', '.join(problems)}"
        )
