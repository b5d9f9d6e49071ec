"""The trainer's forward pass with shared prompts: each distinct prompt once, completions against its keys.

A GRPO batch holds G prompts x n completions. The plain forward (`Trainer.logprobs` on the
HF model) runs every row over prompt + completion, so each prompt is computed n times. Here
each distinct prompt runs once, and every completion attends to its prompt's keys and values
(repeated per row; autograd sums their gradients back), which is the same function of the
weights as the plain forward, in fewer FLOPs: for the default job (7-token prompts, <= 4-token
completions, n = 8) about a third of the tokens.

Contract of `prompt_shared_hidden(model, batch)`:
- batch: `prompt_ids` (Q, Lp) long, right-padded; `prompt_len` (Q,) long; `row_prompt` (B,)
  long, the prompt of each row; `completion_in` (B, T - 1) long, each row's completion tokens
  0..T-2, right-padded (token T-1 is never an input: nothing after it is predicted);
- returns (B, T, hidden): the final-normed hidden state that predicts completion token t of row
  b at [b, t] (t = 0: the prompt's last token), exactly what the plain forward gathers at
  positions P_b - 1 + t; padded positions hold values that no real position depends on;
- the decoder's own submodules (norms, q/k/v/o projections, MLP) are called as modules, so peft
  LoRA layers and DDP see them as usual; only attention and rotary positions are computed here;
- `checkpoint` (trainer.activation_checkpointing): each decoder layer's activations are recomputed
  in the backward (`run_layer`), so the forward keeps one hidden matrix per layer;
- `compiled` (trainer.compile): the layer's halves around attention run compiled (trainer/layer.py).

`unsupported(model)` says why a model cannot take this path (None when it can): decoders shaped
like Qwen2 / Llama with full causal attention, rotary positions and no attention dropout. FSDP2
shards parameters per decoder layer and gathers them in the layer's own forward, which this path
does not call, so the trainer uses the plain forward there (trainer/parallel.py).
"""

from __future__ import annotations

# Any for the model: HF decoders are reached through attributes (layers, rotary_emb, config)
# that torch's Module typing cannot describe; unsupported() checks them at run time.
from collections.abc import Callable, Mapping
from typing import Any

import torch

from nonstop.device import attention
from nonstop.trainer.layer import Dims, halves

SUPPORTED_TYPES = ("qwen2", "llama")


