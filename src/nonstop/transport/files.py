"""Files transport: safetensors files plus an atomically replaced version marker.

For engines on hosts that share no process group, only a folder (a shared filesystem). The
trainer writes version v as `v{v}.safetensors` (the flat byte layout as one uint8 tensor, so
names, shapes and dtypes come from the handle's checked layout): temp file, fsync, rename.
Then it replaces `LATEST` (temp file, fsync, rename) with the version number. The marker is
the file notification: an engine stats it before each forward pass (cheap), and when it
changed, reads the version, loads that file into a new buffer and points its tensors at it
(no copy). With `notify="http"` the trainer also serves a long-poll notification (notify.py):
an engine thread waits on it, loads each announced version off the decode path, and
`maybe_update` only re-points the tensors; if the notification fails (recorded in
`notify_error`) or ends, the engine falls back to the marker, so weights keep arriving.
Because the marker is renamed into place only
after the weights file is complete, a half-written update is never applied. The trainer
keeps the newest `keep` versions.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nonstop.transport.base import FlatSender, TransportError, WeightTarget, crc32, in_layout_order, repoint, views
from nonstop.transport.notify import VersionServer, VersionWatcher
from nonstop.types import FilesOptions, TransportHandle

MARKER = "LATEST"


def _atomic_write(path: Path, write) -> None:
    """`write(tmp)`, then `tmp` renamed to `path`, with the mode a plain new file gets here (the
    LATEST marker's): safetensors writes through its own private temporary file (0600)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.touch()
    mode = tmp.stat().st_mode & 0o777
    write(tmp)
    tmp.chmod(mode)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


class FilesSink:
    def __init__(self, handle: TransportHandle, opts: FilesOptions) -> None:
        self.handle, self.opts = handle, opts
        self.dir = Path(opts.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        # Versions left by an earlier run (or by the run before a resume) belong to another
        # timeline: an engine must never apply them, so the folder starts empty.
        for stale in [*self.dir.glob("v*.safetensors"), self.dir / MARKER]:
            stale.unlink(missing_ok=True)
        self.keep = opts.keep
        self.sender = FlatSender(handle)
        self.written: list[int] = []
        self.server = VersionServer(*opts.notify_at) if opts.notify_at is not None else None

    def connect(self) -> None:
        """Nothing to rendezvous: engines watch the folder."""

    @torch.no_grad()
    def publish(self, model: torch.nn.Module, version: int) -> None:
        flat = self.sender.flat(model)
        try:
            meta = {"version": str(version)}
            if self.handle.checksum:
                meta["crc32"] = str(crc32(flat))
            _atomic_write(
                self.dir / f"v{version}.safetensors", lambda tmp: save_file({"flat": flat}, str(tmp), metadata=meta)
            )
            _atomic_write(self.dir / MARKER, lambda tmp: tmp.write_text(str(version)))
        except OSError as e:
            raise TransportError(f"writing version {version} to {self.dir} failed: {e}") from e
        if self.server is not None:
            self.server.publish(version)
        self.written.append(version)
        for old in self.written[: -self.keep]:
            (self.dir / f"v{old}.safetensors").unlink(missing_ok=True)
        self.written = self.written[-self.keep :]

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.opts.owned:
            import shutil

            shutil.rmtree(self.dir, ignore_errors=True)


class FilesSource:
    def __init__(self, handle: TransportHandle, opts: FilesOptions, target: WeightTarget) -> None:
        self.handle, self.target = handle, target
        self.dir = Path(opts.dir)
        self.tensors = in_layout_order(target.tensors(), handle.layout)
        self.applied = -1
        self._seen_stat: tuple[int, int] | None = None
        self.lock = threading.Lock()
        self.ready: tuple[int, torch.Tensor] | None = None  # loaded by the watcher, guarded by lock
        self.error: TransportError | None = None
        self.notify_error: str | None = None  # why the HTTP notification ended, if it failed
        self.closing = threading.Event()
        self.thread: threading.Thread | None = None
        if opts.notify_at is not None:
            self.watcher = VersionWatcher(*opts.notify_at, handle.timeout_s)
            self.thread = threading.Thread(target=self._watch_loop, name="weights-files-watch", daemon=True)
            self.thread.start()

    def _load(self, version: int) -> torch.Tensor | None:
        """The verified flat bytes of `version`, or None if a newer version already replaced it."""
        path = self.dir / f"v{version}.safetensors"
        try:
            # Made outside inference_mode: the engine's parameters will point into this buffer.
            with torch.inference_mode(False), safe_open(str(path), framework="pt") as f:
                flat, meta = f.get_tensor("flat"), f.metadata() or {}
        except FileNotFoundError:
            return None
        except Exception as e:  # safetensors raises its own error types on a damaged file
            raise TransportError(f"{path}: unreadable weights file for version {version}: {e}") from e
        if "crc32" in meta and crc32(flat) != int(meta["crc32"]):
            raise TransportError(f"{path}: version {version} failed its checksum; not applied")
        if flat.numel() != self.handle.total_bytes:
            raise TransportError(
                f"{path}: {flat.numel()} bytes, expected {self.handle.total_bytes} from the trainer's layout"
            )
        return flat

    def _watch_loop(self) -> None:
        seen = 0
        while not self.closing.is_set():
            try:
                version = self.watcher.wait_newer(seen)
            except TransportError as e:  # the trainer is gone or unreachable: fall back to the marker
                self.notify_error = str(e)
                return
            if version is None:  # the trainer closed: nothing more will come
                return
            try:
                flat = self._load(version) if version > seen else None
            except TransportError as e:  # a damaged file: raised from maybe_update, never applied
                self.error = e
                return
            if flat is not None:
                with self.lock:
                    self.ready = (version, flat)
                seen = version

    def _apply(self, version: int, flat: torch.Tensor) -> int:
        repoint(self.tensors, views(flat, self.handle.layout))
        self.target.applied()
        self.applied = version
        return version

    def maybe_update(self, model: torch.nn.Module) -> int | None:
        if self.thread is not None:
            if self.error is not None:
                raise self.error
            with self.lock:
                ready, self.ready = self.ready, None
            if ready is not None and ready[0] > self.applied:
                return self._apply(*ready)
            if self.thread.is_alive():
                return None
            # The notification ended (trainer closed, or lost: see notify_error); the marker,
            # the source of truth, still names the newest complete version.
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
        flat = self._load(version)
        if flat is None:  # already replaced by a newer version: the next marker names it
            self._seen_stat = None
            return None
        return self._apply(version, flat)

    def close(self) -> None:
        self.closing.set()  # the watcher's request in flight ends with the trainer's close or its slice
