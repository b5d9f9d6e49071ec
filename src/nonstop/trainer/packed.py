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

Prompts that begin alike (a chat template's head, one system prompt for the whole dataset) share
that head across the batch's groups: the distinct prompts' common prefix (`shared_prefix_len`, at
most the shortest prompt less one token) is packed once, and each prompt packs only its own tail.
Every bucket that attends over a prompt gathers the head's keys from that one copy, so autograd
sums their gradients back into it, and the head's own outputs are kept from the first prompt's
row of its bucket (the causal attention there is exactly the head's). The function is the same;
(Q - 1) x head tokens of projections, MLPs and norms are saved. The SmolLM2 recipe's prompts (36-43
tokens) share 24, the template's system turn and the user turn's opening: at 8 groups a step, 168
tokens fewer of the 307 prompt tokens.

Contract: `packed_hidden(model, batch, share_prefix=True)` takes the shared-prompt batch of
Trainer.batch_of plus `completion_len` (B,) and returns (N, hidden), the final-normed hidden states
that predict the N = sum(completion_len) completion tokens, in row-major order (row b's tokens
0..len_b - 1, then row b + 1's): the same values as `prompt_shared_hidden(model, batch)[in_completion]`
up to float rounding (the sums run in other orders), with or without the shared head
(`share_prefix=False` packs every prompt whole). Each row's rotary positions are its own (the
prompt from 0, completion token t at P_b + t) and a row sees only its prompt and its own earlier
tokens: the block-diagonal mask of a varlen batch, as one causal mask per bucket. Same models as
forward.py (`unsupported`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from nonstop.device import attention
from nonstop.trainer.forward import decoder_model, run_layer
from nonstop.trainer.layer import Dims, halves
from nonstop.trainer.logprobs import token_logprobs
from nonstop.types import shared_prefix_len

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


def packed_hidden(
    model: Any, batch: Mapping[str, Any], checkpoint: bool = False, compiled: bool = False, share_prefix: bool = True
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
    prompt_ids = batch["prompt_ids"]  # (Q, Lp)
    S = shared_prefix_len([p[:n] for p, n in zip(prompt_ids.tolist(), plen.tolist())]) if share_prefix else 0
    tail = plen - S  # (Q,) each prompt's own tokens after the shared head, >= 1
    j = torch.arange(prompt_ids.shape[1])[None, :]
    in_tail = (j >= S) & (j < plen[:, None])
    in_comp = torch.arange(batch["completion_in"].shape[1])[None, :] < cin[:, None]
    # the packed matrix: the shared head once, every prompt's tail, every row's completion inputs
    tokens = torch.cat([prompt_ids[0, :S], prompt_ids[in_tail], batch["completion_in"][in_comp]])  # (Np + Nc,)
    Np = S + int(tail.sum())
    t_start = S + torch.cumsum(tail, 0) - tail  # (Q,) where each prompt's tail starts
    c_start = Np + torch.cumsum(cin, 0) - cin  # (B,) where each row's completion inputs start

    def prompt_at(q: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Packed index of position t (n, w) of prompt q (n,): the head's copy below S, else q's tail."""
        return torch.where(t < S, t, t_start[q][:, None] + t - S)

    # Rotary position of every packed token: the head from 0, a tail from S, a row's completion input t
    # at P_b + t.
    pos = torch.cat(
        [
            torch.arange(S),
            torch.arange(S, Np) - torch.repeat_interleave(t_start - S, tail),
            torch.arange(int(cin.sum()))
            - torch.repeat_interleave(c_start - Np, cin)
            + torch.repeat_interleave(plen[row], cin),
        ]
    )
    cos, sin = dec.rotary_emb(dec.embed_tokens.weight[:1], pos[None])  # (1, N, D)
    cos, sin = cos[0][:, None], sin[0][:, None]  # (N, 1, D), broadcast over heads

    # Index tensors of each attention bucket, the same in every layer: a row's whole sequence gathered
    # from the packed matrix (the head's copy, then its own tokens), right-padded with its first
    # token, so plain causal attention is exactly the row's mask (padding comes after every real
    # token) and the kernel skips the masked half; only the positions the bucket owns are kept. A
    # prompt bucket owns its prompts' tails (and the first one the head); a completion bucket its
    # rows' completion inputs, the prompt's queries recomputed there (prompts are short).
    buckets: list[tuple[torch.Tensor, torch.Tensor]] = []  # (rows, width) gather index, kept positions
    for n, rows in enumerate(length_buckets(plen.tolist())):
        r = torch.tensor(rows)
        t = torch.arange(int(plen[r].max()))[None, :]
        real = t < plen[r][:, None]
        idx = prompt_at(r, t)
        owned = real & (t >= S)
        if n == 0:
            owned[0] = real[0]  # the head's outputs, from the first prompt's row
        buckets.append((torch.where(real, idx, idx[:, :1]), owned))
    seq = torch.where(cin > 0, plen[row] + cin, 0)  # rows without completion inputs attend from nothing
    for rows in length_buckets(seq.tolist()):
        r = torch.tensor(rows)
        pl, cl = plen[row[r]], cin[r]
        t = torch.arange(int((pl + cl).max()))[None, :]
        in_prompt = t < pl[:, None]
        real = t < (pl + cl)[:, None]
        idx = torch.where(in_prompt, prompt_at(row[r], t), c_start[r][:, None] + t - pl[:, None])
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
    first = x[t_start + tail - 1][row]  # (B, hidden): each prompt's last token, in its own tail
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
    share_prefix: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """(B, T) logprobs [and entropies] of the completion tokens, 0 at padding, from the packed
    forward; the LM head sees at most chunk_rows x T positions at once, as the padded path.
    `checkpoint`: recompute each decoder layer in the backward (forward.run_layer); `compiled`: the
    layers' halves around attention compiled (trainer/layer.py); `share_prefix`: the prompts' shared
    head packed once (trainer.shared_prefix)."""
    targets, clen = batch["targets"], batch["completion_len"]
    B, T = targets.shape
    inside = torch.arange(T)[None, :] < clen[:, None]  # (B, T)
    hidden = packed_hidden(model, batch, checkpoint, compiled, share_prefix)  # (N, hidden)
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
