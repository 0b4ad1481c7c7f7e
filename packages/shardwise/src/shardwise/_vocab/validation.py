"""Checks that shards neither overlap nor leave gaps: O(n log n) for n shards in practice, never quadratic.

``validate_non_overlapping`` looks only at the dimensions along which the
non-empty shards actually differ (a dimension every shard spans in the same
way cannot separate two of them):

- none: two non-empty shards are the same box, so they overlap;
- one: the shards are intervals; sorted by start, an overlap shows up
  between neighbours: O(n log n);
- two or more: up to 16 shards, torch 2.13's sweep (each shard against
  those crossing the sweep line); beyond, in
  :mod:`~shardwise._vocab.validation_sweep`:

  - two: a corner test accepts any layout that tiles its bounding box
    (every valid layout of a whole tensor); otherwise a sweep along one dim
    keeps the shards crossing the sweep line in a blocked sorted list along
    the other; they are pairwise disjoint, so a new shard need only be
    compared with its two neighbours there: O(n log n) comparisons, plus
    block moves of at most 1024 items (O(n sqrt n) cheap moves at worst);
  - three or more: the shards' boundaries cut every dim into elementary
    intervals, and two shards overlap exactly when they claim the same
    elementary cell. Grids (one cell a shard) and layouts that claim at
    most 8 cells a shard are checked with one set or dict: O(k n log n +
    cells). Otherwise the corner test (up to 6 dims) accepts tilings, and
    a sweep along the dim that leaves the fewest cells in the others has
    the shards crossing the sweep line claim their projected cells (they
    are pairwise disjoint there, so a shared cell is an overlap): also
    linear in the cells claimed, so layouts split unevenly along one dim
    (each column cut at its own row) stay O(n log n). A layout where every
    such projection claims more than 8 cells a shard (shards cut at their
    own places along every dim, with gaps between them) goes to the segment
    trees of :mod:`~shardwise._vocab.validation_tree`: O(n log^k n) for k
    dims, whatever the layout. torch's sweep, which this used to fall
    back to, is quadratic there when many shards cross the sweep line.

``check_covering`` then needs only the shards' volumes and bounds.
Messages name the shards at fault, and also carry torch 2.13's wording
("Shards ... overlap", "does not match tensor volume", ...), which code
written for torch matches on. Any object with ``shard_offsets`` and
``shard_sizes`` (and a ``placement``, named in messages) is a shard here,
torch's own ``ShardMetadata`` included.
"""

from __future__ import annotations

import math
from itertools import chain
from operator import add, gt, itemgetter, le, mul, sub
from typing import Any, Optional, Protocol, Sequence

from shardwise._vocab.validation_sweep import many_dims, pairwise_sweep, tiles, two_dims
from shardwise._vocab.validation_tree import any_overlap

__all__ = ["check_covering", "describe", "find_overlap", "validate_layout", "validate_non_overlapping"]


class Box(Protocol):
    """What the checks read of a shard: a :class:`~shardwise._vocab.metadata.ShardMetadata` or torch's."""

    @property
    def shard_offsets(self) -> list[int]:
        """Where the box starts in each dim."""
        ...

    @property
    def shard_sizes(self) -> list[int]:
        """Its length in each dim."""
        ...


#: Shards listed at most in a covering error (a message must stay readable with 10^5 shards).
_LISTED = 8

#: Up to this many shards, a layout cut along several dims is checked by the plain sweep.
_FEW = 16

#: Most dims along which shards differ for which the corner check (2^k corners a shard) runs first.
_CORNER_DIMS = 6

#: The cell check runs while the cells claimed stay within this many per shard (plus a constant).
_CELLS_PER_SHARD = 8


def describe(shard: Box) -> str:
    """``offsets=[0, 0] sizes=[3, 4] on rank:0/cpu``: the shard for messages, as ShardMetadata.describe words it.

    Written from the attributes every shard has, not a method: torch's
    ShardMetadata has none, and its messages must still be ValueErrors.
    """
    offsets, sizes = list(shard.shard_offsets), list(shard.shard_sizes)
    return f"offsets={offsets} sizes={sizes} on {getattr(shard, 'placement', None)}"


def _describe(shards: Sequence[Box]) -> str:
    shown = "; ".join(map(describe, shards[:_LISTED]))
    more = len(shards) - _LISTED
    return shown + (f"; ... and {more} more" if more > 0 else "")


