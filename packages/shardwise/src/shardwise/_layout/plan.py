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
  its send and receive buffers stay within its shard size (see
  :mod:`~shardwise._layout.plan_rounds`).

:mod:`shardwise._layout.redistribute` executes plans and reads these fields;
the memory bound (``rounds``) reads the same fields, so what the bound
counts is what execution allocates. Nothing here looks at a tensor: a plan
assumes contiguous shards of the wire dtype, and the executor falls back to
a copy where a tensor is not one. (Not to be confused with the sharding
plans of :mod:`shardwise._modules`, which say how to shard a module's
parameters.)

The records (:class:`~shardwise._layout.plan_records.TransferPlan`,
:class:`~shardwise._layout.plan_records.Piece`,
:class:`~shardwise._layout.plan_records.Run`) and the one place their view
decisions are made live in :mod:`~shardwise._layout.plan_records`; the
rounds decision and the cutting of a plan into the parts of its rounds in
:mod:`~shardwise._layout.plan_rounds`. This module re-exports the names of
those that tests and benchmarks import from it.
"""

from __future__ import annotations

import gc
import math
import operator
from dataclasses import replace
from typing import Mapping, Optional, Sequence

from shardwise._layout.plan_records import Piece, Run, TransferPlan, _decided
from shardwise._layout.plan_rounds import MAX_ROUNDS, _rounds_within_shard, budget, restrict, slab_plans, slabs
from shardwise._vocab.box_index import BoxIndex
from shardwise._vocab.metadata import ShardMetadata, ShardedTensorMetadata

# Run, TransferPlan, MAX_ROUNDS, budget, restrict, slab_plans and slabs live in plan_records and plan_rounds;
# re-exported for the tests and benchmarks that import them from here.
__all__ = ["MAX_ROUNDS", "Run", "TransferPlan", "budget", "owners", "plan", "restrict", "slab_plans", "slabs"]


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
        The :class:`~shardwise._layout.plan_records.TransferPlan`, its decisions made.

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
