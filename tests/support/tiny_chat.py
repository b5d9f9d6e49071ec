"""A tiny random Llama with a real chat tokenizer (SmolLM2's), saved on the fly.

Chat rows go through the tokenizer's chat template (tasks/chat.py), which the char tokenizer of
the built-in tiny model does not have. This model has SmolLM2-135M-Instruct's tokenizer and
template (49,152 ids) and a 1-layer body of width 32: about 1.6 M parameters, nearly all in the
tied embedding, so TRL and nonstop both run a few steps of it in seconds on a CPU."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig


def save_tiny_chat(path: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Write the model and `tokenizer_dir`'s tokenizer (with its chat template) to `path`."""
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
    )
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tok.save_pretrained(path)
    return path
