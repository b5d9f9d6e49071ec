"""A model's shape from its config.json alone (no weights loaded): parameter counts and KV bytes.

`ModelShape.from_config(fields)` reads the fields every Llama-family config has (Qwen2/3,
Llama, Mistral and their MoE variants) and `ModelShape.from_folder(dir)` a model folder's
(orchestrator/fit.py takes the tiny model's from its transformers config). The counts are exact
for the architectures the built-in engine runs (tests compare them with the instantiated models):

- embeddings V x h, plus an untied lm_head V x h;
- per layer: q (h x H*D), k and v (h x KV*D each), o (H*D x h), their biases where the family
  has them (Qwen2: q, k, v), Qwen3's per-head q/k norms (2 D), two RMSNorms (2 h), and the MLP:
  dense 3 h I, or E experts of 3 h I_e plus the router (h x E) and, for Qwen2-MoE, a shared
  expert (3 h I_s) and its gate (h);
- a final RMSNorm (h).

`kv_bytes_per_token(dtype_bytes)` is what one cached token costs across the layers: keys and
values, KV heads x head dim each, in the cache's dtype.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

QKV_BIAS_TYPES = ("qwen2", "qwen2_moe")
QK_NORM_TYPES = ("qwen3", "qwen3_moe")
LORA_SHAPES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelShape:
    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    max_positions: int
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    dtype: str = "float32"
    """The dtype config.json records for the weights (vLLM's dtype 'auto' loads in it)."""

    @classmethod
    def from_config(cls, f: Mapping[str, Any]) -> ModelShape:
        text = f.get("text_config")
        if isinstance(text, Mapping):  # a multimodal wrapper: the language model's fields
            f = {**f, **text}
        heads = int(f["num_attention_heads"])
        hidden = int(f["hidden_size"])
        experts = int(f.get("num_experts") or f.get("num_local_experts") or 0)
        return cls(
            model_type=str(f.get("model_type", "")),
            hidden=hidden,
            layers=int(f["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(f.get("num_key_value_heads") or heads),
            head_dim=int(f.get("head_dim") or hidden // heads),
            intermediate=int(f.get("intermediate_size") or 0),
            vocab=int(f["vocab_size"]),
            tied=bool(f.get("tie_word_embeddings", False)),
            max_positions=int(f.get("max_position_embeddings") or 2048),
            experts=experts,
            experts_per_token=int(f.get("num_experts_per_tok") or 0) if experts else 0,
            expert_intermediate=int(f.get("moe_intermediate_size") or f.get("intermediate_size") or 0)
            if experts
            else 0,
            shared_intermediate=int(f.get("shared_expert_intermediate_size") or 0) if experts else 0,
            dtype=str(f.get("dtype") or f.get("torch_dtype") or "float32"),
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelShape:
        return cls.from_config(json.loads((Path(folder) / "config.json").read_text()))

    def _attention(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        n = h * q + 2 * h * kv + q * h
        if self.model_type in QKV_BIAS_TYPES:
            n += q + 2 * kv
        if self.model_type in QK_NORM_TYPES:
            n += 2 * self.head_dim
        return n

    def _mlp(self) -> int:
        h = self.hidden
        if not self.experts:
            return 3 * h * self.intermediate
        n = self.experts * 3 * h * self.expert_intermediate + h * self.experts
        if self.shared_intermediate:
            n += 3 * h * self.shared_intermediate + h
        return n

    @property
    def layer_params(self) -> int:
        return self._attention() + self._mlp() + 2 * self.hidden

    @property
    def params(self) -> int:
        embed = self.vocab * self.hidden
        return embed * (1 if self.tied else 2) + self.layers * self.layer_params + self.hidden

    def _lora_sizes(self, targets: tuple[str, ...]) -> list[tuple[int, int]]:
        """(in, out) of each dense linear module of one layer named in `targets`; fused MoE experts
        take no adapters."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        sizes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
        if not self.experts:
            sizes |= {"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
        return [size for name, size in sizes.items() if name in targets]

    def lora_params(self, rank: int, targets: tuple[str, ...]) -> int:
        """Adapter parameters of rank `rank` on the modules named in `targets` (A: r x in, B: out x r)."""
        return self.layers * sum(rank * (a + b) for a, b in self._lora_sizes(targets))

    def lora_base_params(self, targets: tuple[str, ...]) -> int:
        """Parameters of the weights LoRA targets: the base an engine keeps a copy of to merge into."""
        return self.layers * sum(a * b for a, b in self._lora_sizes(targets))

    def layer_activation_values(self) -> int:
        """float32 values one decoder layer keeps per token for the backward (an estimate): 6 x hidden
        + 2 x KV width + 4 x MLP width (two norms' inputs and outputs, q, the attention output, k, v;
        the MLP's gate, up, SiLU and product; routed MLPs at top-k experts' width)."""
        width = self.intermediate if not self.experts else self.expert_intermediate * max(1, self.experts_per_token)
        return 6 * self.hidden + 2 * self.kv_heads * self.head_dim + 4 * (width + self.shared_intermediate)

    def activation_bytes_per_token(self, checkpointing: bool = False) -> int:
        """Bytes the trainer's forward keeps per token for the backward: every layer's activations,
        or with activation checkpointing one hidden vector per layer (each layer's input) plus one
        layer's activations, recomputed in the backward."""
        if checkpointing:
            return (self.layers * self.hidden + self.layer_activation_values()) * 4
        return self.layers * self.layer_activation_values() * 4

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def kv_formula(self, dtype_bytes: int) -> str:
        heads = f"{self.kv_heads} KV heads x {self.head_dim} dims"
        return f"{self.layers} layers x 2 (K and V) x {heads} x {dtype_bytes} bytes"
