"""Checks that run before a run folder is written or an actor spawned, so a mistake costs a
second and one line, not a traceback from inside an actor after its start-up.

`resolve_model_path(path)` turns `model.path` into a local folder holding a model and its
tokenizer, or raises ConfigError naming `model.path` and the fix:
- a local folder must hold config.json and a tokenizer file (what `save_pretrained` writes);
- a `.gguf` file is dequantized once into a cached model folder (models/gguf.py, keyed by the
  file's sha256) and that folder is used; the first use in a process prints which, and whether it
  was converted now or found in the cache;
- a path that does not exist and does not look like a hub id ('owner/name') is a missing folder;
- a hub id is looked up in the local Hugging Face cache first; with HF_HUB_OFFLINE=1 (or
  TRANSFORMERS_OFFLINE=1) that is the only place looked; otherwise the hub must answer (the
  repository's metadata) within `hub_timeout_s`, and then its files are fetched for as long as
  that takes, both in a daemon thread, so no retry loop or silent proxy can hold the command
  (`nonstop train` and `nonstop serve` alike) and Ctrl-C always stops it.
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

from nonstop.config import ConfigError
from nonstop.models.gguf import ModelFetchError, gguf_folder

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
MODEL_FILES = ["config.json", "generation_config.json", "*.safetensors", "*.json", "*.model", "merges.txt"]


def offline() -> bool:
    return any(
        os.environ.get(k, "").strip().lower() in ("1", "true", "yes", "on")
        for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def check_folder(folder: Path, field: str = "model.path") -> Path:
    if not (folder / "config.json").is_file() and (folder / "model" / "config.json").is_file():
        raise ConfigError(f"{field}: {folder} is a checkpoint folder; its weights are in {folder / 'model'}")
    if not (folder / "config.json").is_file():
        held = sorted(p.name for p in folder.iterdir())[:8] if folder.is_dir() else []
        raise ConfigError(
            f"{field}: {folder} holds no config.json ({'files: ' + ', '.join(held) if held else 'empty'}); "
            "expected a folder written by save_pretrained (model and tokenizer)"
        )
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise ConfigError(
            f"{field}: {folder} holds no tokenizer ({' or '.join(TOKENIZER_FILES)}); save the "
            "tokenizer into the model folder (tokenizer.save_pretrained(folder))"
        )
    return folder


def _download(repo: str, local_only: bool) -> str:
    # start-up: the hub's client only when a hub id is looked up (the command line imports this module)
    from huggingface_hub import snapshot_download

    return snapshot_download(repo, allow_patterns=MODEL_FILES, local_files_only=local_only)


ANNOUNCED: set[str] = set()
"""GGUF files whose folder this process has already named (the start-up line is printed once)."""


def gguf_model_folder(path: str, field: str) -> Path:
    try:
        folder, made = gguf_folder(path)
    except ModelFetchError as e:
        raise ConfigError(f"{field}: {e}") from None
    if path not in ANNOUNCED:
        ANNOUNCED.add(path)
        how = "dequantized now" if made else "dequantized earlier, cached"
        print(f"{field}: {path} is a GGUF file; using its float32 model folder {folder} ({how})", flush=True)
    return check_folder(folder, field)


def resolve_model_path(path: str, hub_timeout_s: float = 15.0, field: str = "model.path") -> Path:
    """A local folder with the model and tokenizer `path` names (see the module docstring)."""
    local = Path(path).expanduser()
    if local.is_file() and local.suffix.lower() == ".gguf":
        return gguf_model_folder(path, field)
    if local.exists():
        if not local.is_dir():
            raise ConfigError(f"{field}: {path} is a file; expected a model folder written by save_pretrained")
        return check_folder(local, field)
    if not HUB_ID.match(path):
        raise ConfigError(f"{field}: no such folder: {path}")
    try:
        return check_folder(Path(_download(path, local_only=True)), field)
    except ConfigError:
        raise
    except Exception:  # not in the cache
        pass
    if offline():
        raise ConfigError(
            f"{field}: {path!r} is not a local folder and not in the Hugging Face cache, and offline "
            "mode is on (HF_HUB_OFFLINE): download it first or give a local folder"
        )
    # start-up: as in _download; and here, not in the thread: `hub_timeout_s` bounds the hub's
    # silence, not a slow import
    from huggingface_hub import HfApi

    result: dict[str, object] = {}
    answered = threading.Event()

    def fetch() -> None:
        try:
            HfApi().model_info(path, timeout=hub_timeout_s)  # the hub answers: the download may take its time
            answered.set()
            result["path"] = _download(path, local_only=False)
        except Exception as e:  # reported below, in the caller's thread
            result["error"] = e
        answered.set()

    worker = threading.Thread(target=fetch, name="nonstop-hub-fetch", daemon=True)
    worker.start()
    if answered.wait(hub_timeout_s):
        worker.join()  # Ctrl-C interrupts the wait, and the daemon thread does not hold the exit
    if "path" in result:
        return check_folder(Path(str(result["path"])), field)
    why = (
        f"{type(result['error']).__name__}: {str(result['error']).splitlines()[0][:200]}"
        if "error" in result
        else f"no answer within {hub_timeout_s:g} s"
    )
    raise ConfigError(
        f"{field}: {path!r} is not a local folder and could not be fetched from the Hugging Face hub "
        f"({why}); check the name and the network, or download it and give the folder "
        "(set HF_HUB_OFFLINE=1 to use the local cache only)"
    )
