"""Cutting a transfer plan into rounds: how many a rank asks for, and the parts each round moves.

A :class:`~shardwise._layout.plan_records.TransferPlan` made by
:func:`~shardwise._layout.plan.plan` says in its ``rounds`` field how many
rounds its rank needs (:func:`_rounds_within_shard` decides it); the
executor (:mod:`~shardwise._layout.redistribute`) cuts the plan into the
parts of those rounds (:func:`slab_plans`). Kept apart from the planning,
which only asks this module for the count, and from the records
(:mod:`~shardwise._layout.plan_records`), which every part is made of.

Why rounds: with more than two ranks a rank's outgoing pieces are seldom
back to back in its shard, nor its incoming ones in the new shard, so one
all-to-all needs a send buffer and a receive buffer of up to the whole
shard each, next to the new shard. A plan can be cut into parts
(:func:`slab_plans`), each its own plan moved by its own all-to-all; the
executor runs twice ``rounds`` parts, packing one while the one before it
travels, so the buffers of two consecutive parts are alive at once, and
the rounds decision keeps every such pair within the rank's shard: a
reshard stays within twice the local shard. Every rank must cut the same
way, and all that the ranks agree on is the largest count any of them
asks for, so the count also says how the plan is cut:

* up to :data:`ROW_MAJOR_ROUNDS`: slabs of the whole tensor's row-major
  order (:func:`restrict_flat`): dim-0 slabs where they fall on whole
  rows, and cuts inside the rows where dim 0 has too few (a ``[1, n]``
  tensor is cut along its columns). A range of the tensor's row-major
  order meets every shard in a range of the shard's own, so these slabs
  keep every view the whole plan has. They cannot split data that lies
  in a thin band of that order (a rank's few rows of a tall tensor);
* from :data:`STREAM_ROUNDS` to :data:`MAX_ROUNDS`: each stream (what one
  rank sends another, its pieces in wire order) cut into equal parts, the
  part k of every stream moving in round k (:func:`stream_parts`). Sender
  and receiver both know the stream, so they cut it alike without
  talking, and every rank's data is split evenly wherever it lies. Parts
  of several streams are seldom back to back, so views are mostly lost;
  the bound counts each part as packed and unpacked. At
  ``STREAM_ROUNDS`` rounds two parts hold a quarter of what a rank moves,
  at most half its shard, and at most one element more per stream: a rank
  that fits in fewer rounds fits there too, give or take those elements.

A rank asks for the fewest rounds that keep it within the bound
(:func:`_rounds_within_shard`); every larger count, up to
:data:`MAX_ROUNDS`, does too (more rounds only cut finer, and slabs of
row-major order keep the views they counted on), but for the rounding below.
What no cut splits is an element. At ``MAX_ROUNDS`` rounds two consecutive
parts of a stream hold an eighth of it and at most one element more, so two
parts of all of a rank's streams hold at most a quarter of its shard plus
one element per stream: within the budget unless the rank exchanges with
more peers than three quarters of its shard's elements (streams of two or
three elements: a tiny shard among many ranks). Such a rank, and one whose
streams are that short and that a peer's need moves in cut streams, may
exceed the bound by less than one element per peer; more rounds would hardly
help, since a stream cut finer than its length still leaves an element in
its last part.
"""

from __future__ import annotations

import bisect
import math
import operator
from typing import Optional, Sequence

from shardwise._layout.plan_records import Piece, TransferPlan, _decided

__all__ = [
    "MAX_ROUNDS", "ROW_MAJOR_ROUNDS", "STREAM_ROUNDS", "budget", "pairs_fit", "restrict", "restrict_flat",
    "slab_plans", "slabs", "stream_parts",
]

#: Most rounds moved as slabs of the tensor's row-major order; a larger count cuts every stream instead.
ROW_MAJOR_ROUNDS = 2

#: Fewest rounds of cut streams: from there on, two consecutive parts hold at most about half a shard.
STREAM_ROUNDS = 4

#: Most rounds a plan asks for (``2 * MAX_ROUNDS`` all-to-alls): at that many, two consecutive parts of cut
#: streams hold an eighth of what a rank moves plus at most one element per stream, within its budget
#: unless the rank's streams average under three elements (see the module's note on single elements).
MAX_ROUNDS = 8


