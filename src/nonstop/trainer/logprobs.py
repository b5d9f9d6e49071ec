"""Log-probabilities of the sampled tokens under the LM head, over a vocabulary of tens of thousands.

Shapes: B samples, T completion positions (padded), H hidden size, V vocabulary.
`token_logprobs` is what the trainer calls: from the last hidden states and the head, logp (B, T)
of the target tokens at a sampling temperature, optionally with each position's entropy.
Without the entropy the (B, T, V) logits never exist at once: `head_logprobs` (the fused linear +
log-prob) makes one chunk of positions' logits in the forward, keeps only what the backward needs
from them, and makes them again in the backward (`_HeadLogprob`); `target_logprobs` works from
logits a head already made, CHUNK_ELEMENTS at a time (`_TargetLogprob`). The memory plan counts one
chunk (sizing/memory.py).
"""

from __future__ import annotations

import torch


class _TargetLogprob(torch.autograd.Function):
    """log softmax(logits * inv_t)[target] per row, without a (N, V) float32 log-softmax.

    The plain path (`log_softmax(logits.float())` then `gather`) keeps a float32 copy of every
    logit for the backward and writes three more (N, V) tensors there (the gather's zeros, the
    log-softmax gradient, its cast back to the logits' dtype). Here the forward keeps the
    logits as they are (bfloat16 under autocast) and one float per row (the log-sum-exp), and
    the backward recomputes softmax a few rows at a time in float32, in cache, writing the
    gradient once in the logits' dtype: 0.45 s against 1.4 s forward and backward at 1,024 rows
    of the 151,936-token vocabulary on one thread. Same float32 arithmetic as the plain path.
    """

    @staticmethod
    def forward(ctx, logits, targets, keep, inv_t: float):  # (N, V), (N,), (N, V) bool or None
        lse, picked = _lse_and_picked(logits, targets, keep, inv_t)
        ctx.save_for_backward(logits, targets, keep, lse)
        ctx.inv_t = inv_t
        return picked - lse

    @staticmethod
    def backward(ctx, grad_out):  # grad_out (N,) -> d logits (N, V): g * (onehot - softmax) * inv_t
        logits, targets, keep, lse = ctx.saved_tensors
        return _logits_grad(logits, targets, keep, lse, grad_out, ctx.inv_t), None, None, None


CHUNK_ELEMENTS = 1 << 20  # float32 logits per chunk of _TargetLogprob: 4 MiB, about a core's cache


def _scaled(logits: torch.Tensor, keep: torch.Tensor | None, inv_t: float, i: int, rows: int, wide) -> torch.Tensor:
    """A float copy of logits rows i..i+rows, times inv_t, -inf where `keep` is False."""
    z = logits[i : i + rows].to(wide, copy=True)  # (r, V), never a view: callers write into it
    if inv_t != 1.0:
        z.mul_(inv_t)
    if keep is not None:
        z.masked_fill_(~keep[i : i + rows], float("-inf"))
    return z


def _lse_and_picked(
    logits: torch.Tensor, targets: torch.Tensor, keep: torch.Tensor | None, inv_t: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N,) log-sum-exp of logits (N, V) x inv_t over the kept tokens and (N,) the targets' scaled
    logits (-inf outside the kept tokens), in float32 (float64 for float64 logits), a few rows at a time."""
    N, V = logits.shape
    wide = torch.promote_types(logits.dtype, torch.float32)
    rows = max(1, CHUNK_ELEMENTS // V)
    lse = torch.empty(N, dtype=wide, device=logits.device)  # (N,)
    for i in range(0, N, rows):
        lse[i : i + rows] = torch.logsumexp(_scaled(logits, keep, inv_t, i, rows, wide), dim=-1)
    picked = logits.gather(-1, targets[:, None]).squeeze(-1).to(wide) * inv_t  # (N,)
    if keep is not None:  # a target outside the kept tokens has probability 0, as in log_softmax
        picked = picked.masked_fill(~keep.gather(-1, targets[:, None]).squeeze(-1), float("-inf"))
    return lse, picked


def _logits_grad(
    logits: torch.Tensor,
    targets: torch.Tensor,
    keep: torch.Tensor | None,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    inv_t: float,
) -> torch.Tensor:
    """d logits (N, V) in the logits' dtype of sum_n grad_out_n x (log softmax(logits_n x inv_t))[target_n]:
    grad_out x (onehot - softmax) x inv_t, softmax recomputed a few rows at a time in float32."""
    N, V = logits.shape
    rows = max(1, CHUNK_ELEMENTS // V)
    grad = torch.empty_like(logits)
    for i in range(0, N, rows):
        g = grad_out[i : i + rows, None].to(lse.dtype)  # (r, 1)
        t = targets[i : i + rows, None]  # (r, 1)
        z = _scaled(logits, keep, inv_t, i, rows, lse.dtype)
        z.sub_(lse[i : i + rows, None]).exp_().mul_(-g)  # -g * softmax
        z.scatter_add_(-1, t, g if keep is None else g * keep[i : i + rows].gather(-1, t))
        if inv_t != 1.0:
            z.mul_(inv_t)
        grad[i : i + rows] = z
    return grad


def _head_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in, as `head(hidden)` would: autocast's where it is on."""
    kind = hidden.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return torch.promote_types(hidden.dtype, weight.dtype)


