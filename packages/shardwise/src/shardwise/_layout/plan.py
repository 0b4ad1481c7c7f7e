"""The transfer plan: one rank's part of a layout change, decided from metadata alone.

A layout change moves a tensor's data from one set of shards (boxes of the
tensor, each placed on a rank) to another. :func:`plan` intersects the
source shards with the target shards and returns, for one rank, a
:class:`TransferPlan`: a frozen record of the boxes (:class:`Piece`) it
copies locally, sends to each peer and receives from each peer, in an order
sender and receiver agree on without talking, together with the decisions
about how they move:

* ``send_view``: the outgoing pieces lie back to back in one source shard,
  so they are sent straight from a view of it (no send buffer, no packing
  copy);
* ``recv_view``: the incoming pieces lie back to back in one target shard,
  so they are received straight into a view of it (no receive buffer, no
  unpacking copy); ``recv_whole`` when they fill that shard exactly, so the
  receive buffer itself can become the shard (nothing to allocate for it);
* ``rounds``: how many dim-0 slabs this rank needs so that its send and
  receive buffers stay within its shard size (see below).

:mod:`shardwise._layout.redistribute` executes plans and reads these fields;
the memory bound (``rounds``) reads the same fields, so what the bound
counts is what execution allocates. Nothing here looks at a tensor: a plan
assumes contiguous shards of the wire dtype, and the executor falls back to
a copy where a tensor is not one. (Not to be confused with the sharding
plans of :mod:`shardwise._modules`, which say how to shard a module's
parameters.)

Why rounds: with more than two ranks a rank's outgoing pieces are seldom
back to back in its shard, nor its incoming ones in the new shard, so one
all-to-all needs a send buffer and a receive buffer of up to the whole
shard each, next to the new shard. A plan can be cut into slabs of dim 0
(:func:`slab_plans`, :func:`restrict`), each its own plan moved by its own
all-to-all; each round's buffers are a fraction of the whole, and a
reshard stays within twice the local shard.
"""

from __future__ import annotations

import bisect
import gc
import math
import operator
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Optional, Sequence

from shardwise._vocab.box_index import BoxIndex
from shardwise._vocab.metadata import ShardMetadata, ShardedTensorMetadata

__all__ = [
    "MAX_ROUNDS", "Piece", "Run", "TransferPlan", "owners", "plan", "restrict", "row_major_start",
    "run_span", "slab_plans", "slabs",
]

#: Most rounds a plan asks for (each round is one all-to-all).
MAX_ROUNDS = 8


@dataclass(frozen=True)
class Piece:
    """One box of the tensor that moves from a source shard to a target shard.

    Attributes:
        src: Index of the source shard in the source metadata.
        dst: Index of the target shard in the target metadata.
        offsets: Start of the box in the whole tensor.
        sizes: Size of the box.
        src_start: Start of the box inside the source shard.
        dst_start: Start of the box inside the target shard.
        numel: Number of elements in the box.
    """

    src: int
    dst: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    src_start: tuple[int, ...]
    dst_start: tuple[int, ...]
    numel: int


@dataclass(frozen=True)
class Run:
    """A stretch ``[start, end)`` of one shard's row-major memory that a rank's pieces fill back to back.

    Attributes:
        shard: Index of the shard (source or target, as the field holding
            the run says) in its metadata.
        start: Flat index of the first element.
        end: Flat index one past the last element.
    """

    shard: int
    start: int
    end: int


