"""Logprobs of chosen tokens through the LM head, without a (tokens, vocab) float32 graph.

`head_logprobs(hidden, weight, targets, temperature, chunk_tokens, keep, with_entropy)` equals
`log_softmax(hidden @ weight.T / temperature)` at `targets` (and the entropy of each
distribution), as the plain autograd composition computes it, but as one autograd node:

- forward, `chunk_tokens` tokens at a time: the logits matmul in the compute dtype (autocast's
  dtype when autocast is on, else the weight's), then a float32 log-sum-exp over the vocabulary.
  Only the chunk's logits in the compute dtype are kept for backward, half of what autograd keeps
  for a bfloat16 step (it saves log_softmax's float32 output) and no scattered (tokens, vocab)
  gradient is ever filled;
- backward, chunk by chunk: d logp_t / d z = onehot(target) - softmax(z), with the entropy's
  term -p (log p + H) when asked, then the two matmuls of the head's gradients in the compute
  dtype, the weight's only when it needs one (LoRA freezes it).

On this CPU the composition's log_softmax backward alone took longer than the LM head's three
matmuls in bfloat16 (a (1024, 151,936) batch: 2.3 s against 1.3 s, one thread), which is what
this node removes.

Shapes: hidden (N, H) in any float dtype; weight (V, H); targets (N,) long; keep (N, V) bool or
None (tokens outside it have probability 0, as the engine sampled them) -> logp (N,) float32
[and entropy (N,) float32]. The caller decides when the head is a plain bias-free weight
(`plain_head`); anything else takes the composition.
"""

from __future__ import annotations

from typing import Any

import torch

_FLOOR = -1e30  # log p of a token outside `keep` (p = 0) in p * log p terms: 0 * -inf would be NaN


def plain_head(head: torch.nn.Module) -> torch.Tensor | None:
    """The head's weight when it is a plain bias-free Linear over full tensors, else None
    (peft-wrapped heads, biases and FSDP2's sharded DTensors take the autograd composition)."""
    from torch.distributed.tensor import DTensor

    if type(head) is not torch.nn.Linear or getattr(head, "bias", None) is not None:  # typed non-optional
        return None
    weight: Any = head.weight  # a DTensor under FSDP2, which its Parameter type does not admit
    return None if isinstance(weight, DTensor) else weight


def _compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return weight.dtype


def _scaled(z: torch.Tensor, temperature: float, keep: torch.Tensor | None) -> torch.Tensor:
    """(n, V) logits in the compute dtype -> float32 logits / temperature, -inf outside keep, in a
    new tensor (callers work on it in place; `z` is kept for backward)."""
    zf = z.to(torch.float32, copy=True)
    if temperature != 1.0:
        zf = zf.div_(temperature)
    if keep is not None:
        zf = zf.masked_fill_(~keep, float("-inf"))
    return zf


def _rows(vocab: int) -> int:
    """Rows of float32 logits that stay in the cache (~4 MB): the elementwise passes of softmax
    and its gradient run over these, so the (tokens, vocab) tensors are read and written only
    by the matmuls and once per direction in the compute dtype."""
    return max(1, (1 << 20) // max(vocab, 1))


class _HeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, keep, temperature, chunk_tokens, with_entropy):
        dtype = _compute_dtype(hidden, weight)
        keeps_graph = hidden.requires_grad or weight.requires_grad
        N, V = hidden.shape[0], weight.shape[0]
        logp = torch.empty(N, dtype=torch.float32, device=hidden.device)
        ent = torch.zeros_like(logp)
        sub = _rows(V)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            saved = []
            for s in range(0, N, chunk_tokens):
                z = hidden[s : s + chunk_tokens].to(dtype) @ w.t()  # (n, V) compute dtype
                lse = torch.empty(z.shape[0], dtype=torch.float32, device=z.device)
                for r in range(0, z.shape[0], sub):
                    a, b = s + r, s + min(r + sub, z.shape[0])
                    zf = _scaled(z[r : r + sub], temperature, keep[a:b] if keep is not None else None)
                    lse[r : r + sub] = torch.logsumexp(zf, dim=-1)
                    logp[a:b] = zf.gather(-1, targets[a:b, None])[:, 0] - lse[r : r + sub]
                    if with_entropy:
                        lp = zf.sub_(lse[r : r + sub, None]).clamp_min_(_FLOOR)  # (rows, V) log p
                        ent[a:b] = -(lp.exp() * lp).sum(-1).nan_to_num(0.0)
                if keeps_graph:
                    saved.append((z, lse))
        ctx.saved = saved
        ctx.w = w if keeps_graph else None
        ctx.meta = (temperature, chunk_tokens, with_entropy)
        ctx.save_for_backward(hidden, weight, targets, keep)
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, targets, keep = ctx.saved_tensors
        temperature, chunk_tokens, with_entropy = ctx.meta
        w = ctx.w
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        sub = _rows(weight.shape[0])
        with torch.autocast(hidden.device.type, enabled=False):
            for i, (z, lse) in enumerate(ctx.saved):
                s = i * chunk_tokens
                dz = torch.empty_like(z)  # (n, V) d(loss)/d(logits) in the compute dtype
                for r in range(0, z.shape[0], sub):
                    a, b = s + r, s + min(r + sub, z.shape[0])
                    lp = _scaled(z[r : r + sub], temperature, keep[a:b] if keep is not None else None)
                    lp = lp.sub_(lse[r : r + sub, None])  # (rows, V) log p
                    g = g_logp[a:b]
                    d = lp.exp().mul_(-g[:, None])  # d logp_t / d z = onehot - p, times the incoming gradient
                    d.scatter_add_(-1, targets[a:b, None], g[:, None])
                    if with_entropy and g_ent is not None:
                        lp = lp.clamp_min_(_FLOOR)
                        p = lp.exp()
                        h_ent = -(p * lp).sum(-1).nan_to_num(0.0)  # (rows,)
                        d.sub_(p.mul_(lp.add_(h_ent[:, None])).mul_(g_ent[a:b, None]))  # dH/dz = -p (log p + H)
                    if temperature != 1.0:
                        d.div_(temperature)
                    dz[r : r + sub] = d
                if grad_h is not None:
                    grad_h[s : s + chunk_tokens] = dz @ w
                if grad_w is not None:
                    grad_w.add_(dz.t() @ hidden[s : s + chunk_tokens].to(z.dtype))
        ctx.saved, ctx.w = None, None
        grad_w = grad_w.to(weight.dtype) if grad_w is not None else None
        return grad_h, grad_w, None, None, None, None, None


def head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = 4096,
    keep: torch.Tensor | None = None,
    with_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """(N,) float32 logprobs of `targets` [and (N,) entropies]; see the module docstring."""
    logp, ent = _HeadLogprobs.apply(hidden, weight, targets, keep, temperature, max(chunk_tokens, 1), with_entropy)
    return (logp, ent) if with_entropy else logp