def slabs(rows: int, rounds: int) -> list[tuple[int, int]]:
    """``rounds`` ranges ``[lo, hi)`` that cut ``rows`` (rows of dim 0, or elements) as evenly as possible."""
    return [(k * rows // rounds, (k + 1) * rows // rounds) for k in range(rounds)]


def _strides(size: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides (in elements) of a contiguous tensor of ``size``."""
    out, step = [], 1
    for n in reversed(size):
        out.append(step)
        step *= n
    return tuple(reversed(out))


def _span(p: Piece, strides: Sequence[int]) -> tuple[int, int]:
    """Row-major indices, in the whole tensor, of ``p``'s first and last elements."""
    first = last = 0
    for o, n, stride in zip(p.offsets, p.sizes, strides, strict=True):
        first += o * stride
        last += (o + n - 1) * stride
    return first, last


def _below(p: Piece, strides: Sequence[int], x: int) -> int:
    """How many of ``p``'s elements come before index ``x`` of the whole tensor's row-major order."""
    if not p.sizes:
        return 1 if x > 0 else 0
    count, inner = 0, p.numel
    for o, n, stride in zip(p.offsets, p.sizes, strides, strict=True):
        inner //= n
        at, x = divmod(x, stride)
        if at < o:
            return count
        if at >= o + n:
            return count + n * inner
        count += (at - o) * inner
    return count


def _row_major_boxes(sizes: Sequence[int], a: int, b: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Boxes ``(offsets, sizes)`` within a box of ``sizes`` that hold its elements ``[a, b)`` in row-major order.

    In that order: a partial row, whole rows, a partial row (each partial
    row cut the same way one dim down), so at most ``2 * ndim - 1`` boxes.
    """
    if a >= b:
        return []
    if len(sizes) <= 1:
        return [((a,), (b - a,))] if sizes else [((), ())]
    rest = tuple(sizes[1:])
    inner = math.prod(rest)
    if a == 0 and b == inner * sizes[0]:
        return [((0,) * len(sizes), tuple(sizes))]
    (top, a_in), (bottom, b_in) = divmod(a, inner), divmod(b, inner)
    if top == bottom:
        return [((top, *o), (1, *n)) for o, n in _row_major_boxes(rest, a_in, b_in)]
    out = []
    if a_in:
        out += [((top, *o), (1, *n)) for o, n in _row_major_boxes(rest, a_in, inner)]
        top += 1
    if bottom > top:
        out.append(((top,) + (0,) * len(rest), (bottom - top, *rest)))
    if b_in:
        out += [((bottom, *o), (1, *n)) for o, n in _row_major_boxes(rest, 0, b_in)]
    return out


def _part(p: Piece, a: int, b: int) -> list[Piece]:
    """Elements ``[a, b)`` of ``p`` (in its own row-major order) as pieces, in that order: ``[p]`` for all of it."""
    if a == 0 and b == p.numel:
        return [p]
    out = []
    for at, sizes in _row_major_boxes(p.sizes, a, b):
        shifted = (tuple(map(operator.add, start, at)) for start in (p.offsets, p.src_start, p.dst_start))
        out.append(Piece(p.src, p.dst, next(shifted), sizes, next(shifted), next(shifted), math.prod(sizes)))
    return out


def restrict_flat(pl: TransferPlan, lo: int, hi: int, cut: str = "row-major slabs") -> TransferPlan:
    """The slab of ``pl`` within elements ``[lo, hi)`` of the whole tensor's row-major order, decided anew.

    Each piece keeps its elements in that range: itself, one box, or a few
    where the range starts or ends inside one of its rows; the pieces keep
    their order. A range of the tensor's row-major order meets every shard
    in a range of the shard's own, so pieces back to back in a shard stay
    so: a slab keeps every view of ``pl``. A slab is one round (``rounds``
    1) and never adopts its receive buffer as a target (``recv_whole``
    None): the targets of a plan moved in slabs exist before the first
    round. ``needs_wire`` is kept from ``pl`` (not recomputed), so every
    rank runs the collective of every round even where its own part is
    empty. ``cut`` labels the slab for the log.
    """
    strides = _strides(pl.size)

    def clipped(pieces: Sequence[Piece]) -> tuple[Piece, ...]:
        kept: list[Piece] = []
        for p in pieces:
            first, last = _span(p, strides)
            if lo <= first and last < hi:
                kept.append(p)
            elif last >= lo and first < hi:
                kept.extend(_part(p, _below(p, strides, lo), _below(p, strides, hi)))
        return tuple(kept)

    return _decided(
        pl.rank, pl.world_size, clipped(pl.local), tuple(map(clipped, pl.send)), tuple(map(clipped, pl.recv)),
        pl.needs_wire, pl.src_owner, pl.dst_owner, pl.size, pl.src_shapes, pl.dst_shapes, may_adopt=False, cut=cut,
    )


def restrict(pl: TransferPlan, lo: int, hi: int) -> TransferPlan:
    """The slab of ``pl`` within rows ``[lo, hi)`` of dim 0 (:func:`restrict_flat` of those rows' elements)."""
    inner = math.prod(pl.size[1:]) if pl.size else 1
    return restrict_flat(pl, lo * inner, hi * inner, "dim-0 slabs")


def _row_major_bounds(size: Sequence[int], parts: int) -> tuple[list[int], int]:
    """Where ``parts`` slabs of row-major order start (and the end), and the dim they cut.

    The slabs cut at whole indices of the outermost dim ``d`` such that
    dims 0 to ``d`` together have at least ``parts`` indices: dim 0 when it
    has that many rows (each slab whole rows), else further in (a ``[1, n]``
    tensor along its columns, a ``[2, n]`` one inside its rows), so that no
    slab is empty where the tensor has enough elements.
    """
    units, dim = 1, len(size) - 1
    for d, n in enumerate(size):
        units *= n
        if units >= parts:
            dim = d
            break
    grain = math.prod(size[dim + 1 :]) if units else 1
    return [k * units // parts * grain for k in range(parts + 1)], max(dim, 0)


def _row_major_slabs(pl: TransferPlan, parts: int) -> tuple[TransferPlan, ...]:
    """``pl`` cut into ``parts`` slabs of the tensor's row-major order (:func:`_row_major_bounds`)."""
    bounds, dim = _row_major_bounds(pl.size, parts)
    cut = "dim-0 slabs" if dim == 0 else "row-major slabs"
    return tuple(restrict_flat(pl, lo, hi, cut) for lo, hi in zip(bounds, bounds[1:], strict=False))


def _cut_stream(pieces: Sequence[Piece], parts: int) -> list[tuple[Piece, ...]]:
    """A stream (pieces in wire order) cut into ``parts`` ranges of its elements, ``k * n // parts`` on."""
    total = sum(p.numel for p in pieces)
    out = []
    first, start = 0, 0  # the first piece that ends past this part's start, and where it starts in the stream
    for k in range(parts):
        lo, hi = k * total // parts, (k + 1) * total // parts
        while first < len(pieces) and start + pieces[first].numel <= lo:
            start += pieces[first].numel
            first += 1
        got: list[Piece] = []
        j, at = first, start
        while j < len(pieces) and at < hi:
            p = pieces[j]
            got += _part(p, max(lo - at, 0), min(hi - at, p.numel))
            at += p.numel
            j += 1
        out.append(tuple(got))
    return out


def stream_parts(pl: TransferPlan, parts: int) -> tuple[TransferPlan, ...]:
    """``pl`` in ``parts`` rounds, every stream cut into ``parts`` equal ranges, decided anew.

    Round k sends each peer elements ``[k * n // parts, (k + 1) * n // parts)``
    of the ``n`` that ``pl`` sends it, counted piece after piece in wire
    order, each piece in its own row-major order, and receives from each
    peer the same range of what it receives from it, which is how that
    peer cuts the same stream. The local pieces are copied in the last
    round (while the one before travels). Every round is a slab: one round,
    never adopting its receive buffer, ``needs_wire`` kept from ``pl``.
    """
    world = pl.world_size
    empty: tuple[Piece, ...] = ()
    send = [[empty] * world for _ in range(parts)]
    recv = [[empty] * world for _ in range(parts)]
    for by_round, per_peer in ((send, pl.send), (recv, pl.recv)):
        for peer, pieces in enumerate(per_peer):
            if pieces:
                for k, cut in enumerate(_cut_stream(pieces, parts)):
                    by_round[k][peer] = cut
    return tuple(
        _decided(
            pl.rank, world, pl.local if k == parts - 1 else empty, tuple(send[k]), tuple(recv[k]), pl.needs_wire,
            pl.src_owner, pl.dst_owner, pl.size, pl.src_shapes, pl.dst_shapes, may_adopt=False, cut="cut streams",
        )
        for k in range(parts)
    )


def slab_plans(pl: TransferPlan, rounds: int, parts: Optional[int] = None) -> tuple[TransferPlan, ...]:
    """The plans of the parts that move ``pl`` at the round count ``rounds``, one all-to-all each.

    ``(pl,)`` itself when ``rounds`` is 1 (or less); otherwise ``parts``
    (default ``rounds``) parts of the kind ``rounds`` calls for: slabs of
    the tensor's row-major order up to :data:`ROW_MAJOR_ROUNDS`
    (:func:`restrict_flat`), cut streams above (:func:`stream_parts`).
    Execution runs ``2 * rounds`` of them
    (:func:`~shardwise._layout.redistribute.executed_slabs`). Every rank
    must pass the same ``rounds`` and ``parts``.
    """
    if rounds <= 1:
        return (pl,)
    count = rounds if parts is None else parts
    return stream_parts(pl, count) if rounds > ROW_MAJOR_ROUNDS else _row_major_slabs(pl, count)


def _own_numel(shapes: Sequence[Sequence[int]], holders: Sequence[int], rank: int) -> int:
    return sum(math.prod(shape) for shape, owner in zip(shapes, holders, strict=True) if owner == rank)


def budget(pl: TransferPlan) -> int:
    """Elements this rank's buffers may hold at once: as many as its larger shard (source or target)."""
    return max(_own_numel(pl.src_shapes, pl.src_owner, pl.rank), _own_numel(pl.dst_shapes, pl.dst_owner, pl.rank))


def pairs_fit(pl: TransferPlan, parts: Sequence[TransferPlan]) -> bool:
    """Whether the buffers of every two consecutive ``parts`` of ``pl`` fit its :func:`budget` together.

    The executor packs a part while the one before it travels only where
    they do (else it moves them one at a time).
    """
    limit = budget(pl)
    return all(a.buffer_numel + b.buffer_numel <= limit for a, b in zip(parts, parts[1:], strict=False))


def _rounds_within_shard(pl: TransferPlan) -> int:
    """The ``rounds`` decision for the one-round plan ``pl`` (see :attr:`TransferPlan.rounds`).

    The budget is this rank's larger shard (source or target), so the new
    shard plus two parts' buffers stay within twice that. One round when
    the whole plan's buffers fit (every slab of row-major order is a range
    of it, keeping its views, so slabs fit too); else
    :data:`ROW_MAJOR_ROUNDS` when slabs of row-major order fit; else the
    fewest rounds of cut streams that fit (:func:`_stream_rounds`).
    """
    if not pl.needs_wire:
        return 1
    lengths = [n for n in pl.send_counts if n] + [n for n in pl.recv_counts if n]
    limit = budget(pl)
    if not lengths or pl.buffer_numel <= limit:
        return 1
    # The fewest counts of slabs from which every larger one fits, the largest checked first.
    fits_from = 0
    rounds = ROW_MAJOR_ROUNDS
    while rounds >= 2 and _row_major_fits(pl, 2 * rounds, limit):
        fits_from = rounds
        rounds //= 2
    return fits_from or _stream_rounds(lengths, limit)


def _row_major_fits(pl: TransferPlan, parts: int, limit: int) -> bool:
    """Whether every two consecutive of ``parts`` slabs of row-major order hold at most ``limit`` in buffers.

    A slab's buffers hold at most its pieces sent and received (less where
    a view replaces one), counted without cutting anything; only slabs of
    a pair past the limit by that count are built to see their views.
    """
    bounds, _ = _row_major_bounds(pl.size, parts)
    strides = _strides(pl.size)
    moved = [0] * parts
    for per_peer in (pl.send, pl.recv):
        for pieces in per_peer:
            for p in pieces:
                first, last = _span(p, strides)
                # Clamped: a plan is also made (and its rounds decided) between layouts with a box outside the tensor.
                k = min(bisect.bisect_right(bounds, first) - 1, parts - 1)
                end = max(min(bisect.bisect_right(bounds, last) - 1, parts - 1), k)
                done = 0
                while k < end:
                    below = _below(p, strides, bounds[k + 1])
                    moved[k] += below - done
                    done, k = below, k + 1
                moved[end] += p.numel - done
    built: dict[int, int] = {}

    def buffers(k: int) -> int:
        if k not in built:
            built[k] = restrict_flat(pl, bounds[k], bounds[k + 1]).buffer_numel
        return built[k]

    return all(
        moved[k] + moved[k + 1] <= limit or buffers(k) + buffers(k + 1) <= limit for k in range(parts - 1)
    )


def _stream_rounds(lengths: Sequence[int], limit: int) -> int:
    """Fewest rounds from :data:`STREAM_ROUNDS` (a power of two) in which cut streams of ``lengths`` fit ``limit``.

    Counted as if every part were packed and unpacked (no views): two
    consecutive of ``2 * rounds`` parts of a stream of ``n`` hold at most
    ``ceil(n / rounds)`` elements, and no more at twice the rounds (the
    cuts of a count lie on those of twice it), so every larger count fits
    too. :data:`MAX_ROUNDS` when none fits: the module's note on single
    elements says by how little such a rank can exceed its budget there.
    """
    total, count = sum(lengths), len(lengths)
    by_length: dict[int, int] = {}
    for n in lengths:
        by_length[n] = by_length.get(n, 0) + 1
    rounds = STREAM_ROUNDS
    while rounds < MAX_ROUNDS:
        parts = 2 * rounds
        if 2 * total + count * parts <= limit * parts:
            return rounds  # within the limit even with one more element of every stream in each part
        worst = max(
            sum(times * ((k + 2) * n // parts - k * n // parts) for n, times in by_length.items())
            for k in range(parts - 1)
        )
        if worst <= limit:
            return rounds
        rounds *= 2
    return MAX_ROUNDS
