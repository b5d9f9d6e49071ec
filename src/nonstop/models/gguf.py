"""A GGUF file as a model folder: dequantized once, cached by the file's hash.

transformers reads GGUF files (with the `gguf` package, the `gguf` extra) and dequantizes their
weights to float32, but `save_pretrained` refuses a model it loaded that way, and every other part
of nonstop (the memory plan's shape, the engine and trainer actors, vLLM) reads a plain folder with
`config.json`. So a `.gguf` file is converted once: the config without its `quantization_config`,
a fresh model of the same class holding the dequantized state dict, the tokenizer (with its chat
template) and the generation config, all written with `save_pretrained` into
`CACHE/gguf-<sha256[:16]>/`, plus `nonstop_model.json` recording where it came from. The folder is
written under a temporary name and renamed, so a half-written conversion is never used.

The weights are the GGUF's dequantized values: a 4-bit file gives a model weaker than the
original checkpoint, never a different architecture.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from nonstop.errors import NonstopError

MARKER = "nonstop_model.json"
"""Written last into a converted folder: its presence means the conversion finished."""

DEFAULT_CACHE = ".nonstop_cache/models"
"""Where converted and fetched models live unless told otherwise (NONSTOP_MODEL_CACHE overrides it)."""


class ModelFetchError(NonstopError, RuntimeError):
    """A model cannot be fetched or converted: the message says what to do."""


def model_cache(cache_dir: str | Path | None = None) -> Path:
    """The model cache folder: `cache_dir`, else $NONSTOP_MODEL_CACHE, else .nonstop_cache/models."""
    return Path(cache_dir or os.environ.get("NONSTOP_MODEL_CACHE") or DEFAULT_CACHE).expanduser()


def sha256_of(path: Path, block: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def _require_gguf() -> None:
    try:  # optional: the gguf extra
        import gguf  # noqa: F401
    except ImportError as e:
        raise ModelFetchError(
            "reading a .gguf file needs the `gguf` package: pip install 'nonstop[gguf]' (or pip install gguf)"
        ) from e


def convert_gguf(gguf_path: Path, out_dir: Path, source: dict | None = None) -> Path:
    """Dequantize `gguf_path` into a model folder at `out_dir` (replaced atomically); returns it."""
    _require_gguf()
    # start-up: config/preflight.py and the command line import this module; transformers (and
    # torch, through nonstop.hf) only when a file is converted
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from nonstop.hf import quiet_transformers

    quiet_transformers()
    t0 = time.perf_counter()
    folder, name = str(gguf_path.parent), gguf_path.name
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the saved weights are plain float32: nothing is quantized any more
    config.dtype = "float32"
    plain = type(loaded)(config)
    plain.load_state_dict(loaded.state_dict())
    tmp = out_dir.with_name(out_dir.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    generation = loaded.generation_config
    if generation.eos_token_id is None and tokenizer.eos_token_id is not None:
        generation.eos_token_id = tokenizer.eos_token_id
    generation.save_pretrained(tmp)
    record = {
        "source": str(gguf_path.resolve()),
        "source_sha256": sha256_of(gguf_path),
        "dequantized_to": "float32",
        "params": sum(p.numel() for p in plain.parameters()),
        "architecture": type(plain).__name__,
        "convert_s": round(time.perf_counter() - t0, 1),
        **(source or {}),
    }
    (tmp / MARKER).write_text(json.dumps(record, indent=1) + "\n")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir


def is_gguf(path: str | Path) -> bool:
    return str(path).lower().endswith(".gguf")


def gguf_folder(path: str | Path, cache_dir: str | Path | None = None) -> tuple[Path, bool]:
    """The cached model folder of the GGUF file `path`, converting it the first time; (folder, made now)."""
    gguf_path = Path(path).expanduser()
    if not gguf_path.is_file():
        raise ModelFetchError(f"no such GGUF file: {path}")
    out = model_cache(cache_dir) / f"gguf-{sha256_of(gguf_path)[:16]}"
    if (out / MARKER).is_file():
        return out, False
    out.parent.mkdir(parents=True, exist_ok=True)
    return convert_gguf(gguf_path, out), True