class _HeadLogprob(torch.autograd.Function):
    """log softmax((hidden @ weight.T + bias) x inv_t)[target] per row, the logits recomputed in backward.

    A fused linear + log-prob: the forward computes `chunk` rows of logits at a time and keeps
    only what it was given (hidden, the head's weight) and one float per row (the log-sum-exp);
    the backward recomputes each chunk's logits, turns them into their gradient in place and
    multiplies it back into d hidden (chunk, H) and d weight (V, H). So only one chunk's (chunk, V)
    logits exist at a time in the forward and in the backward, instead of every chunk's logits
    kept for the backward (rows x completion x vocabulary, 3.6 GB at 384 x 96 x 49,152 in bf16),
    for one more head matmul per chunk. The matmuls run in the dtype `head(hidden)` would (autocast's
    bfloat16 where it is on); the log-softmax arithmetic is `_TargetLogprob`'s. d weight is summed
    over the chunks in place in the matmul's dtype, then cast to the weight's once.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, keep, inv_t: float, chunk: int, dtype: torch.dtype):
        # hidden (N, H), weight (V, H), bias (V,) or None, targets (N,), keep (N, V) bool or None
        N = hidden.shape[0]
        wide = torch.promote_types(dtype, torch.float32)
        lse = torch.empty(N, dtype=wide, device=hidden.device)
        picked = torch.empty(N, dtype=wide, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            w, b = weight.to(dtype), bias.to(dtype) if bias is not None else None
            for i in range(0, N, chunk):
                logits = torch.nn.functional.linear(hidden[i : i + chunk].to(dtype), w, b)  # (c, V)
                k = keep[i : i + chunk] if keep is not None else None
                lse[i : i + chunk], picked[i : i + chunk] = _lse_and_picked(logits, targets[i : i + chunk], k, inv_t)
        ctx.save_for_backward(hidden, weight, bias, targets, keep, lse)
        ctx.inv_t, ctx.chunk, ctx.dtype = inv_t, chunk, dtype
        return picked - lse

    @staticmethod
    def backward(ctx, grad_out):  # grad_out (N,)
        hidden, weight, bias, targets, keep, lse = ctx.saved_tensors
        dtype, chunk, N = ctx.dtype, ctx.chunk, hidden.shape[0]
        d_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        d_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        d_bias = torch.zeros_like(bias) if bias is not None and ctx.needs_input_grad[2] else None
        # d weight summed in the matmul's dtype, in place (bf16 under autocast: the head's gradient
        # before its cast, as the plain path makes it), so no chunk makes a (V, H) temporary
        acc = d_weight if d_weight is None or dtype == weight.dtype else torch.zeros_like(weight, dtype=dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            w, b = weight.to(dtype), bias.to(dtype) if bias is not None else None
            for i in range(0, N, chunk):
                h = hidden[i : i + chunk].to(dtype)  # (c, H)
                logits = torch.nn.functional.linear(h, w, b)  # (c, V)
                k = keep[i : i + chunk] if keep is not None else None
                g = _logits_grad(
                    logits, targets[i : i + chunk], k, lse[i : i + chunk], grad_out[i : i + chunk], ctx.inv_t
                )
                del logits
                if d_hidden is not None:
                    d_hidden[i : i + chunk] = g @ w  # (c, H)
                if acc is not None:
                    acc.addmm_(g.t(), h)  # (V, H)
                if d_bias is not None:
                    d_bias += g.sum(0).to(bias.dtype)
        if acc is not None and acc is not d_weight:
            d_weight = acc.to(weight.dtype)
        return d_hidden, d_weight, d_bias, None, None, None, None, None


HEAD_CHUNK_POSITIONS = 1024
"""Most positions whose logits `token_logprobs` makes at once on the fused path: 1,024 x 49,152 float32
logits are 192 MiB, and a (1024, H) x (H, V) matmul is still large enough to run at full speed."""


def head_logprobs(
    hidden: torch.Tensor,
    head: torch.nn.Linear,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk: int = 4096,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """log softmax(head(hidden) / temperature)[targets] in float32, `chunk` positions' logits at a
    time in the forward and in the backward (`_HeadLogprob`). hidden: (..., H); targets: (...);
    keep: optional (..., V) bool -> (...). Differentiable in hidden and the head's weight and bias."""
    H, V = hidden.shape[-1], head.weight.shape[0]
    flat_keep = keep.reshape(-1, V) if keep is not None else None
    dtype = _head_dtype(hidden, head.weight)
    out = _HeadLogprob.apply(
        hidden.reshape(-1, H), head.weight, head.bias, targets.reshape(-1), flat_keep, 1.0 / temperature, chunk, dtype
    )
    return out.view(targets.shape)