@dataclass(frozen=True)
class TransferPlan:
    """What one rank copies locally, sends and receives in a layout change, and how.

    ``send[r]`` and ``recv[r]`` list pieces in (target index, source index)
    order, which is the order rank r packs and unpacks them in, so sender
    and receiver agree without exchanging anything. ``send[rank]`` and
    ``recv[rank]`` are empty: those pieces are in ``local``.

    The decision fields are made once, by :func:`plan` (or
    :func:`restrict` for a slab), from the shard shapes; the executor and
    the memory bound both read them and never work them out again.

    Attributes:
        rank: The rank this plan is for.
        world_size: Number of ranks.
        local: Pieces whose source and target are both on ``rank``.
        send: Per destination rank, the pieces ``rank`` sends there.
        recv: Per source rank, the pieces ``rank`` receives from there.
        needs_wire: Whether any rank (not only this one) sends anything;
            the same on every rank, so all skip the collective together.
        src_owner: The group rank holding each source shard.
        dst_owner: The group rank holding each target shard.
        size: Size of the whole tensor.
        src_shapes: Size of each source shard (for cutting into slabs).
        dst_shapes: Size of each target shard.
        send_view: Where every outgoing piece lies, back to back in wire
            order, in one source shard: sent from a view of it, not packed
            (None: packed into a send buffer).
        recv_view: Where every incoming piece goes, back to back in wire
            order, in one target shard: received into a view of it, not
            unpacked (None: received into a buffer and unpacked).
        recv_whole: The target shard that ``recv_view`` covers exactly,
            when the receive buffer may itself become that shard (it is not
            pinned, and the plan is not a slab of a larger one, whose targets
            exist before the first round); else None.
        rounds: Fewest dim-0 slabs (1, 2, 4, 8, else one per row, at most
            :data:`MAX_ROUNDS`) in which every slab's buffers hold at most as
            many elements as this rank's larger shard (source or target);
            1 for a slab. Ranks may need different counts: the caller
            agrees on the largest.
    """

    rank: int
    world_size: int
    local: tuple[Piece, ...]
    send: tuple[tuple[Piece, ...], ...]
    recv: tuple[tuple[Piece, ...], ...]
    needs_wire: bool
    src_owner: tuple[int, ...]
    dst_owner: tuple[int, ...]
    size: tuple[int, ...]
    src_shapes: tuple[tuple[int, ...], ...]
    dst_shapes: tuple[tuple[int, ...], ...]
    send_view: Optional[Run]
    recv_view: Optional[Run]
    recv_whole: Optional[int]
    rounds: int

    @property
    def send_counts(self) -> list[int]:
        """Elements sent to each rank."""
        return [sum(p.numel for p in pieces) for pieces in self.send]

    @property
    def recv_counts(self) -> list[int]:
        """Elements received from each rank."""
        return [sum(p.numel for p in pieces) for pieces in self.recv]

    @property
    def packed_numel(self) -> int:
        """Elements copied into a send buffer (0 when sent from a view)."""
        return 0 if self.send_view is not None else sum(p.numel for per in self.send for p in per)

    @property
    def unpacked_numel(self) -> int:
        """Elements received into a buffer of their own and copied out of it (0 when received into a view)."""
        return 0 if self.recv_view is not None else sum(p.numel for per in self.recv for p in per)

    @property
    def buffer_numel(self) -> int:
        """Elements of the send and receive buffers this plan's all-to-all holds at once, beyond the shards.

        A receive buffer that becomes a whole target shard (``recv_whole``)
        counts as that shard, not as a buffer.
        """
        return self.packed_numel + self.unpacked_numel


def _piece(a: ShardMetadata, i: int, b: ShardMetadata, j: int, offsets: list[int], sizes: list[int]) -> Piece:
    """The piece where source shard ``a`` (index i) meets target shard ``b`` (index j): ``offsets``/``sizes``."""
    return Piece(
        i, j, tuple(offsets), tuple(sizes),
        tuple(map(operator.sub, offsets, a.shard_offsets)), tuple(map(operator.sub, offsets, b.shard_offsets)),
        math.prod(sizes),
    )


