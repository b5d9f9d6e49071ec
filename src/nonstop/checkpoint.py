"""Checkpoints: atomic, verified, the last K kept.

A checkpoint is a folder `checkpoints/step_NNNNNNNN/` holding

    model/          the trainer's weights (save_pretrained, safetensors) and the tokenizer
    trainer.pt      optimizer state, RNG states, policy_version, skip counters
    state.json      the orchestrator: step, data cursor (stream state), prompt ledger, counters
    manifest.json   size and CRC32 of every other file, written last

Every model folder the trainer saves (a checkpoint's `model/`, a run's `final/`) also holds
`nonstop_version.json`, the policy_version of its weights, so whatever serves them (`nonstop
serve`) tags their tokens with it; `saved_policy_version(folder)` reads it back.

Every file of a checkpoint and of a saved model folder has one mode, the one a plain write gives
(`share_mode`). It is written into a temporary sibling folder, every file and the folder are fsynced, and only
then is the folder renamed into place (and the parent fsynced), so a crash at any point leaves
either the complete checkpoint or no checkpoint, never half of one. On load the manifest is
checked; a checkpoint that fails (missing file, wrong size or CRC, no manifest) is reported
and the previous one is used.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path

from nonstop.errors import NonstopError

_PREFIX = "step_"
_MANIFEST = "manifest.json"
VERSION_FILE = "nonstop_version.json"
"""Beside the weights of every model folder the trainer saves: {"policy_version": N}."""


class CheckpointError(NonstopError, RuntimeError):
    """No usable checkpoint: the message lists each candidate and why it was refused."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int

    @property
    def model_dir(self) -> Path:
        return self.path / "model"

    @property
    def state(self) -> dict:
        return json.loads((self.path / "state.json").read_text())


def _crc_file(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != _MANIFEST)


def share_mode(files: list[Path], like: Path) -> None:
    """Give `files` the mode of `like`, a file written plainly (open(), the umask's mode).
    safetensors writes through a private temporary file (0600) and renames it, which left
    model.safetensors unreadable to the group while its neighbours were 0644."""
    mode = like.stat().st_mode & 0o777
    for p in files:
        if p.stat().st_mode & 0o777 != mode:
            p.chmod(mode)


def staging_dir(root: Path, step: int) -> Path:
    """An empty temporary folder for step `step`'s files; `commit` publishes it."""
    tmp = root / f".{_PREFIX}{step:08d}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)  # left by a crash during an earlier attempt; never a valid checkpoint
    tmp.mkdir(parents=True)
    return tmp


def commit(root: Path, tmp: Path, step: int, state: dict, keep: int) -> Checkpoint:
    """Write state.json and the manifest into `tmp`, make everything durable, rename into place."""
    (tmp / "state.json").write_text(json.dumps(state))
    share_mode(_files(tmp), tmp / "state.json")
    manifest = {str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "crc32": _crc_file(p)} for p in _files(tmp)}
    (tmp / _MANIFEST).write_text(json.dumps({"step": step, "files": manifest}, indent=1))
    for p in [*_files(tmp), tmp / _MANIFEST]:
        _fsync(p)
    for d in sorted({p.parent for p in _files(tmp)}, key=lambda d: len(d.parts), reverse=True):
        _fsync(d)
    final = root / f"{_PREFIX}{step:08d}"
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync(root)
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old.path, ignore_errors=True)
    return Checkpoint(final, step)


def list_checkpoints(root: Path) -> list[Checkpoint]:
    """Committed checkpoints, oldest first (temporary folders are never listed)."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith(_PREFIX) and p.name[len(_PREFIX) :].isdigit():
            found.append(Checkpoint(p, int(p.name[len(_PREFIX) :])))
    return sorted(found, key=lambda c: c.step)


def verify(ckpt: Checkpoint) -> str | None:
    """None when the checkpoint is intact, else what is wrong with it."""
    try:
        manifest = json.loads((ckpt.path / _MANIFEST).read_text())
    except FileNotFoundError:
        return "no manifest.json (incomplete)"
    except json.JSONDecodeError as e:
        return f"manifest.json is not valid JSON ({e.msg})"
    for rel, want in manifest["files"].items():
        p = ckpt.path / rel
        if not p.is_file():
            return f"{rel} is missing"
        if p.stat().st_size != want["bytes"]:
            return f"{rel} has {p.stat().st_size} bytes, the manifest says {want['bytes']}"
        if _crc_file(p) != want["crc32"]:
            return f"{rel} fails its CRC32 check"
    return None


def latest_valid(root: Path, report=print) -> Checkpoint:
    """The newest intact checkpoint; each refused one is reported (with why) through `report`."""
    refused = []
    for ckpt in reversed(list_checkpoints(root)):
        problem = verify(ckpt)
        if problem is None:
            return ckpt
        refused.append(f"{ckpt.path.name}: {problem}")
        report(f"checkpoint {ckpt.path} is corrupted ({problem}); trying the previous one")
    detail = "; ".join(refused) if refused else "none written yet"
    raise CheckpointError(f"no usable checkpoint under {root} ({detail})")


def write_policy_version(model_dir: Path, policy_version: int) -> None:
    """Also gives the folder's files the version file's mode (`share_mode`): a run's final/ as well."""
    (model_dir / VERSION_FILE).write_text(json.dumps({"policy_version": policy_version}) + "\n")
    share_mode([p for p in model_dir.iterdir() if p.is_file()], model_dir / VERSION_FILE)


def saved_policy_version(model_dir: str | Path) -> int:
    """The policy_version of the weights in `model_dir`, as the trainer recorded it beside them; for a
    checkpoint's model/ written before that record existed, its state.json's; else 0 (a base model,
    or weights from elsewhere). CheckpointError when the record is there but unreadable."""
    folder = Path(model_dir)
    candidates = [folder / VERSION_FILE]
    if folder.name == "model" and folder.parent.name.startswith(_PREFIX):
        candidates.append(folder.parent / "state.json")
    for path in candidates:
        if not path.is_file():
            continue
        try:
            version = json.loads(path.read_text())["policy_version"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{path}: no readable policy_version ({type(e).__name__}: {e})") from None
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise CheckpointError(f"{path}: policy_version {version!r} is not a non-negative integer")
        return version
    return 0
