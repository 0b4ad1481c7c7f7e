"""Resharding a chunk-sharded tensor's local shard, at torch 2.13's path ``sharded_tensor.reshard``.

A torch-compatible public face: torch's helpers for resharding a tensor with
one chunk per rank, with the same names, signatures and results, over
shardwise's records and its autograd-aware collectives
(:mod:`shardwise._comm.autograd`), so they run on any backend. ``pg`` takes a
shardwise ``Group``, a torch ``ProcessGroup`` or None (the default group);
placements name global ranks, as in torch. (``ShardedTensor.reshard``
itself does not need these: it moves any layout to any other in one
exchange.)
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from shardwise import sharding_spec as shard_spec
from shardwise._comm.autograd import all_to_all, all_to_all_single
from shardwise._comm.default_group import resolve_group
from shardwise._vocab.metadata import Placement, ShardMetadata
from shardwise._vocab.shard import Shard
from shardwise.sharding_spec._internals import get_chunked_dim_size, get_split_size

__all__ = [
    "Shard",
    "ShardMetadata",
    "build_reshard_metadata",
    "get_chunked_dim_size",
    "get_idx_from_placements",
    "get_split_size",
    "reshard_local_shard",
    "reshuffle_local_shard",
    "shard_spec",
]


def get_idx_from_placements(placements: Sequence[Any], current_rank: int) -> int:
    """The position in ``placements`` of the first placement on ``current_rank``.

    Args:
        placements: ``rank:R/DEVICE`` strings or :class:`Placement` objects.
        current_rank: A global rank.

    Returns:
        The index of the first placement that names ``current_rank``.

    Raises:
        RuntimeError: no placement names ``current_rank``.
    """
    for idx, placement in enumerate(placements):
        if Placement(placement).rank() == current_rank:
            return idx
    raise RuntimeError(
        f"current_rank not in the placement: rank {current_rank} is not among {[str(Placement(p)) for p in placements]}"
    )


def _dim(spec: Any) -> int:
    """A chunk spec's sharded dim.

    Raises:
        TypeError: ``spec`` is not a chunk spec (has no ``dim`` and ``placements``).
    """
    dim = getattr(spec, "dim", None)
    if not isinstance(dim, int) or not hasattr(spec, "placements"):
        raise TypeError(f"the reshard helpers take ChunkShardingSpecs (a dim and placements), got {spec!r}")
    return dim


def _chunks(st_size: Sequence[int], spec: Any, world_size: int) -> list[tuple[Placement, ShardMetadata]]:
    """Each placement of a chunk spec with the shard it gets when its dim is cut into ``world_size`` chunks."""
    dim = _dim(spec)
    offsets = [0] * len(st_size)
    split_size = get_split_size(st_size[dim], world_size)
    out = []
    for idx, placement in enumerate(spec.placements):
        sizes = list(st_size)
        sizes[dim] = get_chunked_dim_size(st_size[dim], split_size, idx)
        out.append((placement, ShardMetadata(list(offsets), sizes, placement)))
        offsets[dim] += sizes[dim]
    return out


def build_reshard_metadata(
    st_size: torch.Size, sharding_spec: shard_spec.ShardingSpec, world_size: int
) -> tuple[list[ShardMetadata], list[int]]:
    """The shards a chunk spec gives a tensor of ``st_size`` cut into ``world_size`` chunks.

    Args:
        st_size: The tensor's size.
        sharding_spec: A :class:`~shardwise.sharding_spec.ChunkShardingSpec`
            with one placement per rank.
        world_size: The number of ranks (and chunks).

    Returns:
        ``(shards_metadata, ranks)``: the shards indexed by the rank of
        their placement, and the placements' ranks in placement order.

    Raises:
        IndexError: a placement names a rank outside ``0..world_size - 1``
            (as in torch: the shards are indexed by their placements' global
            ranks, so this fits the whole world or a subgroup of ranks
            ``0..world_size - 1``; :func:`reshuffle_local_shard` and
            :func:`reshard_local_shard` index by group rank instead).
    """
    shards: list[Optional[ShardMetadata]] = [None] * world_size
    ranks = []
    for placement, md in _chunks(st_size, sharding_spec, world_size):
        rank = placement.rank()
        if rank is None or not 0 <= rank < world_size:
            raise IndexError(
                f"placement {placement} names no rank of 0..{world_size - 1}; build_reshard_metadata indexes the "
                "shards by rank, so every placement must name one"
            )
        ranks.append(rank)
        shards[rank] = md
    return shards, ranks  # type: ignore[return-value] # torch's type: a rank without a chunk stays None


def _by_group_rank(st_size: Sequence[int], spec: Any, group: Any, what: str) -> tuple[list[ShardMetadata], list[int]]:
    """Like :func:`build_reshard_metadata` over ``group``: shards by group rank, group ranks in placement order.

    Raises:
        ValueError: this rank is outside ``group``, or the spec does not
            place exactly one chunk on each rank of the group (these helpers
            move one chunk per rank).
    """
    if not group.is_member:
        # torch fails here with an IndexError from its own indexing; say what is wrong instead.
        raise ValueError(
            f"{what}: this rank is not a member of the process group (torch's GroupMember.NON_GROUP_MEMBER) "
            "and holds no chunk; only the group's members call it"
        )
    order = [group.group_rank(Placement(p).rank()) for p in spec.placements]
    if sorted(order) != list(range(group.size)):
        raise ValueError(
            f"{what} needs one placement on each rank of the group ({group.size} ranks), but {spec!r} places "
            f"chunks on group ranks {order}; use ShardedTensor.reshard for other layouts"
        )
    shards: list[Optional[ShardMetadata]] = [None] * group.size
    for rank, (_, md) in zip(order, _chunks(st_size, spec, group.size), strict=True):
        shards[rank] = md
    return shards, order  # type: ignore[return-value] # every slot is filled: order is a permutation


def reshuffle_local_shard(
    local_shard: torch.Tensor,
    st_size: torch.Size,
    sharding_spec: shard_spec.ShardingSpec,
    resharding_spec: shard_spec.ShardingSpec,
    pg: Any,
) -> tuple[list[Shard], list[ShardMetadata]]:
    """Move this rank's chunk to the rank that holds it under ``resharding_spec`` (same sharded dim).

    For two chunk specs that cut the same dim and differ only in the order
    of their placements. Each rank sends its whole chunk to its new owner
    and receives its new chunk, in one all-to-all; autograd flows back
    along it. Every rank of the group calls it.

    Args:
        local_shard: This rank's chunk under ``sharding_spec``.
        st_size: The tensor's size.
        sharding_spec: The current chunk spec (one placement per rank).
        resharding_spec: The new chunk spec, on the same dim.
        pg: The group (shardwise ``Group``, torch ``ProcessGroup`` or None).

    Returns:
        ``([Shard(new_chunk, metadata)], shards_metadata)``: this rank's new
        shard, and every rank's shard metadata indexed by group rank.

    Raises:
        ValueError: this rank is outside the group, or a spec does not place
            one chunk on each rank of the group.
        CollectiveMismatchError: ranks passed chunks that do not fit together
            (on every rank).
    """
    group = resolve_group(pg)
    shards, ranks = _by_group_rank(st_size, resharding_spec, group, "reshuffle_local_shard")
    old_order = _by_group_rank(st_size, sharding_spec, group, "reshuffle_local_shard")[1]
    dim = _dim(resharding_spec)
    old_idx, new_idx = old_order.index(group.rank), ranks.index(group.rank)
    # This rank's chunk keeps its position along dim, so it goes to the new spec's rank there;
    # the new chunk comes from the rank that held that position before.
    send_to, recv_from = ranks[old_idx], old_order[new_idx]
    input_split_sizes = [0] * group.size
    input_split_sizes[send_to] = local_shard.size(dim)
    output_split_sizes = [0] * group.size
    output_split_sizes[recv_from] = shards[group.rank].shard_sizes[dim]
    rows = local_shard.transpose(0, dim).contiguous()
    received = rows.new_empty([output_split_sizes[recv_from], *rows.shape[1:]])
    received = all_to_all_single(received, rows, output_split_sizes, input_split_sizes, group)
    local = received.transpose(0, dim).contiguous()
    return [Shard(local, shards[group.rank])], shards


def reshard_local_shard(
    local_tensor: torch.Tensor,
    st_size: torch.Size,
    sharding_spec: shard_spec.ShardingSpec,
    resharding_spec: shard_spec.ShardingSpec,
    pg: Any,
) -> tuple[list[Shard], list[ShardMetadata]]:
    """Re-cut a chunk-sharded tensor along another dim: each rank gets its chunk of ``resharding_spec``.

    Each rank cuts its current chunk along the new dim into the pieces the
    other ranks need and sends them in one all-to-all (autograd flows back
    along it); what arrives is concatenated along the old dim. Nothing is
    gathered in full. Every rank of the group calls it.

    Args:
        local_tensor: This rank's chunk under ``sharding_spec``.
        st_size: The tensor's size.
        sharding_spec: The current chunk spec (one placement per rank).
        resharding_spec: The new chunk spec, on another dim.
        pg: The group (shardwise ``Group``, torch ``ProcessGroup`` or None).

    Returns:
        ``([Shard(new_chunk, metadata)], shards_metadata)``: this rank's new
        shard, and every rank's shard metadata indexed by group rank.

    Raises:
        ValueError: this rank is outside the group, or a spec does not place
            one chunk on each rank of the group.
        CollectiveMismatchError: ranks passed chunks that do not fit together
            (on every rank).
    """
    group = resolve_group(pg)
    shards, _ = _by_group_rank(st_size, resharding_spec, group, "reshard_local_shard")
    old = _chunks(st_size, sharding_spec, group.size)
    old_order = _by_group_rank(st_size, sharding_spec, group, "reshard_local_shard")[1]
    current_dim, reshard_dim = _dim(sharding_spec), _dim(resharding_spec)
    mine = shards[group.rank].shard_sizes[reshard_dim]
    # Pieces travel flat: their shapes differ in other dims than dim 0, which all_to_all requires to agree.
    pieces = [
        local_tensor.narrow(reshard_dim, md.shard_offsets[reshard_dim], md.shard_sizes[reshard_dim]).reshape(-1)
        for md in shards
    ]
    shapes: list[list[int]] = [[] for _ in range(group.size)]
    for rank, (_, md) in zip(old_order, old, strict=True):
        shape = list(st_size)
        shape[current_dim] = md.shard_sizes[current_dim]
        shape[reshard_dim] = mine
        shapes[rank] = shape
    outputs = [local_tensor.new_empty([int(torch.Size(shape).numel())]) for shape in shapes]
    received = all_to_all(outputs, pieces, group)
    # Concatenate along the old dim in the old chunks' order, which is their order along it.
    ordered = [received[rank].view(shapes[rank]) for rank in old_order]
    local = torch.cat(ordered, dim=current_dim)
    return [Shard(local, shards[group.rank])], shards
