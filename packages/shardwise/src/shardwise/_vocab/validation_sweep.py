"""The overlap tests of :mod:`shardwise._vocab.validation` for shards cut along two or more dims.

Every function here takes the non-empty shards as columns (``starts[k][i]``
and ``sizes[k][i]``: shard ``i`` along the ``k``-th dim examined) and
returns the local indices of two overlapping shards, or None.

- :func:`tiles`: the corner test, a fast yes for layouts that tile their
  bounding box exactly (every valid layout of a whole tensor);
- :func:`two_dims`: a sweep whose active shards sit in a blocked sorted
  list, O(n log n) plus O(n sqrt n) cheap block moves at worst;
- :func:`many_dims`: elementary cells (the cuts of all shards along each
  dim), claimed in one dict when that stays within a budget (a grid claims
  one cell a shard); past it, a sweep along the dim that leaves the fewest
  cells in the other dims, where the active shards claim their projected
  cells; past that too, it raises OverflowError and the caller uses the
  segment trees of :mod:`~shardwise._vocab.validation_tree`.

Why the projected sweep is exact: the shards active at one sweep position
all contain that coordinate, so (with no overlap found so far) their
projections onto the other dims are pairwise disjoint and claim disjoint
cells; a new shard overlaps an active one exactly when its projection
shares a cell with one, and the first shared cell ends the check.
"""

from __future__ import annotations

import bisect
import heapq
from itertools import repeat
from operator import add, mul, sub
from typing import Optional, Sequence

__all__ = ["many_dims", "pairwise_sweep", "tiles", "two_dims"]

Pair = Optional[tuple[int, int]]

#: Items per block of the sweep's sorted list: inserts move at most twice this, the block list n / this.
_BLOCK = 512


