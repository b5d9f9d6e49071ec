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

Deltas (`transport.delta`, delta.py). The trainer writes every version after the first as
`v{v}.delta.safetensors` (the packed delta against the version before, its base in the metadata,
with the version's CRC32 and the payload's where checksums are on), and the full `v{v}.safetensors`
at the first version, every `full_every` versions and wherever a delta is not smaller. An engine
reaches the marker's version by reading deltas back from it to a version one of its buffers holds
(its live one, or its spare), and otherwise from the newest full file on that path; it brings a
spare buffer forward (`Chain`), checks the version's CRC, and points its tensors at it. `keep` then
counts full files, and every delta after the oldest kept one stays.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nonstop.transport.base import FlatSender, TransportError, WeightTarget, crc32, in_layout_order, repoint
from nonstop.transport.delta import Chain, Delta, DeltaEncoder, Held
from nonstop.transport.notify import VersionServer, VersionWatcher
from nonstop.types import FilesOptions, TransportHandle

MARKER = "LATEST"


def full_name(version: int) -> str:
    return f"v{version}.safetensors"


def delta_name(version: int) -> str:
    return f"v{version}.delta.safetensors"


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


class FilesPublisher:
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
        self.written: list[int] = []  # versions with a full file, oldest first
        self.deltas: list[int] = []  # versions with a delta file, oldest first
        self.encoder = DeltaEncoder(handle) if opts.delta else None
        self.sent_bytes = 0  # what the last publish wrote (a delta, a full file, or both)
        self.server = VersionServer(*opts.notify_at) if opts.notify_at is not None else None

    def connect(self) -> None:
        """Nothing to rendezvous: engines watch the folder."""

    @torch.no_grad()
    def publish(self, model: torch.nn.Module, version: int) -> None:
        flat = self.sender.flat(model)
        crc = crc32(flat) if self.handle.checksum else None
        delta = self.encoder.encode(flat, version, crc) if self.encoder is not None else None
        full = delta is None or not self.written or version - self.written[-1] >= self.opts.full_every
        meta = {"version": str(version)} | ({"crc32": str(crc)} if crc is not None else {})
        self.sent_bytes = 0
        try:
            if delta is not None:
                self._write(delta_name(version), delta.pack(), meta | {"base": str(delta.base)})
            if full:
                self._write(full_name(version), flat, meta)
            _atomic_write(self.dir / MARKER, lambda tmp: tmp.write_text(str(version)))
        except OSError as e:
            raise TransportError(f"writing version {version} to {self.dir} failed: {e}") from e
        if self.server is not None:
            self.server.publish(version)
        if delta is not None:
            self.deltas.append(version)
        if full:
            self.written.append(version)
        for old in self.written[: -self.keep]:
            (self.dir / full_name(old)).unlink(missing_ok=True)
        self.written = self.written[-self.keep :]
        for old in [v for v in self.deltas if v <= self.written[0]]:  # no engine needs these any more
            (self.dir / delta_name(old)).unlink(missing_ok=True)
        self.deltas = [v for v in self.deltas if v > self.written[0]]

    def _write(self, name: str, data: torch.Tensor, meta: dict[str, str]) -> None:
        """One safetensors file of `data` (uint8) as `name`, atomically; a delta's payload CRC in its metadata."""
        if self.handle.checksum and name != full_name(int(meta["version"])):
            meta = meta | {"payload_crc32": str(crc32(data))}
        _atomic_write(self.dir / name, lambda tmp: save_file({"flat": data}, str(tmp), metadata=meta))
        self.sent_bytes += data.numel()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.opts.owned:
            shutil.rmtree(self.dir, ignore_errors=True)


