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
* ``rounds``: in how many rounds this rank needs the data moved so that
  its send and receive buffers stay within its shard size (see below).

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
import gc
import math
import operator
from dataclasses import dataclass, field, replace
from typing import Mapping, Optional, Sequence

from shardwise._vocab.box_index import BoxIndex
from shardwise._vocab.metadata import ShardMetadata, ShardedTensorMetadata

__all__ = [
    "MAX_ROUNDS", "ROW_MAJOR_ROUNDS", "STREAM_ROUNDS", "Piece", "Run", "TransferPlan", "budget", "owners",
    "pairs_fit", "plan", "restrict", "restrict_flat", "row_major_start", "run_span", "slab_plans", "slabs",
    "stream_parts",
]

#: Most rounds moved as slabs of the tensor's row-major order; a larger count cuts every stream instead.
ROW_MAJOR_ROUNDS = 2

#: Fewest rounds of cut streams: from there on, two consecutive parts hold at most about half a shard.
STREAM_ROUNDS = 4

#: Most rounds a plan asks for (``2 * MAX_ROUNDS`` all-to-alls): at that many, two consecutive parts of cut
#: streams hold an eighth of what a rank moves plus at most one element per stream, within its budget
#: unless the rank's streams average under three elements (see the module's note on single elements).
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
        rounds: Fewest rounds (1; up to :data:`ROW_MAJOR_ROUNDS`: slabs of
            row-major order; from :data:`STREAM_ROUNDS` to
            :data:`MAX_ROUNDS`, a power of two: cut streams) in which the
            buffers of any two consecutive parts of the ``2 * rounds`` that
            execution runs (:func:`slab_plans`) hold at most as many
            elements as this rank's larger shard (source or target), as far
            as any cut can (the module's note on single elements); 1 for a
            slab. Ranks may need different counts: the caller agrees on the
            largest, which keeps each rank within its bound too.
        cut: How this plan was cut out of a larger one, for the log:
            ``""`` (it was not), ``"dim-0 slabs"``, ``"row-major slabs"`` or
            ``"cut streams"``. Not compared: a slab equal to its plan is it.
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
    cut: str = field(default="", compare=False)

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
        needs_wire = _others_move(src_index, src, src_rank, dst, dst_rank)
    # A pinned target must be allocated pinned, so the receive buffer cannot become it.
    pl = _decided(
        rank, world, tuple(local), tuple(map(tuple, send)), tuple(map(tuple, recv)), needs_wire,
        tuple(src_rank), tuple(dst_rank), tuple(src_md.size),
        tuple(tuple(s.shard_sizes) for s in src), tuple(tuple(s.shard_sizes) for s in dst),
        may_adopt=not dst_md.tensor_properties.pin_memory,
    )
    rounds = _rounds_within_shard(pl)
    return pl if rounds == 1 else replace(pl, rounds=rounds)


def _others_move(
    src_index: BoxIndex, src: Sequence[ShardMetadata], src_rank: list[int], dst: Sequence[ShardMetadata],
    dst_rank: list[int],
) -> bool:
    """Whether a source and a target shard of different ranks meet, asked by a rank whose own shards meet none.

    Every target against the sources it meets, but a target that lies
    inside the source box its rank's previous target lay in is settled by
    comparing their corners: it meets no source that box does not meet,
    and that box was looked up once (every source it meets is its rank's).
    So where each rank's targets cut its sources finer (a chunk cut in
    several on the same rank, a band cut in tiles), the cost is a few
    comparisons per target and a lookup or two per source box, not a
    lookup per target. Stops at the first pair found.
    """
    clean: dict[int, bool] = {}  # source box -> every source box it meets is on its rank
    last: dict[int, int] = {}  # rank -> the source box its previous target lay in
    for target, rank in zip(dst, dst_rank, strict=True):
        offsets, sizes = target.shard_offsets, target.shard_sizes
        if 0 in sizes:
            continue
        at = last.get(rank)
        if at is not None:
            lo, size = src[at].shard_offsets, src[at].shard_sizes
            if all(map(operator.le, lo, offsets)) and all(
                map(operator.le, map(operator.add, offsets, sizes), map(operator.add, lo, size))
            ):
                if at not in clean:  # looked up at the second target inside it, not for every box
                    clean[at] = all(src_rank[i] == rank for i, _, _ in src_index.query(lo, size))
                if clean[at]:
                    continue
        for i, _, met in src_index.query(offsets, sizes):
            if src_rank[i] != rank:
                return True
            if met == list(sizes):
                last[rank] = i
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
    cut: str = "",
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
        send_view, recv_view, whole, 1, cut,
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