def owners(
    shards: Sequence[ShardMetadata], ndim: int, what: str, to_group: Optional[Mapping[int, int]], world: int
) -> list[int]:
    """The group rank holding each shard: its placement's global rank, translated once here.

    Args:
        shards: The shards, each with ``ndim`` dims.
        ndim: Number of dims of the tensor.
        what: ``"source"``/``"target"``, for messages.
        to_group: Group rank by global rank; None when they are the same numbers.
        world: Group size to check ranks against when ``to_group`` is None (-1: no check).

    Raises:
        ValueError: a shard has no placement, a placement without a rank,
            the wrong number of dims, or a rank outside the group.
    """
    ranks = []
    for i, shard in enumerate(shards):
        if shard.placement is None:
            raise ValueError(f"{what} shard {i} ({shard.describe()}) has no placement")
        if len(shard.shard_offsets) != ndim:
            raise ValueError(f"{what} shard {i} ({shard.describe()}) has {len(shard.shard_offsets)} dims, not {ndim}")
        rank = shard.placement.rank()
        if rank is None:
            raise ValueError(
                f"{what} shard {i} ({shard.describe()}) is placed on {shard.placement}, which names no rank; "
                "data can only move to and from shards placed on 'rank:R/DEVICE'"
            )
        if to_group is not None:
            if rank not in to_group:
                members = sorted(to_group, key=to_group.__getitem__)
                raise ValueError(
                    f"{what} shard {i} ({shard.describe()}) is placed on global rank {rank}, outside the group "
                    f"(global ranks {members}): Global rank {rank} does not exist in input process group: {members}"
                )
            rank = to_group[rank]
        elif world >= 0 and rank >= world:
            raise ValueError(f"a shard is placed on rank {rank}, outside a group of {world} rank(s)")
        ranks.append(rank)
    return ranks


def plan(
    src_md: ShardedTensorMetadata,
    dst_md: ShardedTensorMetadata,
    rank: int,
    world_size: Optional[int] = None,
    to_group: Optional[Mapping[int, int]] = None,
) -> TransferPlan:
    """Work out, from metadata only, what ``rank`` copies, sends and receives, and how.

    Both metadata must describe valid layouts (non-overlapping shards that
    cover the tensor) of the same tensor size; empty shards are skipped.
    Placements name global ranks; the plan is in group ranks (``to_group``
    translates, once per shard).

    Args:
        src_md: The layout the data is in.
        dst_md: The layout the data must end up in.
        rank: The group rank to plan for.
        world_size: Number of ranks (default: one more than the highest
            placement rank).
        to_group: Group rank by global rank (``Group.global_to_group()``);
            None when they are the same numbers.

    Returns:
        The :class:`TransferPlan`, its decisions made.

    Raises:
        ValueError: the sizes differ, a shard has no placement, no rank or
            the wrong number of dims, or a placement is outside the group.
    """
    # A plan allocates several small objects per piece and frees none of them through cycles; with the
    # collector on, the allocations of a 4096-rank plan trigger full passes over the whole heap that
    # doubled its time. It is switched off while planning (and back on only if it was on).
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _plan(src_md, dst_md, rank, world_size, to_group)
    finally:
        if collecting:
            gc.enable()


