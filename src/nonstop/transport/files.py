"""Files transport: safetensors files plus an atomically replaced version marker.

For engines on hosts that share no process group, only a folder (a shared filesystem). The
trainer writes version v as `v{v}.safetensors` (the flat byte layout as one uint8 tensor, so
names, shapes and dtypes come from the handle's checked layout): temp file, fsync, rename.
Then it replaces `LATEST` (temp file, fsync, rename) with the version number. The marker is
the notification: an engine stats it before each forward pass (cheap), and when it changed,
reads the version, loads that file into a shadow buffer and copies it into its parameters.
Because the marker is renamed into place only after the weights file is complete, a
half-written update is never applied. The trainer keeps the newest `keep` versions.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nonstop.transport.base import TransportError, bind_flat, crc32, pack, views
from nonstop.types import TransportHandle

MARKER = "LATEST"


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    write(tmp)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


class FilesSink:
    def __init__(self, handle: TransportHandle) -> None:
        self.handle = handle
        self.dir = Path(handle.options["dir"])
        self.dir.mkdir(parents=True, exist_ok=True)
        # Versions left by an earlier run (or by the run before a resume) belong to another
        # timeline: an engine must never apply them, so the folder starts empty.
        for stale in [*self.dir.glob("v*.safetensors"), self.dir / MARKER]:
            stale.unlink(missing_ok=True)
        self.keep = int(handle.options.get("keep", 2))
        self.staging = torch.empty(handle.total_bytes, dtype=torch.uint8)
        self.staging_views = views(self.staging, handle.layout)
        self.written: list[int] = []

    def connect(self) -> None:
        """Nothing to rendezvous: engines watch the folder."""

    @torch.no_grad()
    def publish(self, model: torch.nn.Module, version: int) -> None:
        pack(model, self.staging_views)
        try:
            meta = {"version": str(version)}
            if self.handle.options.get("checksum"):
                meta["crc32"] = str(crc32(self.staging))
            _atomic_write(self.dir / f"v{version}.safetensors",
                          lambda tmp: save_file({"flat": self.staging}, str(tmp), metadata=meta))
            _atomic_write(self.dir / MARKER, lambda tmp: tmp.write_text(str(version)))
        except OSError as e:
            raise TransportError(f"writing version {version} to {self.dir} failed: {e}") from e
        self.written.append(version)
        for old in self.written[: -self.keep]:
            (self.dir / f"v{old}.safetensors").unlink(missing_ok=True)
        self.written = self.written[-self.keep:]

    def close(self) -> None:
        if self.handle.options.get("owned"):
            import shutil

            shutil.rmtree(self.dir, ignore_errors=True)


class FilesSource:
    def __init__(self, handle: TransportHandle, model: torch.nn.Module) -> None:
        self.handle = handle
        self.dir = Path(handle.options["dir"])
        self.flat = bind_flat(model, handle.layout, handle.total_bytes)
        self.applied = -1
        self._seen_stat: tuple[int, int] | None = None

    def maybe_update(self, model: torch.nn.Module) -> int | None:
        try:
            st = os.stat(self.dir / MARKER)
        except FileNotFoundError:
            return None
        key = (st.st_mtime_ns, st.st_ino)
        if key == self._seen_stat:
            return None
        self._seen_stat = key
        version = int((self.dir / MARKER).read_text().strip())
        if version <= self.applied:
            return None
        path = self.dir / f"v{version}.safetensors"
        try:
            with safe_open(str(path), framework="pt") as f:
                shadow, meta = f.get_tensor("flat"), f.metadata() or {}
        except FileNotFoundError:  # already replaced by a newer version: the next marker names it
            self._seen_stat = None
            return None
        except Exception as e:  # safetensors raises its own error types on a damaged file
            raise TransportError(f"{path}: unreadable weights file for version {version}: {e}") from e
        if "crc32" in meta and crc32(shadow) != int(meta["crc32"]):
            raise TransportError(f"{path}: version {version} failed its checksum; not applied")
        if shadow.numel() != self.flat.numel():
            raise TransportError(f"{path}: {shadow.numel()} bytes, expected {self.flat.numel()} from the trainer's layout")
        self.flat.copy_(shadow)
        self.applied = version
        return version

    def close(self) -> None:
        pass
