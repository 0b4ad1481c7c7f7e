"""Box intersection, the one rule, and an index that answers "which boxes meet this one" without a full scan.

:func:`intersect` is the definition of where two boxes of a tensor meet;
the transfer planner (:mod:`shardwise._layout.plan`) and the checkpoint
load planner (:mod:`shardwise._modules.load_plan`) both read intersections
through :class:`BoxIndex`, which applies it to the few boxes near a query.

Along one dimension, a box of length at most ``L`` can meet the query
``[lo, hi)`` only if it starts in ``(lo - L, hi)``: with the boxes' starts
sorted, bisection finds that window. Boxes are grouped by length class
(lengths within a factor of two) so that one long box does not widen the
window for all the short ones. :class:`BoxIndex` sorts the boxes once along
the dimension along which they are shortest relative to their extent, and
scans a query's window along it. A query long along that dimension (a
column band against a square grid indexed by rows) would scan nearly every
box. So once wide windows (more than a few boxes) have held as many boxes
as the index does, it sorts the boxes along the other dimensions too, and
from then on a query with a wide window counts its window along every
dimension by bisection and scans the smallest. A sort costs about what
scanning a third of the boxes does, so an index whose wide windows are only
the boxes its queries meet (rows of a grid indexed by rows) never pays for it.

Building costs O(n log n), and as much again per other dimension if wide
windows call for it; a query costs O(log n) per length class (per
dimension, for one with a wide window) plus the boxes in the window it
scans, which for a layout cut into slabs, a grid or chunks is the boxes it
meets plus at most one on each side per class.
"""

from __future__ import annotations

import bisect
from itertools import chain
from operator import add, itemgetter, le
from typing import Iterator, Optional, Sequence

__all__ = ["BoxIndex", "intersect"]

# A window of at most this many boxes is scanned as it is: looking along the other dims would cost more.
_FEW = 8


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
    """The boxes of one length class along one dim: their starts along it, sorted, and their indices."""

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


def _classes(
    offsets: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]], live: Sequence[int], dim: int
) -> list[_Class]:
    """The (non-empty) boxes ``live`` sorted along ``dim``, one :class:`_Class` per length class, shortest first."""
    get = itemgetter(dim)
    starts = list(map(get, offsets))
    lengths = list(map(get, sizes))
    live_lengths = lengths if len(live) == len(lengths) else [lengths[i] for i in live]
    if max(live_lengths).bit_length() == min(live_lengths).bit_length():
        # The common case (chunks of one size, give or take one): no grouping pass.
        return [_Class(live, starts, lengths)]
    groups: dict[int, list[int]] = {}
    for i in live:
        groups.setdefault(lengths[i].bit_length(), []).append(i)
    return [_Class(idx, starts, lengths) for _, idx in sorted(groups.items())]


def _window(classes: list[_Class], lo: int, hi: int) -> tuple[int, list[tuple[list[int], int, int]]]:
    """How many boxes of ``classes`` may meet ``[lo, hi)``, and each class's ``(order, first, last)`` of them."""
    count, spans = 0, []
    for cls in classes:
        first = bisect.bisect_right(cls.starts, lo - cls.longest)
        last = bisect.bisect_left(cls.starts, hi, first)
        count += last - first
        spans.append((cls.order, first, last))
    return count, spans


class BoxIndex:
    """Boxes (offsets and sizes, all of one number of dims) indexed for intersection queries.

    Args:
        offsets: Each box's start in every dim.
        sizes: Each box's size in every dim.
        dim: The only dim to sort along; default: the one where the longest
            box is shortest relative to the boxes' extent, and the others
            too for the queries that are long along that one.

    Attributes:
        dim: The dim sorted along when built (``dim`` if given); a query
            long along it may be answered along another.

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
        self._live = live
        self.dim = self._pick(live) if dim is None else dim
        # Other dims are looked along only when the caller left the choice to the index.
        self._may_switch = dim is None and self.ndim > 1
        # The boxes in the wide windows along self.dim so far: what decides sorting along the others.
        self._wide = 0
        # 0-dim boxes (scalars) have no dim to sort along: queries compare them all.
        self._all: list[int] = list(live) if self.ndim == 0 else []
        # Each dim's classes: self.dim's built here, the others by the first query with a wide window.
        self._along: dict[int, list[_Class]] = {}
        if live and self.ndim:
            self._along[self.dim] = _classes(offsets, sizes, live, self.dim)

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

    def _classes_along(self, dim: int) -> list[_Class]:
        """The boxes' classes along ``dim``, sorted on first use and kept."""
        classes = self._along.get(dim)
        if classes is None:
            classes = self._along[dim] = _classes(self.offsets, self.sizes, self._live, dim)
        return classes

    def query(self, offsets: Sequence[int], sizes: Sequence[int]) -> Iterator[tuple[int, list[int], list[int]]]:
        """``(index, offsets, sizes)`` of each box's intersection with the box ``offsets``/``sizes``.

        Boxes come by length class, then by start along the dim the query
        was answered along (the index's :attr:`dim`, or another for a query
        long along that one; callers must not depend on the order).
        An empty query box meets nothing.
        """
        if 0 in sizes:
            return
        box_offsets, box_sizes = self.offsets, self.sizes
        for i in self._all:
            met = intersect(box_offsets[i], box_sizes[i], offsets, sizes)
            if met is not None:
                yield i, met[0], met[1]
        if not self._along:
            return
        lo = offsets[self.dim]
        count, spans = _window(self._along[self.dim], lo, lo + sizes[self.dim])
        if count > _FEW and self._may_switch:
            self._wide += count
            if self._wide >= len(self._live):
                # Wide windows have cost more than sorting along the other dims does (once); counting each
                # dim's window costs O(classes log n), far less than scanning one that may hold every box.
                for d in range(self.ndim):
                    if d != self.dim:
                        start = offsets[d]
                        other, other_spans = _window(self._classes_along(d), start, start + sizes[d])
                        if other < count:
                            count, spans = other, other_spans
        for order, first, last in spans:
            for i in order[first:last]:
                met = intersect(box_offsets[i], box_sizes[i], offsets, sizes)
                if met is not None:
                    yield i, met[0], met[1]