class FilesReceiver:
    def __init__(self, handle: TransportHandle, opts: FilesOptions, target: WeightTarget) -> None:
        self.handle, self.target = handle, target
        self.dir = Path(opts.dir)
        self.tensors = in_layout_order(target.tensors(), handle.layout)
        self.applied = -1
        self._seen_stat: tuple[int, int] | None = None
        self.lock = threading.Lock()
        self.ready: Held | None = None  # loaded by the watcher, guarded by lock
        self.live: Held | None = None  # the buffer the engine's tensors point at
        self.spare: Held | None = None  # with deltas: the buffer the next version is brought into
        self.chain = Chain(handle) if opts.delta else None
        self.error: TransportError | None = None
        self.notify_error: str | None = None  # why the HTTP notification ended, if it failed
        self.closing = threading.Event()
        self.thread: threading.Thread | None = None
        if opts.notify_at is not None:
            self.watcher = VersionWatcher(*opts.notify_at, handle.timeout_s)
            self.thread = threading.Thread(target=self._watch_loop, name="weights-files-watch", daemon=True)
            self.thread.start()

    def _read(self, name: str, version: int) -> tuple[torch.Tensor, dict[str, str]] | None:
        """The bytes and metadata of one file, or None if a newer version already replaced it."""
        path = self.dir / name
        try:
            # Made outside inference_mode: the engine's parameters will point into this buffer.
            with torch.inference_mode(False), safe_open(str(path), framework="pt") as f:
                return f.get_tensor("flat"), f.metadata() or {}
        except FileNotFoundError:
            return None
        except Exception as e:  # safetensors raises its own error types on a damaged file
            raise TransportError(f"{path}: unreadable weights file for version {version}: {e}") from e

    def _load(self, version: int) -> Held | None:
        """The verified full version `version`, or None if it has no full file (any more)."""
        read = self._read(full_name(version), version)
        if read is None:
            return None
        flat, meta = read
        path = self.dir / full_name(version)
        if "crc32" in meta and crc32(flat) != int(meta["crc32"]):
            raise TransportError(f"{path}: version {version} failed its checksum; not applied")
        if flat.numel() != self.handle.total_bytes:
            raise TransportError(
                f"{path}: {flat.numel()} bytes, expected {self.handle.total_bytes} from the trainer's layout"
            )
        held = Held(self.handle, flat.device, flat)
        held.version = version
        return held

    def _read_delta(self, version: int) -> Delta | None:
        """The verified delta that leads to `version`, or None if there is none (any more)."""
        assert self.chain is not None
        read = self._read(delta_name(version), version)
        if read is None:
            return None
        payload, meta = read
        if "payload_crc32" in meta and crc32(payload) != int(meta["payload_crc32"]):
            raise TransportError(f"{self.dir / delta_name(version)}: delta failed its checksum; not applied")
        base = int(meta["base"])
        if base >= version:
            raise TransportError(f"{self.dir / delta_name(version)}: base {base} is not older than the version")
        crc = int(meta["crc32"]) if "crc32" in meta else None
        return Delta.unpack(payload, version, base, self.chain.word, crc)

    def _fetch(self, version: int) -> Held | None:
        """A buffer holding `version`, or None if its files were replaced by newer ones meanwhile. Without
        deltas, its full file. With them: the deltas back from `version` to the newest version this end
        holds, applied to the spare buffer; else the newest full file at or below `version` and the deltas
        after it (an engine that starts, or fell behind the files kept)."""
        if self.chain is None:
            return self._load(version)
        with self.lock:
            held = [h for h in (self.spare, self.live, self.ready) if h is not None]
        newest = max((h.version for h in held if h.version is not None), default=None)
        if newest is not None and self._walk(version, newest):
            back = self.spare or Held(self.handle, torch.device("cpu"))
            self.chain.bring(back, version, [h for h in held if h is not back])
            return back
        fulls = sorted((v for v in self._full_versions() if v <= version), reverse=True)
        for f in fulls:
            if self._walk(version, f):
                start = self._load(f)
                if start is not None:
                    self.chain.bring(start, version, [])
                    return start
        return None

    def _walk(self, version: int, to: int) -> bool:
        """Whether the deltas from `to` up to `version` are all there (read into the chain as found)."""
        assert self.chain is not None
        at = version
        while at > to:
            delta = self.chain.links.get(at) or self._read_delta(at)
            if delta is None:
                return False
            self.chain.add(delta)
            at = delta.base
        return at == to

    def _full_versions(self) -> list[int]:
        names = (p.name for p in self.dir.glob("v*.safetensors"))
        return [int(n[1:].split(".")[0]) for n in names if n.count(".") == 1]

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
                held = self._fetch(version) if version > seen else None
            except TransportError as e:  # a damaged file: raised from maybe_update, never applied
                self.error = e
                return
            if held is not None:
                with self.lock:
                    if held is self.spare:
                        self.spare = None
                    if self.ready is not None and self.chain is not None:  # superseded before it was applied
                        self.spare = self.ready
                    self.ready = held
                seen = version

    def _apply(self, held: Held) -> int:
        assert held.version is not None
        with self.lock:
            repoint(self.tensors, held.views)
            if held is self.spare:
                self.spare = None
            if self.chain is not None:
                self.spare = self.spare or self.live  # the buffer the tensors left is the next one brought forward
                self.chain.prune([h for h in (held, self.spare, self.ready) if h is not None])
            self.live = held
        self.target.applied()
        self.applied = held.version
        return held.version

    def maybe_update(self, model: torch.nn.Module) -> int | None:
        if self.thread is not None:
            if self.error is not None:
                raise self.error
            with self.lock:
                ready, self.ready = self.ready, None
            if ready is not None and ready.version is not None and ready.version > self.applied:
                return self._apply(ready)
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
        held = self._fetch(version)
        if held is None:  # already replaced by a newer version: the next marker names it
            self._seen_stat = None
            return None
        return self._apply(held)

    def close(self) -> None:
        self.closing.set()  # the watcher's request in flight ends with the trainer's close or its slice