def _check_dims(shards: Sequence[Box]) -> int:
    ndim = len(shards[0].shard_offsets)
    for i, shard in enumerate(shards):
        if len(shard.shard_offsets) != ndim:
            raise ValueError(
                f"shards 0 ({describe(shards[0])}) and {i} ({describe(shard)}) have different numbers "
                f"of dimensions (Found inconsistent ranks for shards: {ndim} and {len(shard.shard_offsets)})"
            )
    return ndim


def _one_dim(starts: Sequence[int], lengths: Sequence[int]) -> Optional[tuple[int, int]]:
    """Local indices of two overlapping intervals, or None (maps and sorts in C: this is the common case)."""
    ends = list(map(add, starts, lengths))
    order: Optional[list[int]] = None
    if not all(map(le, starts, starts[1:])):
        order = sorted(range(len(starts)), key=starts.__getitem__)
        starts = list(map(starts.__getitem__, order))
        ends = list(map(ends.__getitem__, order))
    # Sorted by start: if any interval overlaps a later one, it overlaps its successor.
    hits = list(map(gt, ends, starts[1:]))
    if True not in hits:
        return None
    k = hits.index(True)
    return (k, k + 1) if order is None else (order[k], order[k + 1])


def _several_dims(
    starts_by_dim: Sequence[Sequence[int]], sizes_by_dim: Sequence[Sequence[int]], sharded: Sequence[int]
) -> Optional[tuple[int, int]]:
    """Local indices of two overlapping shards cut along the ``sharded`` dims (two or more), or None."""
    starts = [starts_by_dim[d] for d in sharded]
    sizes = [sizes_by_dim[d] for d in sharded]
    n = len(starts[0])
    # A sweep along the dim with the most distinct starts: fewest shards cross the sweep line.
    if n <= _FEW:
        # So few that the plain sweep's lower overhead wins.
        return pairwise_sweep(starts, sizes, max(range(len(starts)), key=lambda k: len(set(starts[k]))))
    if len(sharded) == 2:
        if tiles(starts, sizes):
            return None  # every valid layout of a whole tensor takes this path
        return two_dims(starts, sizes, 0 if len(set(starts[0])) >= len(set(starts[1])) else 1)
    try:
        return many_dims(starts, sizes, _CELLS_PER_SHARD * n + 1024, _CORNER_DIMS)
    except OverflowError:
        return any_overlap(starts, sizes)


class _Columns:
    """The shards' offsets and sizes, one tuple per dimension (built once, read by both checks)."""

    def __init__(self, shards: Sequence[Box]) -> None:
        self.ndim = len(shards[0].shard_offsets) if shards else 0
        offsets = [s.shard_offsets for s in shards]
        self.uniform = len(set(map(len, offsets))) <= 1
        if self.uniform:
            # zip(*rows) transposes in C; every row has ndim entries here, so nothing is cut short.
            self.starts: Sequence[Sequence[int]] = list(zip(*offsets, strict=True)) if self.ndim else []
            self.sizes: Sequence[Sequence[int]] = (
                list(zip(*[s.shard_sizes for s in shards], strict=True)) if self.ndim else []
            )


def find_overlap(shards: Sequence[Box], columns: Optional[_Columns] = None) -> Optional[tuple[int, int]]:
    """The indices ``(i, j)``, ``i < j``, of two overlapping non-empty shards, or None.

    Shards with no elements never overlap anything.

    Raises:
        ValueError: shards differ in their number of dimensions.
    """
    if not shards:
        return None
    if columns is None:
        return _find_overlap_direct(shards)
    cols = columns
    if not cols.uniform:
        _check_dims(shards)
    ndim = cols.ndim
    idx: Sequence[int] = range(len(shards))
    starts_by_dim, sizes_by_dim = cols.starts, cols.sizes
    if any(0 in column for column in sizes_by_dim):
        idx = [i for i, s in enumerate(shards) if 0 not in s.shard_sizes]
        starts_by_dim = [list(map(column.__getitem__, idx)) for column in cols.starts]
        sizes_by_dim = [list(map(column.__getitem__, idx)) for column in cols.sizes]
    if len(idx) < 2:
        return None
    # Only the dims along which shards differ can separate two of them.
    sharded = [
        d
        for d in range(ndim)
        if starts_by_dim[d].count(starts_by_dim[d][0]) != len(idx)
        or sizes_by_dim[d].count(sizes_by_dim[d][0]) != len(idx)
    ]
    pair: Optional[tuple[int, int]]
    if not sharded:
        pair = 0, 1
    elif len(sharded) == 1:
        pair = _one_dim(starts_by_dim[sharded[0]], sizes_by_dim[sharded[0]])
    else:
        pair = _several_dims(starts_by_dim, sizes_by_dim, sharded)
    if pair is None:
        return None
    i, j = sorted((idx[pair[0]], idx[pair[1]]))
    return i, j


