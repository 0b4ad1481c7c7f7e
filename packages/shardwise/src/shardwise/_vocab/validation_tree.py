"""The overlap test of :mod:`shardwise._vocab.validation` that no layout makes quadratic: segment trees.

:func:`any_overlap` finds two overlapping boxes among n boxes in k dims in
O(n log^k n) steps for every layout: the last resort of
:func:`~shardwise._vocab.validation_sweep.many_dims`, for layouts (three or
more dims, not tiling their bounding box) whose elementary cells are too
many to claim. torch 2.13's sweep, which compares a shard with every shard
crossing the sweep line, is quadratic there (a k-d split of a 3-D tensor
with some shards missing crosses about n^(2/3) shards at each position).

Why it is exact. Along one dim ``d``, the boxes' ends cut the line into
elementary intervals, and a segment tree over them stores each box at the
O(log n) nodes its interval covers exactly (its *span* nodes; at each
level at most two more nodes are *partly* covered). Two boxes whose
intervals meet both contain some elementary interval; on the path from
the root to that leaf each of them has exactly one span node, and the
higher of the two (say ``v``, of box ``x``) has the other box either in
its span list too or among the boxes partly covering ``v``. Every box at
``v`` (spanning or partly covering it) meets ``x`` along ``d``, so at
``v`` only the other dims are left: the span list is checked against
itself and against the partly covering boxes in one dim fewer
(:func:`_red_blue`, the two-set version, splits the same way). Each box is
at O(log n) nodes, so each dim but the last costs a factor log n, and the
last dim is a sort, O(n log n) (for one set, the two-dim sweep of
:func:`~shardwise._vocab.validation_sweep.two_dims` does the last two dims
in O(n log n)): O(n log^k n) in all, O(n log^3 n) for three dims.
"""

from __future__ import annotations

import bisect
from operator import add
from typing import Iterator, Optional, Sequence

from shardwise._vocab.validation_sweep import two_dims

__all__ = ["any_overlap"]

Pair = Optional[tuple[int, int]]
Columns = list[list[int]]

#: A set this small is checked pair by pair: cheaper than a tree.
_FEW = 24
#: Two sets are compared box by box while that costs at most this many steps per box (a tree's log n or so).
_FEW_PAIRS = 16