def tiles(starts: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> bool:
    """Whether the non-empty boxes tile their bounding box exactly; O(n 2^k log n) for k dims.

    A box's indicator is the signed sum of the orthants at its 2^k corners
    (sign -1 per coordinate taken at the box's end); orthants at distinct
    points are linearly independent, so the boxes' indicators add up to the
    bounding box's exactly when their signed corners, summed per point,
    equal the bounding box's. Adding up to the bounding box's indicator
    means no point is held twice: no overlap (and no gap), whatever the
    layout. False says only that the boxes do not tile it.
    """
    ends = [list(map(add, s, z)) for s, z in zip(starts, sizes, strict=True)]
    lower = [min(column) for column in starts]
    upper = [max(column) for column in ends]
    plus: list[int] = []
    minus: list[int] = []
    for mask in range(1 << len(starts)):
        # A corner as one int, its coordinates' mixed-radix digits (maps in C: no tuple per corner).
        key: list[int] = [0] * len(starts[0])
        corner = 0
        for k in range(len(starts)):
            span, column = upper[k] - lower[k] + 1, ends[k] if mask >> k & 1 else starts[k]
            key = list(map(add, map(mul, key, repeat(span)), map(sub, column, repeat(lower[k]))))
            corner = corner * span + (upper[k] - lower[k] if mask >> k & 1 else 0)
        # Corners with an odd number of end coordinates count -1: they go with the bounding box's +1 corners.
        odd = bin(mask).count("1") % 2
        (minus if odd else plus).extend(key)
        (plus if odd else minus).append(corner)
    plus.sort()
    minus.sort()
    return plus == minus


class _SortedBlocks:
    """A sorted list of tuples kept in blocks of at most ``2 * _BLOCK``, so insert and delete move little.

    A plain list's ``insert``/``del`` move every later item: quadratic once
    half the shards cross the sweep line. Here they move one block, plus an
    entry of the block index (n / _BLOCK of them).
    """

    def __init__(self) -> None:
        self.blocks: list[list[tuple[int, int, int]]] = []
        self.firsts: list[tuple[int, int, int]] = []  # each block's first item, to find the block by bisection

    def _locate(self, item: tuple[int, int, int]) -> tuple[int, int]:
        b = max(bisect.bisect_right(self.firsts, item) - 1, 0)
        return b, bisect.bisect_left(self.blocks[b], item)

    def add_unless_overlapping(self, item: tuple[int, int, int]) -> Optional[int]:
        """Insert ``(start, end, shard)`` unless a neighbour overlaps it; then return that neighbour's shard."""
        if not self.blocks:
            self.blocks.append([item])
            self.firsts.append(item)
            return None
        b, p = self._locate(item)
        block = self.blocks[b]
        # The items are disjoint intervals sorted by start: only the two around ``item`` can meet it.
        before = block[p - 1] if p else (self.blocks[b - 1][-1] if b else None)
        if before is not None and before[1] > item[0]:
            return before[2]
        after = block[p] if p < len(block) else (self.blocks[b + 1][0] if b + 1 < len(self.blocks) else None)
        if after is not None and after[0] < item[1]:
            return after[2]
        block.insert(p, item)
        if p == 0:
            self.firsts[b] = item
        if len(block) > 2 * _BLOCK:
            self.blocks.insert(b + 1, block[_BLOCK:])
            self.firsts.insert(b + 1, block[_BLOCK])
            del block[_BLOCK:]
        return None

    def remove(self, item: tuple[int, int, int]) -> None:
        b, p = self._locate(item)
        block = self.blocks[b]
        del block[p]
        if not block:
            del self.blocks[b], self.firsts[b]
        elif p == 0:
            self.firsts[b] = block[0]


def two_dims(starts: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]], a: int) -> Pair:
    """Sweep along dim ``a`` (0 or 1); the shards crossing the sweep line are disjoint along the other.

    So a new shard need only be compared with its two neighbours among them.
    """
    b = 1 - a
    a_start, b_start = starts[a], starts[b]
    a_end, b_end = list(map(add, a_start, sizes[a])), list(map(add, b_start, sizes[b]))
    order = sorted(range(len(a_start)), key=a_start.__getitem__)
    expiry = sorted(range(len(a_start)), key=a_end.__getitem__)
    gone = 0
    active = _SortedBlocks()
    for i in order:
        start = a_start[i]
        # Ends are met in order, so a pointer into them replaces a heap.
        while a_end[expiry[gone]] <= start:
            j = expiry[gone]
            active.remove((b_start[j], b_end[j], j))
            gone += 1
        met = active.add_unless_overlapping((b_start[i], b_end[i], i))
        if met is not None:
            return met, i
    return None


def pairwise_sweep(starts: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]], a: int) -> Pair:
    """Sweep along dim ``a``, comparing each shard with every shard crossing the sweep line.

    torch 2.13's method: cheapest for a handful of shards (the only ones
    the caller gives it), quadratic when many cross the line at once.
    """
    n = len(starts[0])
    ends = [list(map(add, s, z)) for s, z in zip(starts, sizes, strict=True)]
    others = [k for k in range(len(starts)) if k != a]
    order = sorted(range(n), key=starts[a].__getitem__)
    expiry: list[tuple[int, int]] = []
    active: set[int] = set()
    for i in order:
        start = starts[a][i]
        while expiry and expiry[0][0] <= start:
            active.discard(heapq.heappop(expiry)[1])
        for j in active:
            if all(starts[k][i] < ends[k][j] and starts[k][j] < ends[k][i] for k in others):
                return j, i
        active.add(i)
        heapq.heappush(expiry, (ends[a][i], i))
    return None