def _find_overlap_direct(shards: Sequence[Box]) -> Optional[tuple[int, int]]:
    """:func:`find_overlap` without prebuilt columns: few passes over the shards, each in C where it can be.

    Its fixed cost is below torch 2.13's for a handful of shards, and it
    stays O(n log n) (``benchmarks/validation.py`` measures both).

    Among non-empty shards, a dim along which every shard starts at the same
    offset cannot separate two of them (both contain that offset), whatever
    their sizes there; so only the dims with differing starts are examined.
    Shards cut along one dim are first accepted by a test that empty shards
    cannot fool: no two starts closer than the longest shard.
    """
    n = len(shards)
    if n < 2:
        return None
    offsets = [s.shard_offsets for s in shards]
    lengths = [s.shard_sizes for s in shards]
    try:
        # Transposed in C; strict, so shards with different numbers of dims raise here.
        starts_by_dim = list(zip(*offsets, strict=True))
    except ValueError:
        _check_dims(shards)
        raise
    sharded = [d for d, starts in enumerate(starts_by_dim) if starts.count(starts[0]) != n]
    if len(sharded) == 1:
        d = sharded[0]
        longest = lengths[0][d] if lengths.count(lengths[0]) == n else max(map(itemgetter(d), lengths))
        starts = sorted(starts_by_dim[d])
        if min(map(sub, starts[1:], starts)) >= longest:
            return None
    return _find_overlap_exact(shards, lengths, starts_by_dim, sharded)


def _find_overlap_exact(
    shards: Sequence[Box],
    lengths: Sequence[Sequence[int]],
    starts_by_dim: Sequence[Sequence[int]],
    sharded: list[int],
) -> Optional[tuple[int, int]]:
    """The rest of :func:`_find_overlap_direct`, given the sizes, the starts by dim and the dims where starts differ."""
    if 0 in chain.from_iterable(lengths):
        # Empty shards hold nothing, so they overlap nothing: check the others.
        idx = [i for i, size in enumerate(lengths) if 0 not in size]
        pair = _find_overlap_direct([shards[i] for i in idx])
        return None if pair is None else (idx[pair[0]], idx[pair[1]])
    if not sharded:
        return 0, 1
    if len(sharded) > 1:
        # As find_overlap; a dim where starts agree cannot separate non-empty shards, so it is left out.
        return _ordered(_several_dims(starts_by_dim, list(zip(*lengths, strict=True)), sharded))
    d = sharded[0]
    sizes = list(map(itemgetter(d), lengths))
    # Sorted by start, an overlap shows between neighbours.
    prev_end = -1
    for start, length in sorted(zip(starts_by_dim[d], sizes, strict=True)):
        if start < prev_end:
            return _ordered(_one_dim(starts_by_dim[d], sizes))  # which two: rare, so found again
        prev_end = start + length
    return None


def _ordered(pair: Optional[tuple[int, int]]) -> Optional[tuple[int, int]]:
    """``pair`` with the lower index first."""
    if pair is None or pair[0] < pair[1]:
        return pair
    return pair[1], pair[0]


def validate_non_overlapping(shards: Sequence[Box], columns: Optional[_Columns] = None) -> None:
    """Raise if two non-empty shards overlap; O(n log n) in the number of shards in practice, never quadratic.

    Args:
        shards: The shards.
        columns: Their columns, when the caller already built them.

    Raises:
        ValueError: naming an overlapping pair and their boxes, or two
            shards with different numbers of dimensions.
    """
    if columns is None:
        pair = _find_overlap_direct(shards)
    else:
        pair = find_overlap(shards, columns)
    if pair is not None:
        i, j = pair
        raise ValueError(
            f"Shards overlap: shards {i} ({describe(shards[i])}) and {j} ({describe(shards[j])}) overlap; "
            "every element of the tensor must belong to exactly one shard"
        )