def _plan(
    src_md: ShardedTensorMetadata,
    dst_md: ShardedTensorMetadata,
    rank: int,
    world_size: Optional[int],
    to_group: Optional[Mapping[int, int]],
) -> TransferPlan:
    if list(src_md.size) != list(dst_md.size):
        raise ValueError(f"source size {list(src_md.size)} and target size {list(dst_md.size)} differ")
    src, dst = src_md.shards_metadata, dst_md.shards_metadata
    ndim = len(src_md.size)
    limit = -1 if world_size is None else world_size
    src_rank, dst_rank = owners(src, ndim, "source", to_group, limit), owners(dst, ndim, "target", to_group, limit)
    highest = max(src_rank + dst_rank, default=0)
    world = highest + 1 if world_size is None else world_size
    # Only intersections with this rank at one end concern it: its targets against an index of the sources,
    # its sources against an index of the targets, so a plan costs what this rank's pieces cost.
    met: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
    src_index = BoxIndex([s.shard_offsets for s in src], [s.shard_sizes for s in src])
    for j, to in enumerate(dst_rank):
        if to == rank:
            target = dst[j]
            for i, offsets, sizes in src_index.query(target.shard_offsets, target.shard_sizes):
                met[j, i] = offsets, sizes
    if rank in src_rank:
        dst_index = BoxIndex([s.shard_offsets for s in dst], [s.shard_sizes for s in dst])
        for i, frm in enumerate(src_rank):
            if frm == rank:
                source = src[i]
                for j, offsets, sizes in dst_index.query(source.shard_offsets, source.shard_sizes):
                    met[j, i] = offsets, sizes
    local: list[Piece] = []
    send: list[list[Piece]] = [[] for _ in range(world)]
    recv: list[list[Piece]] = [[] for _ in range(world)]
    # In (target index, source index) order: the order sender and receiver agree on.
    for j, i in sorted(met):
        piece = _piece(src[i], i, dst[j], j, *met[j, i])
        frm, to = src_rank[i], dst_rank[j]
        if frm == to:
            local.append(piece)
        elif to == rank:
            recv[frm].append(piece)
        else:
            send[to].append(piece)
    needs_wire = any(send) or any(recv)
    if not needs_wire:
        needs_wire = _any_remote(src_index, src_rank, dst, dst_rank)
    # A pinned target must be allocated pinned, so the receive buffer cannot become it.
    pl = _decided(
        rank, world, tuple(local), tuple(map(tuple, send)), tuple(map(tuple, recv)), needs_wire,
        tuple(src_rank), tuple(dst_rank), tuple(src_md.size),
        tuple(tuple(s.shard_sizes) for s in src), tuple(tuple(s.shard_sizes) for s in dst),
        may_adopt=not dst_md.tensor_properties.pin_memory,
    )
    rounds = _rounds_within_shard(pl)
    return pl if rounds == 1 else replace(pl, rounds=rounds)


def _any_remote(src_index: BoxIndex, src_rank: list[int], dst: Sequence[ShardMetadata], dst_rank: list[int]) -> bool:
    """Whether any pair of ranks exchanges data (this rank's own pairs have none); stops at the first."""
    for j, target in enumerate(dst):
        to = dst_rank[j]
        for i, _, _ in src_index.query(target.shard_offsets, target.shard_sizes):
            if src_rank[i] != to:
                return True
    return False


# -- the decisions -------------------------------------------------------------


def _decided(
    rank: int,
    world: int,
    local: tuple[Piece, ...],
    send: tuple[tuple[Piece, ...], ...],
    recv: tuple[tuple[Piece, ...], ...],
    needs_wire: bool,
    src_owner: tuple[int, ...],
    dst_owner: tuple[int, ...],
    size: tuple[int, ...],
    src_shapes: tuple[tuple[int, ...], ...],
    dst_shapes: tuple[tuple[int, ...], ...],
    *,
    may_adopt: bool,
) -> TransferPlan:
    """A one-round plan of these pieces with its view decisions made (the one place they are made)."""
    send_view = _run([p for per in send for p in per], src_shapes, True)
    recv_view = _run([p for per in recv for p in per], dst_shapes, False)
    whole = None
    if may_adopt and recv_view is not None and recv_view.start == 0:
        if recv_view.end == math.prod(dst_shapes[recv_view.shard]):
            whole = recv_view.shard
    return TransferPlan(
        rank, world, local, send, recv, needs_wire, src_owner, dst_owner, size, src_shapes, dst_shapes,
        send_view, recv_view, whole, 1,
    )


def _run(pieces: Sequence[Piece], shapes: Sequence[Sequence[int]], at_src: bool) -> Optional[Run]:
    """Where ``pieces`` lie back to back in one shard of ``shapes``, or None (also for no pieces)."""
    if not pieces:
        return None
    index = pieces[0].src if at_src else pieces[0].dst
    if any((p.src if at_src else p.dst) != index for p in pieces):
        return None
    span = run_span(pieces, shapes[index], at_src)
    return None if span is None else Run(index, span[0], span[1])


