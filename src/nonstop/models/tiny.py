"""Tiny models and character tokenizers made on the fly (no downloads).

`make_char_tokenizer()` builds a 128-entry character-level tokenizer: ids 0-2 are <pad>, <bos>,
<eos>; then the 95 printable ASCII characters (space is id 97), newline (98) and tab (99); the
rest are reserved tokens, so model vocab and tokenizer vocab always agree. Other characters are
dropped. It is a byte-level BPE without merges in the class transformers' AutoTokenizer picks for
a Qwen2 model folder (`Qwen2Tokenizer`), so it encodes the same in memory and after
`save_pretrained` + `AutoTokenizer.from_pretrained` from a folder that also holds the model's
config.json: a generic tokenizer there is rebuilt as a Qwen2Tokenizer, which lost spaces.
`make_tiny_model()` builds a Qwen2-architecture causal LM from a transformers config, or with
`tiny.moe` a Qwen3-MoE (routed experts) or Qwen2-MoE (routed experts plus a gated shared
expert) of the same shape. `save_tiny(dir)` writes both with
`save_pretrained`, so the single loading path, `AutoModelForCausalLM.from_pretrained(path)` and
`AutoTokenizer.from_pretrained(path)`, serves the tiny model and users' real models alike.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen2Tokenizer,
    Qwen3MoeConfig,
)

from nonstop.config import TinyModelConfig

VOCAB_SIZE = 128
PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"


def _byte_level(c: str) -> str:
    """The character byte-level BPE writes for an ASCII character (GPT-2's byte map): printable
    non-space ASCII stands for itself, bytes 0-32 are shifted to U+0100-U+0120 (space is 'Ġ')."""
    return c if 33 <= ord(c) <= 126 else chr(256 + ord(c))


def make_char_tokenizer() -> Qwen2Tokenizer:
    chars = [c for c in string.printable if c.isprintable()] + ["\n", "\t"]  # 95 printable ASCII, space included
    vocab = {PAD: 0, BOS: 1, EOS: 2}
    for c in chars:
        vocab[_byte_level(c)] = len(vocab)
    while len(vocab) < VOCAB_SIZE:
        vocab[f"<reserved_{len(vocab)}>"] = len(vocab)
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        unk_token=PAD,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        extra_special_tokens=[t for t in vocab if t.startswith("<reserved_")],
    )


def tiny_config(cfg: TinyModelConfig) -> PretrainedConfig:
    """The transformers config of the tiny model `cfg` describes."""
    common: dict[str, Any] = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    moe = cfg.moe
    if moe is None:
        return Qwen2Config(**common)
    experts: dict[str, Any] = dict(
        num_experts=moe.num_experts,
        num_experts_per_tok=moe.experts_per_token,
        moe_intermediate_size=moe.expert_intermediate_size,
        norm_topk_prob=moe.norm_topk_prob,
    )
    if moe.kind == "qwen2_moe":
        return Qwen2MoeConfig(**common, **experts, shared_expert_intermediate_size=moe.shared_expert_intermediate_size)
    return Qwen3MoeConfig(**common, **experts)  # head_dim: hidden_size // num_heads


def make_tiny_model(cfg: TinyModelConfig, seed: int = 0) -> PreTrainedModel:
    config = tiny_config(cfg)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def save_tiny(path: str | Path, cfg: TinyModelConfig, seed: int = 0) -> Path:
    """Write a freshly initialised tiny model and its tokenizer to `path`; return the path."""
    path = Path(path)
    make_tiny_model(cfg, seed).save_pretrained(path)
    make_char_tokenizer().save_pretrained(path)
    return path


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