def check_covering(shards: Sequence[Box], tensor_size: Sequence[int], columns: Optional[_Columns] = None) -> None:
    """Raise unless the shards fit in the tensor and (with no overlaps) cover it.

    Call after :func:`validate_non_overlapping`: then covering is the same
    as the shard volumes adding up to the tensor's. An empty shard holds no
    element, so (as for overlaps) where it sits is not checked.

    Args:
        shards: The shards.
        tensor_size: The size of the tensor they should tile.
        columns: Their columns, when the caller already built them.

    Raises:
        ValueError: a shard has the wrong number of dimensions or a
            non-empty one sticks out of the tensor (naming it), or the
            shards leave elements uncovered.
    """
    size = list(tensor_size)
    if columns is None:
        total = _covered(shards, size)
    elif shards:
        cols = columns if columns is not None else _Columns(shards)
        if not cols.uniform or cols.ndim != len(size):
            _raise_outside(shards, size)
        for d in range(cols.ndim):
            if max(map(add, cols.starts[d], cols.sizes[d])) > size[d]:
                # Something sticks out; empty shards may, so look for a non-empty one the slow way.
                _raise_outside(shards, size)
                break
        volumes = cols.sizes[0] if cols.ndim else [1] * len(shards)
        for column in cols.sizes[1:]:
            volumes = list(map(mul, volumes, column))
        total = sum(volumes)
    else:
        total = 0
    expected = math.prod(size)
    if total != expected:
        raise ValueError(
            f"shards do not cover the tensor of size {size}: they hold {total} of its {expected} elements "
            f"(Total volume of shards: {total} does not match tensor volume: {expected}, in other words all "
            f"the individual shards do not cover the entire tensor; shards: {_describe(shards)})"
        )


def _covered(shards: Sequence[Box], size: list[int]) -> int:
    """The elements the shards hold, raising for one of the wrong rank or a non-empty one outside ``size``.

    One pass with no intermediate lists; the common ranks unpack each shard's
    offsets and sizes into locals (a shard of another rank fails to unpack).
    """
    ndim = len(size)
    total = 0
    if ndim == 2:
        lim0, lim1 = size
        for shard in shards:
            try:
                o0, o1 = shard.shard_offsets
                z0, z1 = shard.shard_sizes
            except ValueError:
                _raise_outside(shards, size)
                raise
            volume = z0 * z1
            if volume and (o0 + z0 > lim0 or o1 + z1 > lim1):
                _raise_outside(shards, size)
            total += volume
        return total
    if ndim == 3:
        lim0, lim1, lim2 = size
        for shard in shards:
            try:
                o0, o1, o2 = shard.shard_offsets
                z0, z1, z2 = shard.shard_sizes
            except ValueError:
                _raise_outside(shards, size)
                raise
            volume = z0 * z1 * z2
            if volume and (o0 + z0 > lim0 or o1 + z1 > lim1 or o2 + z2 > lim2):
                _raise_outside(shards, size)
            total += volume
        return total
    if ndim == 1:
        (lim,) = size
        for shard in shards:
            try:
                (o,) = shard.shard_offsets
                (z,) = shard.shard_sizes
            except ValueError:
                _raise_outside(shards, size)
                raise
            if z and o + z > lim:
                _raise_outside(shards, size)
            total += z
        return total
    for shard in shards:
        offsets, lengths = shard.shard_offsets, shard.shard_sizes
        if len(offsets) != ndim:
            _raise_outside(shards, size)
        volume = math.prod(lengths)
        if volume and any(map(gt, map(add, offsets, lengths), size)):
            _raise_outside(shards, size)
        total += volume
    return total


def validate_layout(shards: Sequence[Box], tensor_size: Sequence[int]) -> None:
    """:func:`validate_non_overlapping` then :func:`check_covering`: what shardwise's constructors run.

    Both take their direct paths (no shared columns): measured faster than
    building columns once at every shard count in ``benchmarks/validation.py``.

    Raises:
        ValueError: as those two.
    """
    validate_non_overlapping(shards)
    check_covering(shards, tensor_size)


def _raise_outside(shards: Sequence[Box], size: list[Any]) -> None:
    """Raise for the first shard of the wrong rank or the first non-empty one outside ``size``."""
    for i, shard in enumerate(shards):
        if len(shard.shard_offsets) != len(size):
            raise ValueError(
                f"shard {i} ({describe(shard)}) has {len(shard.shard_offsets)} dimensions, "
                f"the tensor of size {size} has {len(size)} (Rank of tensor is {len(size)}, "
                f"but shards rank is {len(shard.shard_offsets)})"
            )
        if 0 in shard.shard_sizes:
            continue
        for d, (offset, length, limit) in enumerate(zip(shard.shard_offsets, shard.shard_sizes, size, strict=True)):
            if offset + length > limit:
                raise ValueError(
                    f"shard {i} ({describe(shard)}) ends at {offset + length} in dim {d}, "
                    f"outside the tensor of size {size} (Shard offset {offset} and length {length} "
                    f"exceeds tensor dim: {limit})"
                )
