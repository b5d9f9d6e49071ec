"""The model runner: a lean forward over a Llama-family decoder with a preallocated KV cache.

Contract:
- the cache holds `num_slots` sequences of at most `max_seq_len` tokens, allocated once
  (layers x 2 x num_slots x kv_heads x max_seq_len x head_dim floats); nothing is allocated
  per step beyond the step's activations;
- the rows of a decode step are slots 0..B-1 (the scheduler keeps live sequences packed at the
  front with `move`, which copies any number of slots at once), so attention reads a view of the
  cache, never a gathered copy; it reads in blocks of rows, each up to its longest row
  (engine/blocks.py), so the scheduler keeps rows near descending length with `permute`;
- `prefill(slots, prompts, starts)` computes the KV of prompts into the given slots and returns
  the logits after each prompt's last token; `decode(tokens, positions)` appends one token per
  row at its position and returns the next-token logits; `mixed(...)` does both in one forward
  (decode rows 0..B-1 plus prompts into slots >= B): the B + P token streams are packed into
  one matrix for every linear layer and split only for attention, so a step that admits new
  requests costs one forward, not two; all return float32 (rows, V). A prompt given with a
  start s continues its slot's first s cached positions (a cached prefix, engine/prefix.py):
  its tokens take positions s.. and attend to those keys as to their own;
- weights are read from the model's own Parameter objects on every call, so a weight update
  that copies into them (or rebinds their storage) is picked up by the next forward pass;
- mixture-of-experts blocks (Qwen3-MoE, Qwen2-MoE with its gated shared expert) route as
  transformers does (softmax in float32 over the router logits, top-k, optional renormalisation);
  after every forward `routes` holds the experts chosen for each input token of that pass,
  (N, moe_layers, k) uint8 (int16 above 256 experts), rows in the order of the tokens: decode
  rows 0..B-1, then each prompt's real tokens in turn (None for a dense model).

Supported: decoder-only models shaped like Qwen2/Llama/Mistral/Qwen3 (`model.model.layers` with
`self_attn.{q,k,v,o}_proj`, optional per-head q/k RMSNorm, a gated SiLU MLP or a MoE block of
fused SiLU experts, RMSNorm, rotary embeddings, full attention). Anything else is refused at
construction with a message naming what differs.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from nonstop.device import amx_supported, attention
from nonstop.engine.blocks import attention_blocks
from nonstop.engine.layers import Layer, check_supported

MOVE_BY_SLICES = 8  # up to this many slots, `move` copies slot by slot (no index tensors, no gathered copy)


class Runner(Protocol):
    num_slots: int
    max_seq_len: int
    vocab_size: int
    moe_layers: int
    top_k: int
    num_experts: int
    routes: torch.Tensor | None
    attention_reads: int  # cached positions decode attention read so far, padding included

    cache: torch.Tensor  # (2 x layers, slots, kv heads, positions, head dim): every layer's keys and values

    def prefill(
        self,
        slots: torch.Tensor,
        prompts: list[list[int]],
        starts: list[int] | None = None,
        shares: list[tuple[int, int, int]] | None = None,
    ) -> torch.Tensor: ...

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...

    def mixed(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        prompts: list[list[int]],
        starts: list[int] | None = None,
        shares: list[tuple[int, int, int]] | None = None,
    ) -> torch.Tensor: ...

    def move(self, src: list[int], dst: list[int], length: int) -> None: ...

    def permute(self, order: list[int], lengths: list[int]) -> None: ...

    def save(self, slot: int, length: int) -> list[torch.Tensor]: ...

    def restore(self, slot: int, saved: list[torch.Tensor]) -> None: ...


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros; on the CPU from calloc (through numpy), whose pages the OS commits on first write, so a
    cache sized for the most it may hold costs memory only where it is used (torch.zeros writes
    every page). Never torch.empty: stale memory may hold NaN, which attention weights of zero do
    not cancel."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    raw = np.zeros(math.prod(shape) * dtype.itemsize, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor, enable_gqa: bool
) -> torch.Tensor:
    """Attention of one query per row, in float32: q (B, H, 1, D) against k, v (B, KV, T, D) with
    attn_mask (B, 1, 1, T) True where a key is seen -> (B, H, 1, D) in q's dtype. Query head h reads
    key head h // (H / KV), as SDPA's enable_gqa does; every row sees at least one key."""
    B, H, _, D = q.shape
    KV, G = k.shape[1], H // k.shape[1]
    scores = torch.matmul(q.reshape(B, KV, G, D).float(), k.float().transpose(-1, -2))  # (B, KV, G, T)
    scores = scores.mul_(D**-0.5).masked_fill_(~attn_mask, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v.float())  # (B, KV, G, D)
    return out.view(B, H, 1, D).to(q.dtype)