def row_major_start(offsets: Sequence[int], sizes: Sequence[int], full: Sequence[int]) -> Optional[int]:
    """Flat index where box ``(offsets, sizes)`` starts in a row-major tensor of size ``full``.

    Returns None unless the box is one contiguous run of that tensor's
    memory: leading dims of size 1, then one dim of any extent, then dims
    spanned whole. An empty box starts where its offsets point, so empty
    trailing chunks line up with the end of the tensor.
    """
    start = 0
    for o, n in zip(offsets, full, strict=True):
        start = start * n + o
    if math.prod(sizes) == 0:
        return start
    ndim = len(full)
    # From the last dim backwards, dims spanned whole; then one free dim; then size-1 dims.
    d = ndim - 1
    while d >= 0 and offsets[d] == 0 and sizes[d] == full[d]:
        d -= 1
    d -= 1
    while d >= 0:
        if sizes[d] != 1:
            return None
        d -= 1
    return start


def run_span(pieces: Sequence[Piece], shape: Sequence[int], at_src: bool) -> Optional[tuple[int, int]]:
    """Start and end (flat, row-major) of ``pieces`` if they lie back to back in a tensor of ``shape``.

    Args:
        pieces: The pieces, in wire order, all of one source (``at_src``)
            or one target shard of size ``shape``.
        shape: That shard's size.
        at_src: Read the pieces' positions in their source (else their target).

    Returns:
        ``(first, end)`` flat indices, or None when a piece is not one
        contiguous run or does not start where the previous one ended.
    """
    first = pos = -1
    for p in pieces:
        start = row_major_start(p.src_start if at_src else p.dst_start, p.sizes, shape)
        if start is None or (pos >= 0 and start != pos):
            return None
        if first < 0:
            first = pos = start
        pos += p.numel
    return None if first < 0 else (first, pos)


# -- rounds ------------------------------------------------------------------


