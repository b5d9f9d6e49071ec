"""The model runner: a lean forward over a Llama-family decoder with a preallocated KV cache.

Contract:
- the cache holds `num_slots` sequences of at most `max_seq_len` tokens, allocated once
  (layers x 2 x num_slots x kv_heads x max_seq_len x head_dim floats); nothing is allocated
  per step beyond the step's activations;
- the rows of a decode step are slots 0..B-1 (the scheduler keeps live sequences packed at the
  front with `move`, which copies any number of slots at once), so attention reads a view of the
  cache, never a gathered copy;
- `prefill(slots, prompts)` computes the KV of whole prompts into the given slots and returns
  the logits after each prompt's last token; `decode(tokens, positions)` appends one token per
  row at its position and returns the next-token logits; `mixed(...)` does both in one forward
  (decode rows 0..B-1 plus prompts into slots >= B): the B + P token streams are packed into
  one matrix for every linear layer and split only for attention, so a step that admits new
  requests costs one forward, not two; all return float32 (rows, V);
- weights are read from the model's own Parameter objects on every call, so a weight update
  that copies into them (or rebinds their storage) is picked up by the next forward pass.

Supported: decoder-only models shaped like Qwen2/Llama/Mistral (`model.model.layers` with
`self_attn.{q,k,v,o}_proj`, a gated SiLU MLP, RMSNorm, rotary embeddings, full attention).
Anything else is refused at construction with a message naming what differs.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F


ATTN_BLOCK = 16  # decode rows per attention block when a long tail makes one padded block wasteful


class UnsupportedModel(ValueError):
    """The model's architecture is outside what the lean runner implements."""


class Runner(Protocol):
    num_slots: int
    max_seq_len: int
    vocab_size: int

    def prefill(self, slots: torch.Tensor, prompts: list[list[int]]) -> torch.Tensor: ...

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...

    def mixed(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
              prompts: list[list[int]]) -> torch.Tensor: ...

    def move(self, src: list[int], dst: list[int], length: int) -> None: ...

    def save(self, slot: int, length: int) -> list[torch.Tensor]: ...

    def restore(self, slot: int, saved: list[torch.Tensor]) -> None: ...


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class _Layer:
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

    def __init__(self, block: Any) -> None:
        """`block`: a Llama-family decoder layer, its submodules found by name (nn.Module types
        attribute lookups only as Tensor | Module; _check_supported vouches for the names)."""
        attn, mlp = block.self_attn, block.mlp
        self.ln1, self.ln2 = block.input_layernorm.weight, block.post_attention_layernorm.weight
        self.eps1 = block.input_layernorm.variance_epsilon
        self.eps2 = block.post_attention_layernorm.variance_epsilon
        self.wq, self.bq = attn.q_proj.weight, attn.q_proj.bias
        self.wk, self.bk = attn.k_proj.weight, attn.k_proj.bias
        self.wv, self.bv = attn.v_proj.weight, attn.v_proj.bias
        self.wo, self.bo = attn.o_proj.weight, attn.o_proj.bias
        self.wg, self.wu, self.wd = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight


def _check_supported(model: torch.nn.Module) -> None:
    cfg = model.config
    problems = []
    if not hasattr(model, "model") or not hasattr(model.model, "layers"):
        problems.append("no model.layers")
    if getattr(cfg, "hidden_act", None) not in ("silu", "swish"):
        problems.append(f"hidden_act {getattr(cfg, 'hidden_act', None)!r} (needs silu)")
    if getattr(cfg, "use_sliding_window", False):
        problems.append("sliding-window attention")
    if problems:
        raise UnsupportedModel(f"{type(model).__name__}: the engine's runner supports Llama-family decoders; "
                               f"this model has {', '.join(problems)}")


