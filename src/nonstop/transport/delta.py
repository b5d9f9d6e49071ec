"""Weights sent as deltas: only the elements whose bits changed since the version sent before.

At RL learning rates most weights, in the dtype they travel in (bfloat16 by default on a bf16
engine), keep their bits from one version to the next: an AdamW step moves a weight by about the
learning rate, far less than one bfloat16 step for most of them. `transport.delta` (files and
broadcast) then sends version v as a `Delta` against its base b, the version sent before it.

What is compared. The layout's flat bytes, padding included, as words of the layout's smallest
element size (2 bytes for a bfloat16 layout), by their bits: -0.0 and 0.0 differ, a NaN equals
itself. A receiver that holds b and applies the delta holds v's bytes exactly, so the CRC32 of
its buffer is the trainer's (`Delta.crc`, carried where `transport.checksum` is on and checked
before the version is applied).

Encoding (`Delta.pack`, one uint8 buffer, every part 8-byte aligned): a header of two int64 (k
changed words, f far gaps); the k gaps, one byte each: the distance from the previous changed
word (the first from position -1), 255 meaning "the next entry of `far`"; the f far gaps (int64);
the k new words. About (1 + word size) bytes per changed element: 3 for bfloat16, against 2 per
element for the full version. The trainer sends the full version instead wherever the delta is
not smaller (float32 weights change almost everywhere), at the first send and whenever a
receiver may lack the base (transport-specific: a rebuilt broadcast group, a files keyframe).

Engine side, `Chain` keeps the deltas received since the oldest version any of the end's buffers
holds, and `bring` moves a buffer forward along them, or starts it from a copy of a newer one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nonstop.transport.base import TransportError, crc32, views
from nonstop.types import TensorSpec, TransportHandle

ESCAPE = 255  # a gap byte that says "read the gap from `far`"
_HEADER = 16  # bytes: k and f as int64
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def word_dtype(layout: list[TensorSpec]) -> torch.dtype:
    """The integer type the flat bytes are compared as: the layout's smallest element size (every
    offset is 64-byte aligned, so every tensor is whole words of it)."""
    sizes = {getattr(torch, s.dtype).itemsize for s in layout} or {1}
    return _WORDS[min(sizes)]


def _pad8(n: int) -> int:
    return (n + 7) // 8 * 8


@dataclass
class Delta:
    """Version `version` as the words that differ from version `base`: their gaps, far gaps, new values."""

    version: int
    base: int
    gaps: torch.Tensor  # (k,) uint8
    far: torch.Tensor  # (f,) int64
    values: torch.Tensor  # (k,) the word dtype
    crc: int | None = None  # CRC32 of the whole flat at `version` (transport.checksum), else None

    @property
    def nbytes(self) -> int:
        """Size of `pack()`: what travels."""
        k, f = self.gaps.numel(), self.far.numel()
        return _HEADER + _pad8(k) + 8 * f + _pad8(k * self.values.element_size())

    @property
    def changed(self) -> int:
        return self.gaps.numel()

    def positions(self) -> torch.Tensor:
        """(k,) int64 word positions of the changed words, ascending."""
        steps = self.gaps.to(torch.int64)
        if self.far.numel():
            steps[self.gaps == ESCAPE] = self.far
        return steps.cumsum(0) - 1

    def apply(self, flat: torch.Tensor, word: torch.dtype) -> None:
        """Write the changed words into `flat` (uint8, the layout's bytes at `base`): it then holds `version`."""
        flat.view(word)[self.positions().to(flat.device)] = self.values.to(flat.device)

    def pack(self) -> torch.Tensor:
        """The delta as one uint8 buffer (header, gaps, far gaps, values; each part 8-byte aligned)."""
        k, f = self.gaps.numel(), self.far.numel()
        out = torch.zeros(self.nbytes, dtype=torch.uint8, device=self.values.device)
        out[:_HEADER].view(torch.int64).copy_(torch.tensor([k, f], dtype=torch.int64))
        at = _HEADER
        out[at : at + k] = self.gaps
        at += _pad8(k)
        out[at : at + 8 * f].view(torch.int64).copy_(self.far)
        at += 8 * f
        out[at : at + k * self.values.element_size()].view(self.values.dtype).copy_(self.values)
        return out

    @classmethod
    def unpack(cls, buf: torch.Tensor, version: int, base: int, word: torch.dtype, crc: int | None) -> Delta:
        """The delta `pack()` wrote into `buf` (views into it, not copies); a buffer whose header does not
        fit its size is an error naming the version."""
        if buf.numel() < _HEADER:
            raise TransportError(f"delta of version {version}: {buf.numel()} bytes, shorter than its header")
        k, f = (int(x) for x in buf[:_HEADER].view(torch.int64).tolist())
        size = word.itemsize
        expected = _HEADER + _pad8(k) + 8 * f + _pad8(k * size)
        if k < 0 or f < 0 or expected != buf.numel():
            raise TransportError(
                f"delta of version {version} against {base}: header says {k} words and {f} far gaps "
                f"({expected} bytes), the payload has {buf.numel()}"
            )
        at = _HEADER
        gaps = buf[at : at + k]
        at += _pad8(k)
        far = buf[at : at + 8 * f].view(torch.int64)
        at += 8 * f
        values = buf[at : at + k * size].view(word)
        return cls(version, base, gaps, far, values, crc)


def diff(old: torch.Tensor, new: torch.Tensor, word: torch.dtype, version: int, base: int) -> Delta:
    """The delta that turns `old` into `new` (uint8 flats of one layout), as words of `word`."""
    a, b = old.view(word), new.view(word)
    where = (a != b).nonzero().squeeze(1)  # (k,) ascending
    steps = torch.diff(where, prepend=where.new_tensor([-1]))
    far = steps[steps >= ESCAPE]
    return Delta(version, base, steps.clamp(max=ESCAPE).to(torch.uint8), far, b[where])


class DeltaEncoder:
    """Trainer side: the bytes of the version sent last, and the delta of the next version against them.

    Holds one copy of the flat layout in the wire dtype; after each send it is updated in place
    (only the changed words are written after a delta; a full send copies)."""

    def __init__(self, handle: TransportHandle) -> None:
        self.word = word_dtype(handle.layout)
        self.last: torch.Tensor | None = None
        self.version: int | None = None

    def encode(self, flat: torch.Tensor, version: int, crc: int | None, full: bool = False) -> Delta | None:
        """The delta of `flat` (version `version`) against the version sent last, or None where the full
        version must go instead: the first send, `full` asked (a receiver may lack the base), a version not
        newer than the last, or a delta not smaller than the full version. Either way `flat`'s bytes become
        the ones sent last."""
        last = self.last
        delta = None
        if not full and last is not None and self.version is not None and version > self.version:
            delta = diff(last, flat, self.word, version, self.version)
            delta.crc = crc
            if delta.nbytes >= flat.numel():
                delta = None
        if delta is not None and last is not None:
            last.view(self.word)[delta.positions()] = delta.values
        elif last is None:
            self.last = flat.clone()
        else:
            last.copy_(flat)
        self.version = version
        return delta

    def forget(self) -> None:
        """The next send goes in full (a receiver may not hold the last one)."""
        self.version = None


class Held:
    """An engine-side flat buffer of the layout, with its typed views and the version it holds (None: none yet)."""

    def __init__(self, handle: TransportHandle, device: torch.device, flat: torch.Tensor | None = None) -> None:
        self.flat = flat if flat is not None else torch.empty(handle.total_bytes, dtype=torch.uint8, device=device)
        self.views = views(self.flat, handle.layout)
        self.version: int | None = None


class Chain:
    """Engine side: the deltas received since the oldest version any buffer of this end holds, so that a
    buffer can be brought to the newest version by applying them, not by receiving it whole."""

    def __init__(self, handle: TransportHandle) -> None:
        self.word = word_dtype(handle.layout)
        self.links: dict[int, Delta] = {}  # by the version each leads to

    def add(self, delta: Delta) -> None:
        self.links[delta.version] = delta

    def path(self, have: int | None, want: int) -> list[Delta] | None:
        """The deltas that lead from version `have` to `want`, in order; None where there are none."""
        if have is None:
            return None
        out: list[Delta] = []
        at = want
        while at > have:
            link = self.links.get(at)
            if link is None:
                return None
            out.append(link)
            at = link.base
        return out[::-1] if at == have else None

    def bring(self, back: Held, want: int, others: Sequence[Held]) -> None:
        """Make `back` hold version `want`: along the chain from its own version, or from a copy of one of
        `others` (buffers only read meanwhile) that has a path; then check `want`'s CRC where it has one. A
        buffer that cannot be brought, or a mismatch, raises (the version is never applied)."""
        for source in [back, *others]:
            path = self.path(source.version, want)
            if path is None:
                continue
            if source is not back:
                back.flat.copy_(source.flat)
            back.version = None  # until complete: a failure below leaves it holding no known version
            for link in path:
                link.apply(back.flat, self.word)
            crc = path[-1].crc if path else None  # an empty path: a copy of a version checked when it came
            if crc is not None and crc32(back.flat) != crc:
                raise TransportError(f"version {want} rebuilt from deltas failed its checksum; not applied")
            back.version = want
            return
        bases = sorted({h.version for h in [back, *others] if h.version is not None})
        last = self.links.get(want)
        base = last.base if last is not None else None
        raise TransportError(
            f"delta of version {want} against version {base}: this engine holds only version(s) {bases} "
            "and no deltas that lead from them"
        )

    def prune(self, held: Sequence[Held]) -> None:
        """Forget the deltas no buffer needs: those up to the oldest version any of `held` holds."""
        versions = [h.version for h in held if h.version is not None]
        if versions:
            oldest = min(versions)
            for v in list(self.links):  # one snapshot: another thread may add a link meanwhile
                if v <= oldest:
                    self.links.pop(v, None)
