"""Box intersection, the one rule, and an index that answers "which boxes meet this one" without a full scan.

:func:`intersect` is the definition of where two boxes of a tensor meet;
the transfer planner (:mod:`shardwise._layout.plan`) and the checkpoint
load planner (:mod:`shardwise._modules.load_plan`) both read intersections
through :class:`BoxIndex`, which applies it to the few boxes near a query.

:class:`BoxIndex` sorts the boxes once along one dimension (the one along
which they are shortest relative to their extent) and answers a query by
bisection: a box of length at most ``L`` along that dimension can meet the
query ``[lo, hi)`` only if it starts in ``(lo - L, hi)``. Boxes are grouped
by length class (lengths within a factor of two) so that one long box does
not widen the window for all the short ones. Building costs O(n log n); a
query costs O(log n) per length class plus the boxes in its window, which
for a layout cut into slabs, a grid or chunks along the indexed dimension
is the boxes it meets plus at most one on each side per class.
"""

from __future__ import annotations

import bisect
from itertools import chain
from operator import add, itemgetter, le
from typing import Iterator, Optional, Sequence

__all__ = ["BoxIndex", "intersect"]


def intersect(
    a_offsets: Sequence[int], a_sizes: Sequence[int], b_offsets: Sequence[int], b_sizes: Sequence[int]
) -> Optional[tuple[list[int], list[int]]]:
    """The intersection of two boxes as ``(offsets, sizes)``, or None if empty.

    Boxes with a zero-size dimension never intersect anything. This is
    the one definition of box intersection (re-exported by
    :mod:`shardwise._vocab.metadata`).

    Raises:
        ValueError: the offsets and sizes do not all have the same length.
    """
    if not len(a_offsets) == len(a_sizes) == len(b_offsets) == len(b_sizes):
        raise ValueError(
            f"cannot intersect boxes of different dimensions: offsets {list(a_offsets)} sizes {list(a_sizes)} "
            f"and offsets {list(b_offsets)} sizes {list(b_sizes)}"
        )
    offsets, sizes = [], []
    for ao, asz, bo, bsz in zip(a_offsets, a_sizes, b_offsets, b_sizes, strict=True):
        # Conditional expressions, not max/min: planners call this for every pair of boxes that meet.
        lo = ao if ao > bo else bo
        a_end, b_end = ao + asz, bo + bsz
        hi = a_end if a_end < b_end else b_end
        if hi <= lo:
            return None
        offsets.append(lo)
        sizes.append(hi - lo)
    return offsets, sizes


class _Class:
    """The boxes of one length class: their starts along the indexed dim, sorted, and their indices."""

    __slots__ = ("longest", "order", "starts")

    def __init__(self, idx: Sequence[int], starts: Sequence[int], lengths: Sequence[int]) -> None:
        mine = [starts[i] for i in idx] if len(idx) != len(starts) else list(starts)
        order = list(idx)
        if not all(map(le, mine, mine[1:])):
            # Sorted by start; ties keep the input order (sorted is stable), so queries list boxes reproducibly.
            ranks = sorted(range(len(order)), key=mine.__getitem__)
            order = [order[k] for k in ranks]
            mine = [mine[k] for k in ranks]
        self.starts = mine
        self.order = order
        self.longest = max(lengths[i] for i in order) if order else 0


class BoxIndex:
    """Boxes (offsets and sizes, all of one number of dims) indexed for intersection queries.

    Args:
        offsets: Each box's start in every dim.
        sizes: Each box's size in every dim.
        dim: The dim to sort along; default: the one where the longest box
            is shortest relative to the boxes' extent.

    Raises:
        ValueError: boxes with different numbers of dims.
    """

    def __init__(self, offsets: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]], dim: Optional[int] = None):
        self.offsets = offsets
        self.sizes = sizes
        n = len(offsets)
        self.ndim = len(offsets[0]) if n else 0
        if any(len(o) != self.ndim for o in offsets) or any(len(s) != self.ndim for s in sizes):
            raise ValueError(f"cannot index boxes of different numbers of dimensions ({self.ndim} and others)")
        # Empty boxes meet nothing: left out here, so no query looks at them.
        live: Sequence[int] = range(n)
        if 0 in chain.from_iterable(sizes):
            live = [i for i in range(n) if 0 not in sizes[i]]
        self.dim = self._pick(live) if dim is None else dim
        self._classes: list[_Class] = []
        if not live or self.ndim == 0:
            self._all = list(live)
            return
        self._all = []
        get = itemgetter(self.dim)
        starts = list(map(get, offsets))
        lengths = list(map(get, sizes))
        live_lengths = lengths if len(live) == n else [lengths[i] for i in live]
        if max(live_lengths).bit_length() == min(live_lengths).bit_length():
            self._classes.append(_Class(live, starts, lengths))
            return
        groups: dict[int, list[int]] = {}
        for i in live:
            groups.setdefault(lengths[i].bit_length(), []).append(i)
        self._classes.extend(_Class(idx, starts, lengths) for _, idx in sorted(groups.items()))

    def _pick(self, live: Sequence[int]) -> int:
        """The dim along which the longest box is the smallest part of the boxes' extent."""
        if self.ndim <= 1 or not live:
            return 0
        offsets = self.offsets if len(live) == len(self.offsets) else [self.offsets[i] for i in live]
        sizes = self.sizes if len(live) == len(self.sizes) else [self.sizes[i] for i in live]
        best, best_score = 0, 2.0
        for d in range(self.ndim):
            get = itemgetter(d)
            longest = max(map(get, sizes))
            extent = max(map(add, map(get, offsets), map(get, sizes))) - min(map(get, offsets))
            score = longest / extent
            if score < best_score:
                best, best_score = d, score
        return best

    def query(self, offsets: Sequence[int], sizes: Sequence[int]) -> Iterator[tuple[int, list[int], list[int]]]:
        """``(index, offsets, sizes)`` of each box's intersection with the box ``offsets``/``sizes``.

        Boxes come by length class, then by start along the indexed dim.
        An empty query box meets nothing.
        """
        if 0 in sizes:
            return
        box_offsets, box_sizes = self.offsets, self.sizes
        for i in self._all:
            met = intersect(box_offsets[i], box_sizes[i], offsets, sizes)
            if met is not None:
                yield i, met[0], met[1]
        if not self._classes:
            return
        lo = offsets[self.dim]
        hi = lo + sizes[self.dim]
        for cls in self._classes:
            first = bisect.bisect_right(cls.starts, lo - cls.longest)
            last = bisect.bisect_left(cls.starts, hi, first)
            for i in cls.order[first:last]:
                met = intersect(box_offsets[i], box_sizes[i], offsets, sizes)
                if met is not None:
                    yield i, met[0], met[1]
