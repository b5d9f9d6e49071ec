"""A Qwen2/Llama decoder layer in two halves around attention, optionally compiled (trainer.compile).

Both training forwards (the shared-prompt one in trainer/forward.py and the packed one in
trainer/packed.py) lay their tokens out as one (N, hidden) matrix and differ only in how
attention sees them. What comes before attention (the input RMS norm, the q/k/v projections and
the rotary embedding) and what comes after (the output projection, the residual adds, the second
RMS norm and the SiLU-gated MLP) is the same per-token function in both, and lives here once:

- `project(block, x, cos, sin, dims)` -> q (N, H, D), k (N, KV, D), v (N, KV, D), rotated;
- `finish(block, x, out)` -> the layer's output (N, hidden), from its input x and attention's
  output (N, H * D).

Why compile them: on a CPU a small real model's bf16 step spends about a third of its time in
elementwise work at memory speed: float32 norms, the rotation, the SiLU product, autocast's casts of
activations (each of q, k and v casts the same normed input), and their backward (docs/precision.md).
torch.compile (inductor) fuses each half, with its backward, into a few loops; the matmuls stay
the same library calls. Attention stays eager: its shapes are each forward's own.

Invariants:
- one compiled function per half and process, shared by every layer: dynamo guards on the block's
  structure and takes its weights as inputs, so a 30-layer model costs one compile per half (and one
  more when the token count first changes, after which it is symbolic; and per grad mode);
- the compiled halves compute the eager halves' function; fusion reorders float sums, so values
  agree up to rounding (tests/trainer/test_layer.py states the tolerance);
- the compile is lazy: the first forwards pay it (SmolLM2 on one core: about 30 s over the first two
  steps from a cold cache, 3 s from a warm one; bench/trainer_step.py). The cache is
  TORCHINDUCTOR_CACHE_DIR where it is set, else .nonstop_cache/inductor.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

CACHE_DIR = ".nonstop_cache/inductor"


class Dims(NamedTuple):
    heads: int  # H, query heads
    kv_heads: int  # KV, key/value heads
    head_dim: int  # D


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding of x (..., D) at the positions whose cos and sin (broadcastable) are given."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def project(
    block: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dims: Dims
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (N, hidden), cos and sin (N, 1, D) -> rotated q (N, H, D), rotated k (N, KV, D), v (N, KV, D)."""
    attn = block.self_attn
    h = block.input_layernorm(x)
    q = rotate(attn.q_proj(h).view(-1, dims.heads, dims.head_dim), cos, sin)
    k = rotate(attn.k_proj(h).view(-1, dims.kv_heads, dims.head_dim), cos, sin)
    v = attn.v_proj(h).view(-1, dims.kv_heads, dims.head_dim)
    return q, k, v


def finish(block: Any, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """x (N, hidden), attention's output out (N, H * D) -> the layer's output (N, hidden)."""
    x = x + block.self_attn.o_proj(out)
    return x + block.mlp(block.post_attention_layernorm(x))


@functools.cache
def _compiled(fn: Callable) -> Callable:
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(CACHE_DIR).absolute()))
    # one compile worker (read when inductor first loads, at the first compiled call): a pool of compile
    # processes would take memory the plan does not count
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    return torch.compile(fn)


def halves(compiled: bool) -> tuple[Callable, Callable]:
    """(project, finish), compiled once per process when `compiled`."""
    if not compiled:
        return project, finish
    return _compiled(project), _compiled(finish)