def decoder_model(model: Any) -> Any:
    """The causal-LM under a peft wrapper, if any."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def unsupported(model: torch.nn.Module) -> str | None:
    lm = decoder_model(model)
    cfg = getattr(lm, "config", None)
    kind = getattr(cfg, "model_type", None)
    if kind not in SUPPORTED_TYPES:
        return f"model_type {kind!r} (shared-prompt forward supports {', '.join(SUPPORTED_TYPES)})"
    dec = getattr(lm, "model", None)
    if dec is None or not all(hasattr(dec, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "no model.{embed_tokens, layers, norm, rotary_emb}"
    if getattr(cfg, "use_sliding_window", False) or any(
        t != "full_attention" for t in getattr(cfg, "layer_types", None) or []
    ):
        return "sliding-window attention"
    if float(getattr(cfg, "attention_dropout", 0.0) or 0.0) > 0.0:
        return "attention dropout"
    for block in dec.layers:
        attn = block.self_attn
        if not all(hasattr(attn, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj")) or hasattr(attn, "q_norm"):
            return f"attention module {type(attn).__name__} differs from Qwen2/Llama"
    return None


def run_layer(layer: Callable[[Any, torch.Tensor], torch.Tensor], block: Any, x: torch.Tensor, checkpoint: bool):
    """layer(block, x); with `checkpoint` (trainer.activation_checkpointing) and autograd on, its
    activations are recomputed in the backward instead of kept: only its input x stays."""
    if checkpoint and torch.is_grad_enabled():
        return torch.utils.checkpoint.checkpoint(layer, block, x, use_reentrant=False)
    return layer(block, x)


def prompt_shared_hidden(
    model: Any, batch: Mapping[str, Any], checkpoint: bool = False, compiled: bool = False
) -> torch.Tensor:
    lm = decoder_model(model)
    dec, cfg = lm.model, lm.config
    H, KV = cfg.num_attention_heads, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    dims = Dims(H, KV, D)
    project, finish = halves(compiled)
    prompts, plen, row, comp = batch["prompt_ids"], batch["prompt_len"], batch["row_prompt"], batch["completion_in"]
    (Q, Lp), (B, Tc) = prompts.shape, comp.shape
    Np, Nc = Q * Lp, B * Tc
    positions = torch.arange(Lp + Tc)
    cos, sin = dec.rotary_emb(dec.embed_tokens.weight[:1], positions[None])  # (1, Lp + Tc, D)
    cos, sin = cos[0], sin[0]
    pos_c = plen[row][:, None] + positions[:Tc]  # (B, Tc): completion token t sits at P_b + t
    # every packed token's rotation: prompt q at position t, completion token t of row b at P_b + t
    cos_n = torch.cat([cos[:Lp].repeat(Q, 1), cos[pos_c].reshape(Nc, D)])[:, None]  # (Np + Nc, 1, D)
    sin_n = torch.cat([sin[:Lp].repeat(Q, 1), sin[pos_c].reshape(Nc, D)])[:, None]
    # Completion queries see their prompt's real tokens and the completion causally: (B, 1, Tc, Lp + Tc).
    sees_prompt = (positions[:Lp][None, :] < plen[row][:, None])[:, None, :].expand(B, Tc, Lp)
    causal = torch.ones((Tc, Tc), dtype=torch.bool).tril()[None].expand(B, Tc, Tc)
    mask = torch.cat([sees_prompt, causal], dim=-1)[:, None]
    gqa = KV != H

    def layer(block: Any, x: torch.Tensor) -> torch.Tensor:
        q, k, v = project(block, x, cos_n, sin_n, dims)  # (N, H, D), (N, KV, D) x 2
        qp = q[:Np].view(Q, Lp, H, D).transpose(1, 2)  # (Q, H, Lp, D)
        kp = k[:Np].view(Q, Lp, KV, D).transpose(1, 2)
        vp = v[:Np].view(Q, Lp, KV, D).transpose(1, 2)
        ap = attention(qp, kp, vp, is_causal=True, enable_gqa=gqa)  # (Q, H, Lp, D)
        out = [ap.transpose(1, 2).reshape(Np, H * D)]
        if Tc:
            qc = q[Np:].view(B, Tc, H, D).transpose(1, 2)  # (B, H, Tc, D)
            kc = k[Np:].view(B, Tc, KV, D).transpose(1, 2)
            vc = v[Np:].view(B, Tc, KV, D).transpose(1, 2)
            keys, values = torch.cat([kp[row], kc], dim=2), torch.cat([vp[row], vc], dim=2)  # (B, KV, Lp + Tc, D)
            ac = attention(qc, keys, values, attn_mask=mask, enable_gqa=gqa)  # (B, H, Tc, D)
            out.append(ac.transpose(1, 2).reshape(Nc, H * D))
        return finish(block, x, torch.cat(out) if Tc else out[0])

    x = dec.embed_tokens(torch.cat([prompts.reshape(-1), comp.reshape(-1)]))  # (Np + Nc, hidden): one packed matrix
    for block in dec.layers:
        x = run_layer(layer, block, x, checkpoint)
    x = dec.norm(x)
    last = x[:Np].view(Q, Lp, -1)[torch.arange(Q), plen - 1]  # (Q, hidden): predicts completion token 0
    first = last[row][:, None]  # (B, 1, hidden)
    return torch.cat([first, x[Np:].view(B, Tc, -1)], dim=1) if Tc else first  # (B, T, hidden)
