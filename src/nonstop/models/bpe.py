"""A byte-level BPE tokenizer trained here, on a task's own text, with the `tokenizers` library.

`train_bpe(texts, vocab_size)` learns merges with the same pipeline as Qwen2's tokenizer: NFC
normalisation, Qwen2's pre-tokenizer regex (single digits, letter runs with one leading
non-letter, punctuation runs) and the GPT-2 byte map. Ids 0-2 are <pad>, <bos>, <eos> (as in the
character tokenizer of models/tiny.py), then the 256 byte symbols, then one token per merge: every
byte string encodes, and a token spans as many characters as its merges joined. Training stops at
`vocab_size` or when no pair occurs `min_frequency` times, whichever comes first.

The result is a transformers `Qwen2Tokenizer` built from the learned vocab and merges, because
that is the class AutoTokenizer rebuilds for a folder holding a Qwen2 config.json: saved with
`save_pretrained` beside the model, it loads back through `AutoTokenizer.from_pretrained` and
encodes the same ids (tests/tasks/test_long_rollout.py checks it). Training is deterministic for a given
corpus and settings (the trainer breaks frequency ties by the pair's bytes).
"""

from __future__ import annotations

import json

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import Qwen2Tokenizer
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

SPECIAL = ("<pad>", "<bos>", "<eos>")


def _pipeline() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def train_bpe(texts: list[str], vocab_size: int = 512, min_frequency: int = 2) -> Qwen2Tokenizer:
    """A byte-level BPE learned on `texts`: specials, 256 bytes, then merges (see module docstring)."""
    tok = _pipeline()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    learned = json.loads(tok.model.__getstate__())  # the learned vocab and merges, as the BPE model serialises them
    vocab: dict[str, int] = learned["vocab"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in learned["merges"]]
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,  # type: ignore[arg-type]  # pairs, as tokenizers' BPE takes them (the hint says str)
        unk_token=SPECIAL[0],  # never used: every byte has a token
        pad_token=SPECIAL[0],
        bos_token=SPECIAL[1],
        eos_token=SPECIAL[2],
    )


def merged_tokens(tokenizer: Qwen2Tokenizer) -> list[str]:
    """The vocabulary entries that span more than one byte symbol (one per merge)."""
    return [t for t in tokenizer.get_vocab() if len(t) > 1 and t not in SPECIAL]
