"""Chunk arithmetic and shard-layout checks, at torch 2.13's path ``sharding_spec._internals``.

A torch-compatible public face: outside code imports these helpers from
``torch.distributed._shard.sharding_spec._internals``, so they exist here
under the same names and signatures. The layout checks are shardwise's own
(:mod:`shardwise._vocab.metadata`); the chunk arithmetic follows ``torch.chunk``,
as :class:`~shardwise.sharding_spec.ChunkShardingSpec` does.
"""

from __future__ import annotations

from typing import Any, Sequence

from shardwise._vocab.metadata import ShardMetadata, check_covering, validate_non_overlapping

__all__ = [
    "ShardMetadata",
    "check_tensor",
    "get_chunk_sharding_params",
    "get_chunked_dim_size",
    "get_split_size",
    "validate_non_overlapping_shards_metadata",
]


def validate_non_overlapping_shards_metadata(shards: Sequence[ShardMetadata]) -> None:
    """Raise if two shards overlap (torch 2.13's name for this check).

    Shards that hold no element overlap nothing, wherever they sit.

    Args:
        shards: The shards' metadata.

    Raises:
        ValueError: two shards overlap (the message names both), or shards
            differ in their number of dimensions.
    """
    validate_non_overlapping(list(shards))


def check_tensor(shards_metadata: Sequence[ShardMetadata], tensor_dims: Sequence[int]) -> None:
    """Raise unless non-overlapping shards fit in and cover a tensor of size ``tensor_dims``.

    Args:
        shards_metadata: The shards' metadata, already checked not to overlap
            (:func:`validate_non_overlapping_shards_metadata`).
        tensor_dims: The tensor's size.

    Raises:
        ValueError: a shard has another number of dimensions than the
            tensor, sticks out of it, or the shards leave part of it
            uncovered.
    """
    check_covering(list(shards_metadata), list(tensor_dims))


def get_split_size(dim_size: int, chunks: int) -> int:
    """The size of every chunk but the last when ``torch.chunk`` cuts ``dim_size`` into ``chunks``.

    Args:
        dim_size: Size of the dimension being cut.
        chunks: Number of chunks.

    Returns:
        ``ceil(dim_size / chunks)``.

    Raises:
        ZeroDivisionError: ``chunks`` is 0 (as in torch 2.13).
    """
    return (dim_size + chunks - 1) // chunks


def get_chunked_dim_size(dim_size: int, split_size: int, idx: int) -> int:
    """The size of chunk ``idx`` of ``dim_size`` cut into chunks of ``split_size`` (0 past the end).

    Args:
        dim_size: Size of the dimension being cut.
        split_size: Size of each chunk (:func:`get_split_size`).
        idx: Index of the chunk.

    Returns:
        The chunk's size: ``split_size``, less for the last chunk, 0 for
        chunks past the end.
    """
    return max(min(dim_size, split_size * (idx + 1)) - split_size * idx, 0)


def get_chunk_sharding_params(sharding_dim_size: int, world_size: int, spec: Any, rank: int) -> tuple[int, int]:
    """Where ``rank``'s chunk starts along the sharded dim, and its size, under a chunk spec.

    The dimension is cut into ``world_size`` chunks; chunk ``i`` belongs to
    ``spec.placements[i]``.

    Args:
        sharding_dim_size: Size of the sharded dimension.
        world_size: Number of chunks (torch 2.13 passes the group size).
        spec: A :class:`~shardwise.sharding_spec.ChunkShardingSpec` (any
            object with ``placements`` whose items have ``rank()``).
        rank: The (global) rank whose chunk is wanted, as the placements
            name it.

    Returns:
        ``(start_pos, chunk_size)``.

    Raises:
        ValueError: ``rank`` holds no chunk of ``spec`` (torch 2.13 returned
            a start of 0 with the size of the last chunk, or raised
            UnboundLocalError for an empty placement list).
    """
    split_size = get_split_size(sharding_dim_size, world_size)
    start_pos = 0
    for idx, placement in enumerate(spec.placements):
        chunk_size = get_chunked_dim_size(sharding_dim_size, split_size, idx)
        if placement.rank() == rank:
            return start_pos, chunk_size
        start_pos += chunk_size
    ranks = [p.rank() for p in spec.placements]
    raise ValueError(
        f"rank {rank} holds no chunk of {spec!r} (its placements name ranks {ranks}); "
        "ask for a rank that one of the placements names"
    )