class KVRunner:
    def __init__(self, model: torch.nn.Module, num_slots: int, max_seq_len: int) -> None:
        check_supported(model)
        hf: Any = model  # a transformers causal LM: modules found by name, as in Layer
        cfg = hf.config
        self.model = model
        self.num_slots, self.max_seq_len = num_slots, max_seq_len
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.hidden = cfg.hidden_size
        self.embed: torch.Tensor = hf.model.embed_tokens.weight
        self.norm: torch.Tensor = hf.model.norm.weight
        self.norm_eps: float = hf.model.norm.variance_epsilon
        self.lm_head: torch.Tensor = hf.lm_head.weight
        self.vocab_size: int = self.lm_head.shape[0]
        self.layers = [Layer(b) for b in hf.model.layers]
        dtype = self.embed.dtype
        shape = (num_slots, self.n_kv, max_seq_len, self.head_dim)
        # one allocation for every layer's keys and values (2 x layers, *shape): `move` copies a
        # slot of all of them at once; k[i] and v[i] are views of it
        self.cache = lazy_zeros((2 * len(self.layers), *shape), dtype, self.embed.device)
        self.k = [self.cache[2 * i] for i in range(len(self.layers))]
        self.v = [self.cache[2 * i + 1] for i in range(len(self.layers))]
        with torch.no_grad():  # rotary tables for every position, from the model's own rotary module
            pos = torch.arange(max_seq_len)[None]
            cos, sin = hf.model.rotary_emb(torch.zeros(1, dtype=dtype), pos)
        self.cos, self.sin = cos[0], sin[0]  # (T, D)
        self.arange = torch.arange(max_seq_len)
        self.rows = torch.arange(num_slots)
        moe = [layer.moe for layer in self.layers if layer.moe is not None]
        self.moe_layers = len(moe)
        self.top_k = moe[0].top_k if moe else 0
        self.num_experts = moe[0].num_experts if moe else 0
        self.route_dtype = torch.uint8 if self.num_experts <= 256 else torch.int16
        self.routes: torch.Tensor | None = None
        self._routes: list[torch.Tensor] = []
        self.attention_reads = 0  # cached positions decode attention read so far, padding included
        # attention of a bf16 model: bfloat16 straight through torch's kernel on a CPU with AMX (3-5x
        # faster there than casting the cached keys and values up at every layer: 0.87 against 3.79 ms
        # for 64 rows of 128 positions at SmolLM2's 9 / 3 heads, torch 2.13); elsewhere float32
        # (device.attention). With AVX512-BF16 alone torch's bf16 kernel is the slow one: 2.6 against
        # 0.53 ms for 64 decode rows of 56 positions (5.5 against 1.26 at 120), 1.05 against 0.89 ms
        # for 8 prompts of 45 tokens, on an AMD EPYC (Zen 5) with torch 2.13
        native = dtype == torch.bfloat16 and amx_supported(self.embed.device)
        self._sdpa = F.scaled_dot_product_attention if native else attention
        # decode rows of a bf16 model without AMX: one query per row, as two float32 matmuls (0.74
        # against 0.94 ms for SDPA over the same float32 casts, 64 rows of 94 positions, AMD EPYC)
        on_cpu = self.embed.device.type == "cpu"
        self._decode_sdpa = decode_attention if dtype == torch.bfloat16 and on_cpu and not native else self._sdpa

    def _plan(self, positions: torch.Tensor) -> list[tuple[int, int, int, torch.Tensor]]:
        """Attention blocks of a decode step (`attention_blocks`), each with its mask (rows, 1, 1, T)."""
        blocks = attention_blocks([p + 1 for p in positions.tolist()])
        self.attention_reads += sum((b - a) * t for a, b, t in blocks)
        T = max(t for _, _, t in blocks)
        mask = (self.arange[:T][None, :] <= positions[:, None])[:, None, None, :]  # (B, 1, 1, T), sliced per block
        return [(a, b, t, mask[a:b, :, :, :t]) for a, b, t in blocks]

    def _attend(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, plan) -> torch.Tensor:
        """q (B, H, 1, D) of decode rows 0..B-1 against their cached keys -> (B, H * D)."""
        B, gqa, sdpa = q.shape[0], self.n_kv != self.n_heads, self._decode_sdpa
        out = [sdpa(q[a:b], kc[a:b, :, :t], vc[a:b, :, :t], attn_mask=m, enable_gqa=gqa) for a, b, t, m in plan]
        return (out[0] if len(out) == 1 else torch.cat(out)).reshape(B, self.n_heads * self.head_dim)

    @property
    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def _mlp(self, x: torch.Tensor, layer: Layer) -> torch.Tensor:
        h = F.rms_norm(x, (self.hidden,), layer.ln2, layer.eps2)
        if layer.moe is None:
            return x + F.linear(F.silu(F.linear(h, layer.wg)) * F.linear(h, layer.wu), layer.wd)
        shape = h.shape
        out, experts = layer.moe(h.reshape(-1, self.hidden))
        self._routes.append(experts.to(self.route_dtype))
        return x + out.view(shape)

    def _keep_routes(self, order: torch.Tensor | None = None) -> None:
        """Stack the pass's per-layer routes into `routes` (N, moe_layers, k), rows picked by `order`."""
        if not self._routes:
            self.routes = None
            return
        routes = torch.stack(self._routes, dim=1)  # (rows of the pass, moe_layers, k)
        self._routes = []
        self.routes = routes if order is None else routes[order]

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.rms_norm(x, (self.hidden,), self.norm, self.norm_eps), self.lm_head).float()

    @torch.inference_mode()
    def prefill(
        self,
        slots: torch.Tensor,
        prompts: list[list[int]],
        starts: list[int] | None = None,
        shares: list[tuple[int, int, int]] | None = None,
    ) -> torch.Tensor:
        """Prompts right-padded into one (P, L) batch; causal attention never lets a real token
        see the padding after it, and each slot's length is its own prompt's. With `starts` (and
        `shares`), prompt j continues its slot's first starts[j] positions (`mixed` without decode rows)."""
        if starts is not None and any(starts):
            none = torch.empty(0, dtype=torch.long)
            return self.mixed(none, none, slots, prompts, starts, shares)
        P, L = len(prompts), max(len(p) for p in prompts)
        ids = torch.zeros((P, L), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        last = torch.tensor([len(p) - 1 for p in prompts])
        H, KV, D = self.n_heads, self.n_kv, self.head_dim
        cos, sin = self.cos[:L], self.sin[:L]  # (L, D), broadcast over (P, heads, L, D)
        self._routes = []  # a pass that raised may have left some layers' routes
        x = F.embedding(ids, self.embed)  # (P, L, hidden)
        for layer, kc, vc in zip(self.layers, self.k, self.v):
            h = F.rms_norm(x, (self.hidden,), layer.ln1, layer.eps1)
            q, k = layer.qk(
                F.linear(h, layer.wq, layer.bq).view(P, L, H, D), F.linear(h, layer.wk, layer.bk).view(P, L, KV, D)
            )
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            v = F.linear(h, layer.wv, layer.bv).view(P, L, KV, D).transpose(1, 2)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            kc[slots, :, :L] = k
            vc[slots, :, :L] = v
            a = self._sdpa(q, k, v, is_causal=True, enable_gqa=KV != H)  # (P, H, L, D)
            x = x + F.linear(a.transpose(1, 2).reshape(P, L, H * D), layer.wo, layer.bo)
            x = self._mlp(x, layer)
        if self._routes:  # a MoE model: keep the real tokens' routes only (a dense model builds no order)
            self._keep_routes(torch.cat([torch.arange(len(p)) + j * L for j, p in enumerate(prompts)]))
        else:
            self.routes = None
        return self._logits(x[torch.arange(P), last])  # (P, V)

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens, positions: (B,) for rows (slots) 0..B-1; writes K/V at each row's position."""
        B = tokens.shape[0]
        H, KV, D = self.n_heads, self.n_kv, self.head_dim
        cos, sin = self.cos[positions][:, None, None, :], self.sin[positions][:, None, None, :]  # (B, 1, 1, D)
        plan = self._plan(positions)
        rows = self.rows[:B]
        self._routes = []
        x = F.embedding(tokens, self.embed)  # (B, hidden)
        for layer, kc, vc in zip(self.layers, self.k, self.v):
            h = F.rms_norm(x, (self.hidden,), layer.ln1, layer.eps1)
            q, k = layer.qk(
                F.linear(h, layer.wq, layer.bq).view(B, H, 1, D), F.linear(h, layer.wk, layer.bk).view(B, KV, 1, D)
            )
            v = F.linear(h, layer.wv, layer.bv).view(B, KV, D)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            kc[rows, :, positions] = k[:, :, 0]
            vc[rows, :, positions] = v
            x = x + F.linear(self._attend(q, kc, vc, plan), layer.wo, layer.bo)
            x = self._mlp(x, layer)
        self._keep_routes()
        return self._logits(x)  # (B, V)

    @torch.inference_mode()
    def mixed(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        prompts: list[list[int]],
        starts: list[int] | None = None,
        shares: list[tuple[int, int, int]] | None = None,
    ) -> torch.Tensor:
        """Decode rows 0..B-1 (B may be 0) and prefill `prompts` into `slots` (all >= B) in one
        forward. Prompt j's tokens take positions starts[j].. of its slot (default 0): the positions
        before are cached already (a cached prefix) or come from `shares`, and its tokens attend to
        them. `shares`: (source slot, slot, n) in order, each copying the source's first n positions,
        computed in this pass, into the slot at every layer, once that layer's keys and values are
        written and before its attention: a prompt that begins like another of the same pass
        computes only its tail. Returns (B + P, V): the decode rows' logits, then each prompt's
        last-token logits."""
        B, P, L = tokens.shape[0], len(prompts), max(len(p) for p in prompts)
        H, KV, D = self.n_heads, self.n_kv, self.head_dim
        starts = starts or [0] * P
        # index lists built in Python, all in one tensor: packed prompt token i of prompt
        # j sits at padded index j * L + i and goes to cache slot slots[j], position starts[j] + i
        slot_list = slots.tolist()
        keep, end = list(range(B)), B
        for p in prompts:  # the decode rows, then the packed index of each prompt's last token
            end += len(p)
            keep.append(end - 1)
        index = torch.tensor(  # one tensor for the four index lists and the kept rows
            [j * L + i for j, p in enumerate(prompts) for i in range(len(p))]
            + [t for p in prompts for t in p]
            + [a + i for a, p in zip(starts, prompts) for i in range(len(p))]
            + [slot_list[j] for j, p in enumerate(prompts) for _ in p]
            + keep
        )
        Np = end - B
        pad_index = index[:Np]  # (Np,)
        ids = torch.cat([tokens, index[Np : 2 * Np]])  # (N,)
        pos = torch.cat([positions, index[2 * Np : 3 * Np]])  # (N,)
        where = torch.cat([self.rows[:B], index[3 * Np : 4 * Np]])  # (N,) cache slot of every token
        last = index[4 * Np :]
        cos, sin = self.cos[pos][:, None, :], self.sin[pos][:, None, :]  # (N, 1, D)
        plan = self._plan(positions) if B else []
        # the prompts' keys: a view of their slots when those are consecutive (the scheduler puts
        # a pass's prompts in consecutive slots), else a gathered copy
        T = max(a + len(p) for a, p in zip(starts, prompts))
        first = slot_list[0]
        consecutive = slot_list == list(range(first, first + P))
        mask = None
        if any(starts):  # query i of prompt j sees keys up to its own position starts[j] + i
            ends = torch.tensor(starts)[:, None] + self.arange[:L][None, :]  # (P, L)
            mask = (self.arange[:T][None, None, :] <= ends[:, :, None])[:, None]  # (P, 1, L, T)

        self._routes = []
        x = F.embedding(ids, self.embed)  # (N, hidden)
        for layer, kc, vc in zip(self.layers, self.k, self.v):
            h = F.rms_norm(x, (self.hidden,), layer.ln1, layer.eps1)
            q, k = layer.qk(
                F.linear(h, layer.wq, layer.bq).view(-1, H, D), F.linear(h, layer.wk, layer.bk).view(-1, KV, D)
            )
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            v = F.linear(h, layer.wv, layer.bv).view(-1, KV, D)
            # every token's K/V goes to its slot and position in one write; the prompts' attention
            # reads its keys back from the cache (past a prompt's end lies other data, which the
            # causal mask keeps from every real token)
            kc[where, :, pos] = k
            vc[where, :, pos] = v
            for src, dst, n in shares or ():
                kc[dst, :, :n] = kc[src, :, :n]
                vc[dst, :, :n] = vc[src, :, :n]
            qp = q.new_zeros((P * L, H, D))
            qp[pad_index] = q[B:]
            keys = kc[first : first + P, :, :T] if consecutive else kc[slots, :, :T]
            values = vc[first : first + P, :, :T] if consecutive else vc[slots, :, :T]
            ap = self._sdpa(
                qp.view(P, L, H, D).transpose(1, 2),
                keys,
                values,
                attn_mask=mask,
                is_causal=mask is None,
                enable_gqa=KV != H,
            )  # (P, H, L, D)
            ap = ap.transpose(1, 2).reshape(P * L, H * D)[pad_index]
            a = torch.cat([self._attend(q[:B, :, None, :], kc, vc, plan), ap]) if B else ap
            x = x + F.linear(a, layer.wo, layer.bo)
            x = self._mlp(x, layer)
        self._keep_routes()
        return self._logits(x[last])

    def move(self, src: list[int], dst: list[int], length: int) -> None:
        """Copy the first `length` cached positions of slot src[i] into slot dst[i], for every i
        (no slot may be both a source and a destination), every layer's keys and values at once: a
        few slots by one slice copy each, more by one indexed copy."""
        if not src:
            return
        c = self.cache  # (2 x layers, slots, kv heads, positions, head dim)
        if len(src) <= MOVE_BY_SLICES:
            for a, b in zip(src, dst):
                c[:, b, :, :length].copy_(c[:, a, :, :length])
            return
        s, d = torch.tensor(src), torch.tensor(dst)
        c[:, d, :, :length] = c[:, s, :, :length]

    def permute(self, order: list[int], lengths: list[int]) -> None:
        """Slot i takes what slot order[i] held (its first lengths[order[i]] positions), for every i
        with order[i] != i (`order` is a permutation): each cycle of it costs one copy per slot
        plus one of its first slot, so a slot that stays costs nothing."""
        c = self.cache  # (2 x layers, slots, kv heads, positions, head dim)
        done = [False] * len(order)
        for start in range(len(order)):
            if done[start] or order[start] == start:
                continue
            first = c[:, start, :, : lengths[start]].clone()
            i = start
            while order[i] != start:
                src = order[i]
                c[:, i, :, : lengths[src]].copy_(c[:, src, :, : lengths[src]])
                done[i] = True
                i = src
            c[:, i, :, : lengths[start]].copy_(first)
            done[i] = True

    def save(self, slot: int, length: int) -> list[torch.Tensor]:
        """A private copy of one slot's cache (for pausing a sequence across a weight update)."""
        return [c[slot, :, :length].clone() for c in self.k + self.v]

    def restore(self, slot: int, saved: list[torch.Tensor]) -> None:
        for c, s in zip(self.k + self.v, saved):
            c[slot, :, : s.shape[1]] = s
