"""Planning a layout change from metadata alone: which box each rank copies, sends and receives.

:func:`plan` intersects the source shards with the target shards (boxes of
one tensor, each placed on a rank) and lists, for one rank, the pieces it
copies locally, sends to each peer and receives from each peer, in an
order sender and receiver agree on without talking. :mod:`shardwise._layout.redistribute`
then moves the data.

A plan can also be cut into rounds (:func:`rounds_needed`,
:func:`restrict`): the same pieces clipped to slabs of dim 0, moved one
slab per all-to-all. Why: with more than two ranks a rank's outgoing
pieces are seldom back to back in its shard, nor its incoming ones in
the new shard, so one all-to-all needs a send buffer and a receive buffer
of up to the whole shard each, next to the new shard; cut in slabs, each
round's buffers are a fraction of that, and a reshard stays within twice
the local shard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Mapping, Optional, Sequence

from shardwise._vocab.metadata import ShardMetadata, ShardedTensorMetadata

__all__ = [
    "MAX_ROUNDS", "Piece", "Plan", "owners", "plan", "restrict", "rounds_needed", "row_major_start", "run_span",
    "slabs",
]

#: Most rounds :func:`rounds_needed` asks for (each round is one all-to-all).
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
class Plan:
    """What one rank copies locally, sends and receives in a redistribution.

    ``send[r]`` and ``recv[r]`` list pieces in (target index, source index)
    order, which is the order rank r packs and unpacks them in, so sender
    and receiver agree without exchanging anything. ``send[rank]`` and
    ``recv[rank]`` are empty: those pieces are in ``local``.

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
    """

    rank: int
    world_size: int
    local: tuple[Piece, ...]
    send: tuple[tuple[Piece, ...], ...]
    recv: tuple[tuple[Piece, ...], ...]
    needs_wire: bool
    src_owner: tuple[int, ...] = ()
    dst_owner: tuple[int, ...] = ()

    @property
    def send_counts(self) -> list[int]:
        """Elements sent to each rank."""
        return [sum(p.numel for p in pieces) for pieces in self.send]

    @property
    def recv_counts(self) -> list[int]:
        """Elements received from each rank."""
        return [sum(p.numel for p in pieces) for pieces in self.recv]


def _piece(a: ShardMetadata, i: int, b: ShardMetadata, j: int) -> Optional[Piece]:
    """The box shared by source shard ``a`` (index i) and target shard ``b`` (index j)."""
    offsets, sizes, a_start, b_start = [], [], [], []
    numel = 1
    for ao, asz, bo, bsz in zip(a.shard_offsets, a.shard_sizes, b.shard_offsets, b.shard_sizes, strict=True):
        lo = ao if ao > bo else bo
        hi = min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        offsets.append(lo)
        sizes.append(hi - lo)
        a_start.append(lo - ao)
        b_start.append(lo - bo)
        numel *= hi - lo
    return Piece(i, j, tuple(offsets), tuple(sizes), tuple(a_start), tuple(b_start), numel)


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
) -> Plan:
    """Work out, from metadata only, what ``rank`` copies, sends and receives.

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
        The :class:`Plan`.

    Raises:
        ValueError: the sizes differ, a shard has no placement, no rank or
            the wrong number of dims, or a placement is outside the group.
    """
    if list(src_md.size) != list(dst_md.size):
        raise ValueError(f"source size {list(src_md.size)} and target size {list(dst_md.size)} differ")
    src, dst = src_md.shards_metadata, dst_md.shards_metadata
    ndim = len(src_md.size)
    limit = -1 if world_size is None else world_size
    src_rank, dst_rank = owners(src, ndim, "source", to_group, limit), owners(dst, ndim, "target", to_group, limit)
    highest = max(src_rank + dst_rank, default=0)
    world = highest + 1 if world_size is None else world_size
    src_live = [i for i, s in enumerate(src) if s.numel() > 0]
    src_mine = [i for i in src_live if src_rank[i] == rank]
    local: list[Piece] = []
    send: list[list[Piece]] = [[] for _ in range(world)]
    recv: list[list[Piece]] = [[] for _ in range(world)]
    for j, target in enumerate(dst):
        if target.numel() == 0:
            continue
        to = dst_rank[j]
        # Only intersections with this rank at one end concern it.
        for i in src_live if to == rank else src_mine:
            piece = _piece(src[i], i, target, j)
            if piece is None:
                continue
            frm = src_rank[i]
            if frm == to:
                local.append(piece)
            elif to == rank:
                recv[frm].append(piece)
            else:
                send[to].append(piece)
    needs_wire = any(send) or any(recv)
    if not needs_wire:
        needs_wire = _any_remote(src, src_rank, src_live, dst, dst_rank)
    return Plan(
        rank, world, tuple(local), tuple(map(tuple, send)), tuple(map(tuple, recv)), needs_wire,
        tuple(src_rank), tuple(dst_rank),
    )


def _any_remote(
    src: Sequence[ShardMetadata],
    src_rank: list[int],
    src_live: list[int],
    dst: Sequence[ShardMetadata],
    dst_rank: list[int],
) -> bool:
    """Whether any pair of ranks exchanges data (this rank's own pairs have none)."""
    for j, target in enumerate(dst):
        if target.numel() == 0:
            continue
        for i in src_live:
            if src_rank[i] != dst_rank[j] and _piece(src[i], i, target, j) is not None:
                return True
    return False



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


def restrict(pl: Plan, lo: int, hi: int) -> Plan:
    """``pl`` with every piece clipped to rows ``[lo, hi)`` of dim 0, in the same order.

    ``needs_wire`` is kept from ``pl`` (not recomputed), so every rank runs
    the collective of every round even where its own part is empty.
    """

    def clipped(pieces: Sequence[Piece]) -> tuple[Piece, ...]:
        return tuple(c for c in (_clip(p, lo, hi) for p in pieces) if c is not None)

    return replace(pl, local=clipped(pl.local), send=tuple(map(clipped, pl.send)), recv=tuple(map(clipped, pl.recv)))


def _buffered(pieces: Sequence[Piece], md: ShardedTensorMetadata, at_src: bool) -> int:
    """Elements of ``pieces`` that need a buffer: 0 when they lie back to back in one shard, as sent or received."""
    if not pieces:
        return 0
    index = pieces[0].src if at_src else pieces[0].dst
    if all((p.src if at_src else p.dst) == index for p in pieces):
        if run_span(pieces, md.shards_metadata[index].shard_sizes, at_src) is not None:
            return 0
    return sum(p.numel for p in pieces)


def _own_numel(md: ShardedTensorMetadata, holders: Sequence[int], rank: int) -> int:
    return sum(e.numel() for e, owner in zip(md.shards_metadata, holders, strict=True) if owner == rank)


def rounds_needed(pl: Plan, src_md: ShardedTensorMetadata, dst_md: ShardedTensorMetadata) -> int:
    """How many dim-0 slabs keep this rank's send and receive buffers within its shard size.

    From metadata only, assuming contiguous shards of the wire dtype:
    pieces that lie back to back in one shard need no buffer (they are sent
    from or received into a view of it). The answer is the fewest of 1, 2,
    4, 8 slabs in which every round's buffers hold at most as many elements
    as this rank's larger shard (source or target), so the new shard plus
    the buffers stay within twice that. If none does, one slab per row of
    dim 0, at most :data:`MAX_ROUNDS`. Ranks may need different counts:
    the caller agrees on the largest.

    Args:
        pl: This rank's plan from ``src_md`` to ``dst_md``.
        src_md: The source layout.
        dst_md: The target layout.

    Returns:
        A round count from 1 to :data:`MAX_ROUNDS`.
    """
    rows = src_md.size[0] if len(src_md.size) else 0
    budget = max(_own_numel(src_md, pl.src_owner, pl.rank), _own_numel(dst_md, pl.dst_owner, pl.rank))

    def fits(p: Plan) -> bool:
        sent = _buffered([q for per in p.send for q in per], src_md, True)
        return sent + _buffered([q for per in p.recv for q in per], dst_md, False) <= budget

    if not pl.needs_wire or fits(pl):
        return 1
    for k in range(1, MAX_ROUNDS.bit_length()):
        count = 1 << k
        if count > rows:
            break
        if all(fits(restrict(pl, lo, hi)) for lo, hi in slabs(rows, count)):
            return count
    return max(1, min(MAX_ROUNDS, rows))