def any_overlap(starts: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> Pair:
    """Local indices of two overlapping non-empty boxes (``starts[k][i]``, ``sizes[k][i]``), or None."""
    lo = [list(column) for column in starts]
    hi = [list(map(add, s, z)) for s, z in zip(starts, sizes, strict=True)]
    # The tree's dim first: the one with the most distinct starts leaves the fewest boxes per node.
    dims = sorted(range(len(lo)), key=lambda k: -len(set(lo[k])))
    return _self(list(range(len(lo[0]))), tuple(dims), lo, hi)


def _meet(i: int, j: int, dims: Sequence[int], lo: Columns, hi: Columns) -> bool:
    return all(lo[d][i] < hi[d][j] and lo[d][j] < hi[d][i] for d in dims)


def _self(ids: list[int], dims: tuple[int, ...], lo: Columns, hi: Columns) -> Pair:
    """Two boxes of ``ids`` that meet along every dim of ``dims``, or None."""
    if len(ids) < 2:
        return None
    if len(ids) <= _FEW:
        for a, i in enumerate(ids):
            for j in ids[a + 1 :]:
                if _meet(i, j, dims, lo, hi):
                    return i, j
        return None
    if len(dims) == 1:
        d = dims[0]
        # Sorted by start, a box meets an earlier one exactly when it starts before the furthest end so far.
        order = sorted(ids, key=lo[d].__getitem__)
        reach = order[0]
        for i in order[1:]:
            if lo[d][i] < hi[d][reach]:
                return reach, i
            if hi[d][i] > hi[d][reach]:
                reach = i
        return None
    if len(dims) == 2:
        a, b = dims
        columns = [list(map(lo[a].__getitem__, ids)), list(map(lo[b].__getitem__, ids))]
        lengths = [
            [hi[a][i] - lo[a][i] for i in ids],
            [hi[b][i] - lo[b][i] for i in ids],
        ]
        pair = two_dims(columns, lengths, 0 if len(set(columns[0])) >= len(set(columns[1])) else 1)
        return None if pair is None else (ids[pair[0]], ids[pair[1]])
    d, rest = dims[0], dims[1:]
    for span, partly in _nodes(ids, lo[d], hi[d]):
        pair = _self(span, rest, lo, hi) or _red_blue(span, partly, rest, lo, hi)
        if pair is not None:
            return pair
    return None


def _red_blue(reds: list[int], blues: list[int], dims: tuple[int, ...], lo: Columns, hi: Columns) -> Pair:
    """A box of ``reds`` and one of ``blues`` that meet along every dim of ``dims``, or None."""
    if not reds or not blues:
        return None
    if len(dims) == 1:
        d = dims[0]
        # Reds by start, with the furthest end among each prefix: a blue meets a red that starts
        # before the blue ends exactly when the furthest of their ends passes the blue's start.
        order = sorted(reds, key=lo[d].__getitem__)
        red_starts = [lo[d][i] for i in order]
        furthest: list[int] = []
        best = order[0]
        for i in order:
            if hi[d][i] > hi[d][best]:
                best = i
            furthest.append(best)
        for j in blues:
            p = bisect.bisect_left(red_starts, hi[d][j])
            if p and hi[d][furthest[p - 1]] > lo[d][j]:
                return furthest[p - 1], j
        return None
    few_red = len(reds) <= len(blues)
    few, many = (reds, blues) if few_red else (blues, reds)
    # Only the boxes of the larger set that meet the smaller set's bounding box can meet one of its boxes.
    for d in dims:
        los, his = lo[d], hi[d]
        start, end = min(map(los.__getitem__, few)), max(map(his.__getitem__, few))
        many = [j for j in many if los[j] < end and his[j] > start]
        if not many:
            return None
    if len(many) < len(few):
        few, many, few_red = many, few, not few_red
    if len(few) * len(many) <= _FEW_PAIRS * (len(few) + len(many)):
        for i in few:
            # Filtered one dim at a time, each a comprehension: a few boxes against many cost little.
            met = many
            for d in dims:
                start, end, los, his = lo[d][i], hi[d][i], lo[d], hi[d]
                met = [j for j in met if los[j] < end and his[j] > start]
                if not met:
                    break
            else:
                return (i, met[0]) if few_red else (met[0], i)
        return None
    reds, blues = (few, many) if few_red else (many, few)
    d, rest = dims[0], dims[1:]
    for red_span, red_partly, blue_span, blue_partly in _nodes_two(reds, blues, lo[d], hi[d]):
        pair = _red_blue(red_span, blue_span + blue_partly, rest, lo, hi) or _red_blue(
            red_partly, blue_span, rest, lo, hi
        )
        if pair is not None:
            return pair
    return None


def _cuts(ids: list[int], lo: list[int], hi: list[int]) -> list[int]:
    return sorted({lo[i] for i in ids}.union(hi[i] for i in ids))


def _nodes(ids: list[int], lo: list[int], hi: list[int]) -> Iterator[tuple[list[int], list[int]]]:
    """Each segment-tree node with boxes spanning it: (those boxes, the boxes covering it in part)."""
    cuts = _cuts(ids, lo, hi)
    stack = [(0, len(cuts) - 1, ids)]
    while stack:
        a, b, items = stack.pop()
        start, end = cuts[a], cuts[b]
        span = [i for i in items if lo[i] <= start and hi[i] >= end]
        if len(span) == len(items):
            yield span, []
            continue
        partly = [i for i in items if lo[i] > start or hi[i] < end]
        if span:
            yield span, partly
        m = (a + b) // 2
        cut = cuts[m]
        left = [i for i in partly if lo[i] < cut]
        right = [i for i in partly if hi[i] > cut]
        # A box alone below here meets nothing there that this node and those above have not checked.
        if len(left) > 1:
            stack.append((a, m, left))
        if len(right) > 1:
            stack.append((m, b, right))


def _nodes_two(
    reds: list[int], blues: list[int], lo: list[int], hi: list[int]
) -> Iterator[tuple[list[int], list[int], list[int], list[int]]]:
    """:func:`_nodes` for two sets at once, skipping the nodes where either has no box."""
    cuts = _cuts(reds + blues, lo, hi)
    stack = [(0, len(cuts) - 1, reds, blues)]
    while stack:
        a, b, r, u = stack.pop()
        start, end = cuts[a], cuts[b]
        red_span = [i for i in r if lo[i] <= start and hi[i] >= end]
        blue_span = [i for i in u if lo[i] <= start and hi[i] >= end]
        red_partly = [i for i in r if lo[i] > start or hi[i] < end]
        blue_partly = [i for i in u if lo[i] > start or hi[i] < end]
        if (red_span and u) or (blue_span and r):
            yield red_span, red_partly, blue_span, blue_partly
        if b - a < 2 or not red_partly or not blue_partly:
            continue
        m = (a + b) // 2
        cut = cuts[m]
        for x, y, r_side, u_side in (
            (a, m, [i for i in red_partly if lo[i] < cut], [i for i in blue_partly if lo[i] < cut]),
            (m, b, [i for i in red_partly if hi[i] > cut], [i for i in blue_partly if hi[i] > cut]),
        ):
            if r_side and u_side:
                stack.append((x, y, r_side, u_side))