class KVRunner:
    def __init__(self, model: torch.nn.Module, num_slots: int, max_seq_len: int) -> None:
        _check_supported(model)
        hf: Any = model  # a transformers causal LM: modules found by name, as in _Layer
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
        self.layers = [_Layer(b) for b in hf.model.layers]
        dtype = self.embed.dtype
        shape = (num_slots, self.n_kv, max_seq_len, self.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in self.layers]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in self.layers]
        with torch.no_grad():  # rotary tables for every position, from the model's own rotary module
            pos = torch.arange(max_seq_len)[None]
            cos, sin = hf.model.rotary_emb(torch.zeros(1, dtype=dtype), pos)
        self.cos, self.sin = cos[0], sin[0]  # (T, D)
        self.arange = torch.arange(max_seq_len)
        self.rows = torch.arange(num_slots)

    def _plan(self, positions: torch.Tensor) -> list[tuple[int, int, int, torch.Tensor]]:
        """Attention blocks of a decode step: (first row, end row, keys T, mask (rows, 1, 1, T)).

        One block reads every row's keys up to the longest row; with a long tail that wastes
        most of the attention on padding, so rows are split into blocks of ATTN_BLOCK rows, each
        reading only up to its own longest row, whenever that saves at least a third."""
        pos = positions.tolist()
        B, T = len(pos), max(pos) + 1
        bounds = [(a, min(a + ATTN_BLOCK, B)) for a in range(0, B, ATTN_BLOCK)]
        blocked = [(a, b, max(pos[a:b]) + 1) for a, b in bounds]
        if len(blocked) == 1 or sum((b - a) * t for a, b, t in blocked) > B * T * 2 / 3:
            blocked = [(0, B, T)]
        return [(a, b, t, (self.arange[:t][None, :] <= positions[a:b, None])[:, None, None, :]) for a, b, t in blocked]

    def _attend(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, plan) -> torch.Tensor:
        """q (B, H, 1, D) of decode rows 0..B-1 against their cached keys -> (B, H * D)."""
        B, gqa = q.shape[0], self.n_kv != self.n_heads
        out = [F.scaled_dot_product_attention(q[a:b], kc[a:b, :, :t], vc[a:b, :, :t], attn_mask=m, enable_gqa=gqa)
               for a, b, t, m in plan]
        return (out[0] if len(out) == 1 else torch.cat(out)).reshape(B, self.n_heads * self.head_dim)

    @property
    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def _mlp(self, x: torch.Tensor, layer: _Layer) -> torch.Tensor:
        h = F.rms_norm(x, (self.hidden,), layer.ln2, layer.eps2)
        return x + F.linear(F.silu(F.linear(h, layer.wg)) * F.linear(h, layer.wu), layer.wd)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.rms_norm(x, (self.hidden,), self.norm, self.norm_eps), self.lm_head).float()

    @torch.inference_mode()
    def prefill(self, slots: torch.Tensor, prompts: list[list[int]]) -> torch.Tensor:
        """Prompts right-padded into one (P, L) batch; causal attention never lets a real token
        see the padding after it, and each slot's length is its own prompt's."""
        P, L = len(prompts), max(len(p) for p in prompts)
        ids = torch.zeros((P, L), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        last = torch.tensor([len(p) - 1 for p in prompts])
        H, KV, D = self.n_heads, self.n_kv, self.head_dim
        cos, sin = self.cos[:L], self.sin[:L]  # (L, D), broadcast over (P, heads, L, D)
        x = F.embedding(ids, self.embed)  # (P, L, hidden)
        for layer, kc, vc in zip(self.layers, self.k, self.v):
            h = F.rms_norm(x, (self.hidden,), layer.ln1, layer.eps1)
            q = F.linear(h, layer.wq, layer.bq).view(P, L, H, D).transpose(1, 2)
            k = F.linear(h, layer.wk, layer.bk).view(P, L, KV, D).transpose(1, 2)
            v = F.linear(h, layer.wv, layer.bv).view(P, L, KV, D).transpose(1, 2)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            kc[slots, :, :L] = k
            vc[slots, :, :L] = v
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=KV != H)  # (P, H, L, D)
            x = x + F.linear(a.transpose(1, 2).reshape(P, L, H * D), layer.wo, layer.bo)
            x = self._mlp(x, layer)
        return self._logits(x[torch.arange(P), last])  # (P, V)

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens, positions: (B,) for rows (slots) 0..B-1; writes K/V at each row's position."""
        B = tokens.shape[0]
        H, KV, D = self.n_heads, self.n_kv, self.head_dim
        cos, sin = self.cos[positions][:, None, None, :], self.sin[positions][:, None, None, :]  # (B, 1, 1, D)
        plan = self._plan(positions)
        rows = self.rows[:B]
        x = F.embedding(tokens, self.embed)  # (B, hidden)
        for layer, kc, vc in zip(self.layers, self.k, self.v):
            h = F.rms_norm(x, (self.hidden,), layer.ln1, layer.eps1)
            q = F.linear(h, layer.wq, layer.bq).view(B, H, 1, D)
            k = F.linear(h, layer.wk, layer.bk).view(B, KV, 1, D)
            v = F.linear(h, layer.wv, layer.bv).view(B, KV, D)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            kc[rows, :, positions] = k[:, :, 0]
            vc[rows, :, positions] = v
            x = x + F.linear(self._attend(q, kc, vc, plan), layer.wo, layer.bo)
            x = self._mlp(x, layer)
        return self._logits(x)  # (B, V)

    @torch.inference_mode()
    def mixed(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
              prompts: list[list[int]]) -> torch.Tensor:
        """Decode rows 0..B-1 and prefill `prompts` into `slots` (all >= B) in one forward.
        Returns (B + P, V): the decode rows' logits, then each prompt's last-token logits."""
        B, P, L = tokens.shape[0], len(prompts), max(len(p) for p in prompts)
        H, KV, D = self.n_heads, self.n_kv, self.head_dim
        lengths = [len(p) for p in prompts]
        # packed prompt token i of prompt j sits at padded index j * L + i
        pad_index = torch.cat([torch.arange(n) + j * L for j, n in enumerate(lengths)])  # (Np,)
        ids = torch.cat([tokens, torch.tensor([t for p in prompts for t in p], dtype=torch.long)])  # (B + Np,)
        pos = torch.cat([positions, torch.cat([torch.arange(n) for n in lengths])])
        cos, sin = self.cos[pos][:, None, :], self.sin[pos][:, None, :]  # (N, 1, D)
        plan = self._plan(positions)
        rows = self.rows[:B]
        last = torch.tensor(lengths).cumsum(0) - 1 + B  # packed index of each prompt's last token

        def padded(t: torch.Tensor, heads: int) -> torch.Tensor:  # (Np, heads, D) -> (P, heads, L, D)
            out = t.new_zeros((P * L, heads, D))
            out[pad_index] = t
            return out.view(P, L, heads, D).transpose(1, 2)

        x = F.embedding(ids, self.embed)  # (N, hidden)
        for layer, kc, vc in zip(self.layers, self.k, self.v):
            h = F.rms_norm(x, (self.hidden,), layer.ln1, layer.eps1)
            q = _rotate(F.linear(h, layer.wq, layer.bq).view(-1, H, D), cos, sin)
            k = _rotate(F.linear(h, layer.wk, layer.bk).view(-1, KV, D), cos, sin)
            v = F.linear(h, layer.wv, layer.bv).view(-1, KV, D)
            kc[rows, :, positions] = k[:B]
            vc[rows, :, positions] = v[:B]
            ad = self._attend(q[:B, :, None, :], kc, vc, plan)
            qp, kp, vp = padded(q[B:], H), padded(k[B:], KV), padded(v[B:], KV)
            kc[slots, :, :L] = kp
            vc[slots, :, :L] = vp
            ap = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=KV != H)  # (P, H, L, D)
            ap = ap.transpose(1, 2).reshape(P * L, H * D)[pad_index]
            x = x + F.linear(torch.cat([ad, ap]), layer.wo, layer.bo)
            x = self._mlp(x, layer)
        return self._logits(x[torch.cat([torch.arange(B), last])])

    def move(self, src: list[int], dst: list[int], length: int) -> None:
        """Copy the first `length` cached positions of slot src[i] into slot dst[i], for every i in
        one indexed copy per cache tensor (no slot may be both a source and a destination)."""
        if not src:
            return
        s, d = torch.tensor(src), torch.tensor(dst)
        for c in self.k + self.v:
            c[d, :, :length] = c[s, :, :length]

    def save(self, slot: int, length: int) -> list[torch.Tensor]:
        """A private copy of one slot's cache (for pausing a sequence across a weight update)."""
        return [c[slot, :, :length].clone() for c in self.k + self.v]

    def restore(self, slot: int, saved: list[torch.Tensor]) -> None:
        for c, s in zip(self.k + self.v, saved):
            c[slot, :, : s.shape[1]] = s
