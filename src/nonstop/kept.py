"""What an engine keeps of each token beside the token, so the trainer can replay its distribution.

- `KeptIds` (Keep Sampling Mask): when top-k / top-p / min-p truncated the distribution, the ids
  kept at each completion position, each position stored as whichever is smaller of a sorted id
  array or a vocabulary bitmask; `Sample.sampling_mask` holds one.
- `Routes` (Keep Routing): the experts a mixture-of-experts router chose for every input token,
  one byte (or two) per expert id; `Sample.routes` holds one.
Both pickle as a few byte strings, since samples cross process boundaries (types.py). Nothing of
ours is imported here: types.py builds its `Sample` on these.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field


class KeptIds(Sequence[list[int]]):
    """Keep Sampling Mask in compact form: per completion position, the kept token ids stored as
    whichever is smaller of a sorted id array (2 bytes per id below 65,536 ids, else 4) or a
    bitmask over the vocabulary (vocab / 8 bytes), in one byte buffer with one offset per position.

    Reads like a list of sorted id lists (`len`, indexing, iteration) and pickles as a few byte
    strings, so top-k with a small k costs 2k bytes a token and a wide top-p set at most vocab/8."""

    __slots__ = ("vocab_size", "data", "offsets", "kinds")

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.data = bytearray()
        self.offsets = array("I", [0])
        self.kinds = bytearray()  # 0: id array, 1: bitmask

    @property
    def _code(self) -> str:
        return "H" if self.vocab_size <= 65536 else "I"

    def id_bytes(self, count: int) -> int:
        return count * (2 if self._code == "H" else 4)

    def bitmask_bytes(self) -> int:
        return (self.vocab_size + 7) // 8

    def append(self, kept: Sequence[int]) -> None:
        """Store a sorted list of kept ids (callers with a bitmask at hand use append_bitmask)."""
        self.data += array(self._code, kept).tobytes()
        self.offsets.append(len(self.data))
        self.kinds.append(0)

    def append_bitmask(self, bits: bytes) -> None:
        """Store a little-endian bitmask of vocab_size bits (bit i set: id i kept)."""
        self.data += bits
        self.offsets.append(len(self.data))
        self.kinds.append(1)

    def __len__(self) -> int:
        return len(self.kinds)

    def __getitem__(self, t):
        if isinstance(t, slice):
            return [self[i] for i in range(*t.indices(len(self)))]
        if t < 0:
            t += len(self)
        if not 0 <= t < len(self):
            raise IndexError(t)
        raw = self.data[self.offsets[t] : self.offsets[t + 1]]
        if self.kinds[t] == 0:
            return array(self._code, bytes(raw)).tolist()
        bits = format(int.from_bytes(raw, "little"), "b")[::-1]
        return [i for i, c in enumerate(bits) if c == "1"]

    def __iter__(self) -> Iterator[list[int]]:
        return (self[t] for t in range(len(self)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == [list(x) for x in other]

    def __repr__(self) -> str:
        return f"KeptIds({list(self)!r})"

    def __reduce__(self):
        return (_kept_ids, (self.vocab_size, bytes(self.data), self.offsets.tobytes(), bytes(self.kinds)))

    @property
    def nbytes(self) -> int:
        return len(self.data) + len(self.offsets) * self.offsets.itemsize + len(self.kinds)


def _kept_ids(vocab_size: int, data: bytes, offsets: bytes, kinds: bytes) -> KeptIds:
    k = KeptIds(vocab_size)
    k.data, k.kinds = bytearray(data), bytearray(kinds)
    k.offsets = array("I")
    k.offsets.frombytes(offsets)
    return k


@dataclass(slots=True)
class Routes:
    """Keep Routing: the top-k experts the engine's router chose, per MoE layer, for every token
    the engine fed as input: the prompt's P tokens (computed once per group at prefill, shared by
    the group's samples) and completion tokens 0..T-2 (the last sampled token is never an input).

    Stored row-major as (tokens, num_layers, top_k) unsigned integers, 1 byte each when there are
    at most 256 experts (2 bytes, little-endian, otherwise): `prompt` (P rows) and `completion`
    (T - 1 rows once the sample is finished). Expert order within a row is the router's (most
    probable first); only the set matters to the trainer."""

    num_layers: int
    top_k: int
    num_experts: int
    prompt: bytes = b""
    completion: bytearray = field(default_factory=bytearray)

    @property
    def itemsize(self) -> int:
        return 1 if self.num_experts <= 256 else 2

    @property
    def token_bytes(self) -> int:
        """Bytes per routed token: num_layers x top_k x itemsize."""
        return self.num_layers * self.top_k * self.itemsize

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt) // self.token_bytes

    @property
    def num_completion_tokens(self) -> int:
        return len(self.completion) // self.token_bytes

    @property
    def nbytes(self) -> int:
        return len(self.prompt) + len(self.completion)
