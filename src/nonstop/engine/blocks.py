"""Attention blocks of a decode step, and the row order that keeps them short.

The runner (engine/runner.py) attends decode rows in blocks of ATTN_BLOCK consecutive rows, each
block reading the cached keys up to its own longest row (`attention_blocks`). A continuous batch
of uneven completions scrambles: a finished row's slot goes to the newest row, so long sequences
spread over every block and each block again reads up to its longest row. `reorder_plan` says
when moving rows pays, and where to: only rows in the wrong block move (`block_order`), and only
when the reads saved per step outweigh the copy. The scheduler applies a plan with
`Runner.permute` after rows finish.
"""

from __future__ import annotations

ATTN_BLOCK = 16  # decode rows per attention block when a long tail makes one padded block wasteful
REORDER_COPY_PER_READ = 1 / 8
"""A reorder copies each moved row's cached positions once; it runs when the attention reads it saves
per decode step are at least this many times the positions it copies (a copied position measured about
a third of a read one on CPU, and the saving recurs on every later step until the order decays)."""
REORDER_MIN_GAIN = 0.1  # nor for less than a tenth of a step's reads: that gain decays within a few finishes


def attention_blocks(keys: list[int]) -> list[tuple[int, int, int]]:
    """How a decode step whose row i attends to `keys[i]` cached positions splits its attention:
    (first row, end row, keys read) per block.

    One block reads every row's keys up to the longest row; with a long tail that wastes most of
    the attention on padding, so rows are split into blocks of ATTN_BLOCK rows, each reading only
    up to its own longest row, whenever that saves at least a third."""
    B, T = len(keys), max(keys)
    blocks = [(a, min(a + ATTN_BLOCK, B), max(keys[a : a + ATTN_BLOCK])) for a in range(0, B, ATTN_BLOCK)]
    if len(blocks) == 1 or sum((b - a) * t for a, b, t in blocks) > B * T * 2 / 3:
        return [(0, B, T)]
    return blocks


def attention_reads(keys: list[int]) -> int:
    """Cached positions a decode step reads over all its rows, padding included (`attention_blocks`)."""
    return sum((b - a) * t for a, b, t in attention_blocks(keys))


def block_order(keys: list[int]) -> list[int]:
    """The slot order (slot i takes row order[i]) that puts rows into attention blocks by
    descending `keys`, moving only rows that are in the wrong block: within a block the order
    does not change what it reads."""
    B = len(keys)
    ranked = sorted(range(B), key=lambda r: -keys[r])  # stable: equal keys keep their slots
    block = [0] * B
    for k, r in enumerate(ranked):
        block[r] = k // ATTN_BLOCK
    order = [r if r // ATTN_BLOCK == block[r] else -1 for r in range(B)]
    homeless: dict[int, list[int]] = {}
    for r in range(B):
        if order[r] == -1:
            homeless.setdefault(block[r], []).append(r)
    for i in range(B):
        if order[i] == -1:
            order[i] = homeless[i // ATTN_BLOCK].pop()
    return order


def reorder_plan(keys: list[int]) -> list[int] | None:
    """The slot order (`block_order`) for rows attending to `keys` positions, or None when moving
    rows would not pay: it must cut the step's reads by REORDER_MIN_GAIN of them and by at least
    REORDER_COPY_PER_READ of the positions the moved rows copy."""
    if not keys:
        return None
    # block_order's blocks read what the keys sorted by descending length read, so the gain is
    # known before the order is built; most calls end here (the order has not decayed enough)
    reads = attention_reads(keys)
    saved = reads - attention_reads(sorted(keys, reverse=True))
    if saved < REORDER_MIN_GAIN * reads:
        return None
    order = block_order(keys)
    copied = sum(keys[r] for i, r in enumerate(order) if r != i)
    if saved < REORDER_COPY_PER_READ * copied:
        return None
    return order