def many_dims(starts: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]], budget: int, corner_dims: int) -> Pair:
    """Elementary cells claimed in a dict, or by the active shards of a sweep; see the module docstring.

    Costs O(k n log n) to find the cells, then O(cells claimed): all cells
    while they stay within ``budget`` (the caller's few per shard); else,
    for at most ``corner_dims`` dims, :func:`tiles` first (a yes ends it),
    then the projected cells of the cheapest sweep, within ``budget`` too.

    Raises:
        OverflowError: every way would claim more than ``budget`` cells.
    """
    n = len(starts[0])
    ndim = len(starts)
    lows: list[list[int]] = []
    spans: list[list[int]] = []
    radix: list[int] = []
    for column, lengths in zip(starts, sizes, strict=True):
        ends = list(map(add, column, lengths))
        cuts = sorted(set(column).union(ends))
        rank = dict(zip(cuts, range(len(cuts)), strict=True))
        low = list(map(rank.__getitem__, column))
        lows.append(low)
        spans.append(list(map(sub, map(rank.__getitem__, ends), low)))
        radix.append(len(cuts))
    every: list[int] = spans[0]
    for column in spans[1:]:
        every = list(map(mul, every, column))
    if every.count(1) == n and n <= budget:
        # One cell a shard (grids, diagonals): distinct keys, decided by a set built in C, or a repeat to find.
        single = _single_keys(lows, radix, range(ndim))
        if len(set(single)) == n:
            return None
        return _claim([[k] for k in single])
    if sum(every) <= budget:
        return _claim(_keys(lows, spans, radix, range(ndim), every))
    if ndim <= corner_dims and tiles(starts, sizes):
        return None  # tiles its bounding box (staggered or guillotine cuts): too many cells, no overlap
    # Cells each shard claims in the dims other than d, for each d: the cost of sweeping along d.
    without = []
    for d in range(ndim):
        counts: list[int] = [1] * n
        for k in range(ndim):
            if k != d:
                counts = list(map(mul, counts, spans[k]))
        without.append(counts)
    cost = [sum(counts) for counts in without]
    a = min(range(ndim), key=cost.__getitem__)
    if cost[a] > budget:
        raise OverflowError
    others = [k for k in range(ndim) if k != a]
    a_end = list(map(add, starts[a], sizes[a]))
    if without[a].count(1) == n:
        return _claim_sweeping(starts[a], a_end, [[key] for key in _single_keys(lows, radix, others)])
    return _claim_sweeping(starts[a], a_end, _keys(lows, spans, radix, others, without[a]))


def _keys(
    lows: list[list[int]], spans: list[list[int]], radix: list[int], dims: Sequence[int], counts: list[int]
) -> list[list[int]]:
    """Each shard's cells along ``dims``, each cell one mixed-radix int."""
    out = []
    for i in range(len(counts)):
        cells = [0]
        for d in dims:
            lo, r = lows[d][i], radix[d]
            cells = [c * r + x for c in cells for x in range(lo, lo + spans[d][i])]
        out.append(cells)
    return out


def _single_keys(lows: list[list[int]], radix: list[int], dims: Sequence[int]) -> list[int]:
    """The one cell of each shard along ``dims`` (each spans one elementary interval there), in C."""
    key: list[int] = [0] * len(lows[0])
    for d in dims:
        key = list(map(add, map(mul, key, repeat(radix[d])), lows[d]))
    return key


def _claim(keys: list[list[int]]) -> Pair:
    """Two shards claiming one cell, or None."""
    owner: dict[int, int] = {}
    for i, cells in enumerate(keys):
        for cell in cells:
            j = owner.setdefault(cell, i)
            if j != i:
                return j, i
    return None


def _claim_sweeping(a_start: Sequence[int], a_end: Sequence[int], keys: list[list[int]]) -> Pair:
    """Sweep along one dim; the active shards own their projected cells (disjoint while no overlap is found)."""
    order = sorted(range(len(a_start)), key=a_start.__getitem__)
    expiry = sorted(range(len(a_start)), key=a_end.__getitem__)
    gone = 0
    owner: dict[int, int] = {}
    for i in order:
        start = a_start[i]
        while a_end[expiry[gone]] <= start:
            for cell in keys[expiry[gone]]:
                del owner[cell]
            gone += 1
        for cell in keys[i]:
            j = owner.setdefault(cell, i)
            if j != i:
                return j, i
    return None
