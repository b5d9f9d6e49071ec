"""The padding-free training forward: real tokens only, for batches of very uneven lengths.

The shared-prompt forward (trainer/forward.py) pads every completion of a batch to the longest
one: with heavy-tailed lengths (median 85 tokens, longest 900) most of a B x T batch is padding,
and the trainer pays for it in every projection, MLP, attention and the LM head. Here:

- the distinct prompts' real tokens and the completions' real input tokens are packed into one
  (N, hidden) matrix: embeddings, norms, q/k/v/o projections and MLPs run on real tokens only;
- attention runs per bucket of rows of similar length (rows sorted by length, a new bucket when
  the bucket's padded size would exceed (1 + BUCKET_WASTE) x its real size): each bucket gathers
  its rows' queries and keys from the packed matrix, pads them to the bucket's longest row only,
  runs causal attention (a completion row as its prompt followed by its own tokens) and scatters
  the result back, so padding in attention is bounded, not B x T_max;
- the LM head and log-softmax run on the real completion positions only (`packed_logprobs`), in
  chunks no larger than the padded path's, and the result is scattered to (B, T).

Contract: `packed_hidden(model, batch)` takes the shared-prompt batch of Trainer.batch_of plus
`completion_len` (B,) and returns (N, hidden), the final-normed hidden states that predict the
N = sum(completion_len) completion tokens, in row-major order (row b's tokens 0..len_b - 1, then
row b + 1's): the same values as `prompt_shared_hidden(model, batch)[in_completion]` up to float
rounding (the sums run in other orders). Each row's rotary positions are its own (the prompt from
0, completion token t at P_b + t) and a row sees only its prompt and its own earlier tokens: the
block-diagonal mask of a varlen batch, as one causal mask per bucket. Same models as forward.py
(`unsupported`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from nonstop.device import attention
from nonstop.trainer.forward import decoder_model, run_layer
from nonstop.trainer.layer import Dims, halves
from nonstop.trainer.logprobs import token_logprobs

BUCKET_WASTE = 0.25
"""A bucket's padded size may exceed its real size by this fraction before a new bucket starts."""


def length_buckets(lengths: list[int], waste: float = BUCKET_WASTE) -> list[list[int]]:
    """Row indices grouped longest first, each group's max(len) x count <= (1 + waste) x sum(len).
    Rows of length 0 are left out (nothing to attend from)."""
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: -lengths[i])
    buckets: list[list[int]] = []
    real = 0
    for i in order:
        if buckets and lengths[buckets[-1][0]] * (len(buckets[-1]) + 1) <= (1 + waste) * (real + lengths[i]):
            buckets[-1].append(i)
            real += lengths[i]
        else:
            buckets.append([i])
            real = lengths[i]
    return buckets


