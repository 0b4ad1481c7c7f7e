"""Sharding spec classes, at torch 2.13's path ``sharding_spec.api``.

A torch-compatible public face over :mod:`shardwise._tensor.specs`:
the same names as torch's module, nothing implemented here.
"""

from __future__ import annotations

from typing import Sequence

from shardwise._tensor.custom_ops import custom_sharding_spec_op
from shardwise._tensor.specs import (
    DevicePlacementSpec,
    EnumerableShardingSpec,
    PlacementSpec,
    ShardingSpec,
    infer_sharding_spec,
)
from shardwise._vocab.metadata import ShardMetadata
from shardwise.sharded_tensor import metadata as sharded_tensor_meta
from shardwise.sharding_spec._internals import (
    check_tensor,
    get_chunked_dim_size,
    get_split_size,
    validate_non_overlapping_shards_metadata,
)

__all__ = [
    "DevicePlacementSpec",
    "EnumerableShardingSpec",
    "PlacementSpec",
    "ShardMetadata",
    "ShardingSpec",
    "check_tensor",
    "custom_sharding_spec_op",
    "get_chunked_dim_size",
    "get_split_size",
    "sharded_tensor_meta",
    "validate_non_overlapping_shards_metadata",
]


def _infer_sharding_spec_from_shards_metadata(shards_metadata: Sequence[ShardMetadata]) -> ShardingSpec:
    """The spec that produces ``shards_metadata`` (torch 2.13's private name, kept for outside code).

    Args:
        shards_metadata: The shards.

    Returns:
        A :class:`ChunkShardingSpec` when one produces these shards, else
        an :class:`EnumerableShardingSpec` (see
        :func:`shardwise.sharding_spec.infer_sharding_spec`, which also
        takes the tensor's size).

    Raises:
        TypeError: an entry is not a :class:`ShardMetadata`.
        ValueError: there are no shards, or they overlap.
    """
    return infer_sharding_spec(shards_metadata)