def slabs(rows: int, rounds: int) -> list[tuple[int, int]]:
    """``rounds`` row ranges ``[lo, hi)`` that cut ``rows`` rows of dim 0 as evenly as possible."""
    return [(k * rows // rounds, (k + 1) * rows // rounds) for k in range(rounds)]


def _clip(p: Piece, lo: int, hi: int) -> Optional[Piece]:
    """The part of ``p`` within rows ``[lo, hi)`` of the whole tensor (None if none)."""
    top = max(p.offsets[0], lo)
    bottom = min(p.offsets[0] + p.sizes[0], hi)
    if bottom <= top:
        return None
    if top == p.offsets[0] and bottom == p.offsets[0] + p.sizes[0]:
        return p
    shift, rows = top - p.offsets[0], bottom - top

    def moved(start: tuple[int, ...]) -> tuple[int, ...]:
        return (start[0] + shift, *start[1:])

    return Piece(p.src, p.dst, moved(p.offsets), (rows, *p.sizes[1:]), moved(p.src_start), moved(p.dst_start),
                 p.numel // p.sizes[0] * rows)


def restrict(pl: TransferPlan, lo: int, hi: int) -> TransferPlan:
    """The slab of ``pl`` within rows ``[lo, hi)`` of dim 0: its pieces clipped, in the same order, decided anew.

    A slab is one round (``rounds`` 1) and never adopts its receive buffer
    as a target (``recv_whole`` None): the targets of a plan moved in
    slabs exist before the first round. ``needs_wire`` is kept from ``pl``
    (not recomputed), so every rank runs the collective of every round even
    where its own part is empty.
    """

    def clipped(pieces: Sequence[Piece]) -> tuple[Piece, ...]:
        # Inlined bounds first: the rounds decision restricts every piece of a 4096-rank plan up to 3 times,
        # and most pieces lie wholly inside or outside a slab.
        kept: list[Piece] = []
        for p in pieces:
            top = p.offsets[0]
            bottom = top + p.sizes[0]
            if lo <= top and bottom <= hi:
                kept.append(p)
            elif bottom > lo and top < hi and (part := _clip(p, lo, hi)) is not None:
                kept.append(part)
        return tuple(kept)

    return _decided(
        pl.rank, pl.world_size, clipped(pl.local), tuple(map(clipped, pl.send)), tuple(map(clipped, pl.recv)),
        pl.needs_wire, pl.src_owner, pl.dst_owner, pl.size, pl.src_shapes, pl.dst_shapes, may_adopt=False,
    )


def slab_plans(pl: TransferPlan, rounds: int) -> tuple[TransferPlan, ...]:
    """The plans of the rounds that move ``pl`` in ``rounds`` dim-0 slabs, one all-to-all each.

    ``(pl,)`` itself when ``rounds`` is 1 or dim 0 has at most one row
    (nothing to cut); otherwise ``min(rounds, rows)`` slabs
    (:func:`restrict`). Every rank must pass the same ``rounds``.
    """
    rows = pl.size[0] if pl.size else 0
    if rounds <= 1 or rows <= 1:
        return (pl,)
    return tuple(restrict(pl, lo, hi) for lo, hi in slabs(rows, min(rounds, rows)))


def _own_numel(shapes: Sequence[Sequence[int]], holders: Sequence[int], rank: int) -> int:
    return sum(math.prod(shape) for shape, owner in zip(shapes, holders, strict=True) if owner == rank)


def _rounds_within_shard(pl: TransferPlan) -> int:
    """The ``rounds`` decision for the one-round plan ``pl``, from its slabs' ``buffer_numel``.

    The budget is this rank's larger shard (source or target), so the new
    shard plus one round's buffers stay within twice that.
    """
    need = pl.buffer_numel
    if not pl.needs_wire or need == 0:
        return 1
    budget = max(_own_numel(pl.src_shapes, pl.src_owner, pl.rank), _own_numel(pl.dst_shapes, pl.dst_owner, pl.rank))
    if need <= budget:
        return 1
    rows = pl.size[0] if pl.size else 0
    # A slab's buffers hold at most its pieces sent and received (less where a view replaces one), counted
    # from row prefix sums; only a slab past the budget by that count is built to see its views.
    moved = _row_prefix([p for per in pl.send for p in per] + [p for per in pl.recv for p in per])
    for k in range(1, MAX_ROUNDS.bit_length()):
        count = 1 << k
        if count > rows:
            break
        if all(
            moved(hi) - moved(lo) <= budget or restrict(pl, lo, hi).buffer_numel <= budget
            for lo, hi in slabs(rows, min(count, rows))
        ):
            return count
    return max(1, min(MAX_ROUNDS, rows))


def _row_prefix(pieces: Sequence[Piece]) -> Callable[[int], int]:
    """``f(x)``: elements of ``pieces`` in dim-0 rows below ``x``, in O(log n) a call after an O(n log n) sort."""
    slope_at: dict[int, int] = {}
    for p in pieces:
        per_row = p.numel // p.sizes[0]
        slope_at[p.offsets[0]] = slope_at.get(p.offsets[0], 0) + per_row
        end = p.offsets[0] + p.sizes[0]
        slope_at[end] = slope_at.get(end, 0) - per_row
    points = sorted(slope_at)
    values, slopes, value, slope, last = [], [], 0, 0, 0
    for x in points:
        value += slope * (x - last)
        slope += slope_at[x]
        values.append(value)
        slopes.append(slope)
        last = x

    def below(x: int) -> int:
        k = bisect.bisect_right(points, x) - 1
        return 0 if k < 0 else values[k] + slopes[k] * (x - points[k])

    return below