def target_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, keep: torch.Tensor | None = None
) -> torch.Tensor:
    """log softmax(logits / temperature)[targets], in float32 (float64 for float64 logits).

    logits: (..., V) in any float dtype; targets: (...) long; keep: optional (..., V) bool (the
    distribution renormalised over kept tokens) -> (...). Differentiable in logits."""
    V = logits.shape[-1]
    flat_keep = keep.reshape(-1, V) if keep is not None else None
    out = _TargetLogprob.apply(logits.reshape(-1, V), targets.reshape(-1), flat_keep, 1.0 / temperature)
    return out.view(targets.shape)


def token_logprobs(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_rows: int = 64,
    with_entropy: bool = False,
    keep: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log softmax(head(hidden) / temperature) at `targets`, `chunk_rows` rows at a time.

    hidden: (B, T, H); targets: (B, T) -> (B, T) [and the entropy (B, T) of each distribution].
    keep: optional (B, T, V) bool Keep Sampling Mask: the distribution is renormalised over the
    kept tokens, as the engine sampled it. Without the entropy and with a linear head, only one
    chunk's logits exist at a time, in the forward and in the backward (`head_logprobs`: each
    chunk's logits are recomputed in the backward), `chunk_rows` x T positions but at most
    HEAD_CHUNK_POSITIONS, so memory does not grow with B x T x V. With the entropy (or another
    head) each chunk's logits are made by the head as usual and autograd keeps every chunk's
    float32 log-probabilities and probabilities for the backward: that path still grows with
    B x T x V (the memory plan counts it).
    """
    if not with_entropy and isinstance(head, torch.nn.Linear):
        chunk = max(1, min(chunk_rows * hidden.shape[1], HEAD_CHUNK_POSITIONS))
        return head_logprobs(hidden, head, targets, temperature, chunk, keep)
    out, ent = [], []
    keeps = keep.split(chunk_rows) if keep is not None else [None] * len(hidden.split(chunk_rows))
    for h, t, k in zip(hidden.split(chunk_rows), targets.split(chunk_rows), keeps):
        if not with_entropy:
            out.append(target_logprobs(head(h), t, temperature, k))  # (b, T)
            continue
        scaled = head(h).float()  # (b, T, V)
        if temperature != 1.0:  # x / 1 is x: skip a pass over b x T x V logits
            scaled = scaled / temperature
        if k is not None:
            scaled = scaled.masked_fill(~k, float("-inf"))
        logp_all = torch.log_softmax(scaled, dim=-1)  # (b, T, V)
        out.append(logp_all.gather(-1, t.unsqueeze(-1)).squeeze(-1))  # (b, T)
        ent.append(-(logp_all.exp() * logp_all.clamp_min(-1e30)).sum(-1).nan_to_num(0.0))  # (b, T)
    logp = torch.cat(out)
    return (logp, torch.cat(ent)) if with_entropy else logp