def _padded_index(starts: torch.Tensor, lengths: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, width) indices into a packed matrix (start + t, clamped to the row's last token) and
    the (rows, width) bool mask of real positions."""
    t = torch.arange(width)[None, :]
    real = t < lengths[:, None]
    return starts[:, None] + torch.minimum(t, (lengths - 1).clamp_min(0)[:, None]), real


def packed_hidden(
    model: Any, batch: Mapping[str, Any], checkpoint: bool = False, compiled: bool = False
) -> torch.Tensor:
    lm = decoder_model(model)
    dec, cfg = lm.model, lm.config
    H, KV = cfg.num_attention_heads, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    gqa = KV != H
    dims = Dims(H, KV, D)
    project, finish = halves(compiled)
    plen, row = batch["prompt_len"], batch["row_prompt"]  # (Q,), (B,)
    clen = batch["completion_len"]  # (B,)
    cin = (clen - 1).clamp_min(0)  # completion input tokens per row (the last token is never an input)
    B = clen.shape[0]
    in_prompt = torch.arange(batch["prompt_ids"].shape[1])[None, :] < plen[:, None]
    in_comp = torch.arange(batch["completion_in"].shape[1])[None, :] < cin[:, None]
    tokens = torch.cat([batch["prompt_ids"][in_prompt], batch["completion_in"][in_comp]])  # (Np + Nc,)
    Np = int(plen.sum())
    p_start = torch.cumsum(plen, 0) - plen  # (Q,) where each prompt starts in the packed matrix
    c_start = Np + torch.cumsum(cin, 0) - cin  # (B,) where each row's completion inputs start

    # Rotary position of every packed token: a prompt from 0, a row's completion input t at P_b + t.
    pos = torch.cat(
        [
            torch.arange(Np) - torch.repeat_interleave(p_start, plen),
            torch.arange(int(cin.sum()))
            - torch.repeat_interleave(c_start - Np, cin)
            + torch.repeat_interleave(plen[row], cin),
        ]
    )
    cos, sin = dec.rotary_emb(dec.embed_tokens.weight[:1], pos[None])  # (1, N, D)
    cos, sin = cos[0][:, None], sin[0][:, None]  # (N, 1, D), broadcast over heads

    # Index tensors of each attention bucket, the same in every layer. A prompt bucket: its rows'
    # tokens, right-padded. A completion bucket: each row's prompt tokens then its completion
    # inputs, one contiguous sequence right-padded, so plain causal attention is exactly the
    # row's mask (its prompt, then its own earlier tokens; padding comes after every real token)
    # and the kernel skips the masked half; the prompt's queries are recomputed there (prompts are
    # short) and only the completion positions are kept.
    buckets: list[tuple[torch.Tensor, torch.Tensor]] = []  # (rows, width) gather index, kept positions
    for rows in length_buckets(plen.tolist()):
        buckets.append(_padded_index(p_start[rows], plen[rows], int(plen[rows].max())))
    seq = torch.where(cin > 0, plen[row] + cin, 0)  # rows without completion inputs attend from nothing
    for rows in length_buckets(seq.tolist()):
        r = torch.tensor(rows)
        pl, cl = plen[row[r]], cin[r]
        t = torch.arange(int((pl + cl).max()))[None, :]
        in_prompt = t < pl[:, None]
        real = t < (pl + cl)[:, None]
        idx = torch.where(in_prompt, p_start[row[r]][:, None] + t, c_start[r][:, None] + t - pl[:, None])
        buckets.append((torch.where(real, idx, idx[:, :1]), real & ~in_prompt))

    def layer(block: Any, x: torch.Tensor) -> torch.Tensor:
        q, k, v = project(block, x, cos, sin, dims)  # (N, H, D), (N, KV, D) x 2
        where, what = [], []  # each bucket's kept positions and their attention outputs, put in place once
        for idx, keep in buckets:
            a = attention(
                q[idx].transpose(1, 2), k[idx].transpose(1, 2), v[idx].transpose(1, 2), is_causal=True, enable_gqa=gqa
            )  # (b, H, L, D)
            where.append(idx[keep])
            what.append(a.transpose(1, 2)[keep])
        # every position exactly once; in the attention's dtype (bf16 under autocast, where q is float32
        # after the float32 rotation)
        kept = torch.cat(what)
        out = q.new_zeros(q.shape, dtype=kept.dtype).index_put((torch.cat(where),), kept)
        return finish(block, x, out.reshape(-1, H * D))

    x = dec.embed_tokens(tokens)  # (N, hidden)
    for block in dec.layers:
        x = run_layer(layer, block, x, checkpoint)
    x = dec.norm(x)
    # Row b's targets: token 0 predicted by its prompt's last token, token t >= 1 by its input t - 1.
    first = x[p_start + plen - 1][row]  # (B, hidden)
    t = torch.arange(int(clen.max()))[None, :]
    src = torch.where(t == 0, -1, c_start[:, None] + t - 1)[t < clen[:, None]]  # (N_targets,), -1: the prompt's
    row_of = torch.repeat_interleave(torch.arange(B), clen)
    return torch.where((src < 0)[:, None], first[row_of], x[src.clamp_min(0)])


def packed_logprobs(
    model: Any,
    batch: Mapping[str, Any],
    temperature: float,
    chunk_rows: int,
    with_entropy: bool,
    checkpoint: bool = False,
    compiled: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """(B, T) logprobs [and entropies] of the completion tokens, 0 at padding, from the packed
    forward; the LM head sees at most chunk_rows x T positions at once, as the padded path.
    `checkpoint`: recompute each decoder layer in the backward (forward.run_layer); `compiled`: the
    layers' halves around attention compiled (trainer/layer.py)."""
    targets, clen = batch["targets"], batch["completion_len"]
    B, T = targets.shape
    inside = torch.arange(T)[None, :] < clen[:, None]  # (B, T)
    hidden = packed_hidden(model, batch, checkpoint, compiled)  # (N, hidden)
    keep = batch.get("keep")
    got = token_logprobs(
        hidden[:, None],
        model.get_output_embeddings(),
        targets[inside][:, None],
        temperature,
        chunk_rows * T,
        with_entropy,
        keep[inside][:, None] if keep is not None else None,
    )
    parts = got if isinstance(got, tuple) else (got,)
    outs = []
    for p in parts:
        full = torch.zeros((B, T), dtype=p.dtype)
        outs.append(full.masked_scatter(inside, p[:, 0]))
    return (outs[0], outs[1]) if with_entropy else outs[0]
