"""The prefix cache: the KV of prompt prefixes kept across groups, so a prompt prefills only its new tail.

Chat prompts share their system prompt and the template's head; a GRPO run sees the same prompt
again at every epoch. The cache keeps the keys and values of such prefixes in blocks of BLOCK
tokens, in a trie keyed by each block's token ids (a block's KV depends on every token before it,
so a block is only ever reached through the blocks it follows), and the scheduler
(engine/scheduler.py) uses it around every prefill:

- `match(prompt)`: the cached blocks of the prompt's longest cached prefix, at most all but its
  last token (the last token's logits are what the pass computes, so at least one token runs);
- `load(blocks, slot)` copies them into the slot of the prompt's first sequence, which then
  prefills from there (`Runner.prefill`/`mixed` with a start);
- `reuse(prompt, slot, earlier, shares)` does both for an admitted prompt, or, when a prompt
  admitted earlier in the same pass begins with more of its whole blocks, has the pass copy
  those from that prompt's slot as it computes them (`shares`);
- `store(prompt, slot)` adds the prompt's whole blocks that are not cached yet, from the slot
  its pass just filled;
- the cache holds at most `budget_tokens` tokens (one preallocated pool of keys and values);
  a full pool gives up its least recently used leaf blocks first, never a block of the prompt
  being stored;
- `clear()` empties it: the scheduler clears it whenever new weights go live, since cached KV
  is the old weights' and a prompt admitted after the swap must see only the new ones.

Invariant of the recency order (`_lru`): a block always comes before its parent, since a block
is touched after its descendants on the path being used; so its front is a leaf.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from nonstop.engine.runner import lazy_zeros

BLOCK = 16
"""Tokens per cached block: a prompt reuses whole blocks only, so up to BLOCK - 1 tokens of a shared
prefix are recomputed, and a prompt under BLOCK + 1 tokens never touches the cache."""


class _Block:
    __slots__ = ("key", "parent", "children", "index")

    def __init__(self, key: tuple[int, ...], parent: _Block | None, index: int) -> None:
        self.key, self.parent, self.index = key, parent, index
        self.children: dict[tuple[int, ...], _Block] = {}


class PrefixCache:
    def __init__(self, cache: torch.Tensor, budget_tokens: int) -> None:
        """`cache`: the runner's (2 x layers, slots, kv heads, positions, head dim) KV cache."""
        layers2, _, kv_heads, _, head_dim = cache.shape
        self.cache = cache
        self.capacity = budget_tokens // BLOCK
        # block b holds positions b * BLOCK .. (b + 1) * BLOCK of the pool's position axis, so loading
        # or storing any set of blocks is one indexed copy per direction
        self.pool = lazy_zeros((layers2, kv_heads, self.capacity * BLOCK, head_dim), cache.dtype, cache.device)
        self.root = _Block((), None, -1)
        self._lru: OrderedDict[_Block, None] = OrderedDict()
        self._free = list(range(self.capacity - 1, -1, -1))
        self.evictions = 0

    @property
    def cached_tokens(self) -> int:
        return len(self._lru) * BLOCK

    def match(self, prompt: list[int]) -> list[_Block]:
        """The cached blocks of `prompt`'s longest cached prefix of whole blocks, leaving its last token out."""
        path: list[_Block] = []
        children = self.root.children
        for b in range((len(prompt) - 1) // BLOCK):
            node = children.get(tuple(prompt[b * BLOCK : (b + 1) * BLOCK]))
            if node is None:
                break
            path.append(node)
            children = node.children
        return path

    def reuse(
        self, prompt: list[int], slot: int, earlier: list[tuple[list[int], int]], shares: list[tuple[int, int, int]]
    ) -> int:
        """How many of `prompt`'s first positions its pass need not compute: its longest run of whole
        blocks that the cache holds (copied into `slot` now, `load`) or that a prompt admitted
        earlier in the same pass begins with (`earlier`: (prompt, slot) pairs), which the pass
        copies layer by layer as it computes them: a (source slot, slot, positions) entry appended
        to `shares` (runner.mixed)."""
        cached = self.match(prompt)
        most, best, source = (len(prompt) - 1) // BLOCK, len(cached), -1
        for other, other_slot in earlier:
            b = 0
            while b < most and prompt[b * BLOCK : (b + 1) * BLOCK] == other[b * BLOCK : (b + 1) * BLOCK]:
                b += 1
            if b > best:
                best, source = b, other_slot
        if source < 0:
            return self.load(cached, slot)
        shares.append((source, slot, best * BLOCK))
        return best * BLOCK

    def load(self, blocks: list[_Block], slot: int) -> int:
        """Copy `blocks` (a `match`) into positions 0.. of `slot`; returns how many positions they fill."""
        if not blocks:
            return 0
        n = len(blocks) * BLOCK
        self.cache[:, slot, :, :n] = self.pool[:, :, self._positions([b.index for b in blocks])]
        self._touch(blocks)
        return n

    def store(self, prompt: list[int], slot: int) -> int:
        """Cache the whole blocks of `prompt` not cached yet, from `slot` (which holds the prompt's KV
        from position 0); returns how many blocks were added (fewer when the budget ran out)."""
        path: list[_Block] = []
        node, new = self.root, []
        for b in range(len(prompt) // BLOCK):
            key = tuple(prompt[b * BLOCK : (b + 1) * BLOCK])
            child = node.children.get(key)
            if child is None:
                index = self._allocate(set(path))
                if index is None:
                    break
                child = node.children[key] = _Block(key, node, index)
                self._lru[child] = None
                new.append((index, b))
            path.append(child)
            node = child
        if new:
            dst, src = zip(*new)
            self.pool[:, :, self._positions(list(dst))] = self.cache[:, slot, :, self._positions(list(src))]
        self._touch(path)
        return len(new)

    def clear(self) -> None:
        self.root.children.clear()
        self._lru.clear()
        self._free = list(range(self.capacity - 1, -1, -1))

    def _positions(self, blocks: list[int]) -> torch.Tensor:
        """The pool (or slot) positions of `blocks`, in order."""
        return (torch.tensor(blocks)[:, None] * BLOCK + torch.arange(BLOCK)).view(-1)

    def _touch(self, path: list[_Block]) -> None:
        for node in reversed(path):  # deepest first: a parent ends up after its children
            self._lru.move_to_end(node)

    def _allocate(self, keep: set[_Block]) -> int | None:
        """A free block of the pool, evicting the least recently used leaf outside `keep` if none is free."""
        if self._free:
            return self._free.pop()
        for node in self._lru:
            if not node.children and node not in keep:
                break
        else:
            return None
        del self._lru[node]
        assert node.parent is not None  # the root is never in the recency order
        del node.parent.children[node.key]
        self.evictions += 1
        return node.index
