"""Sharding specs: ``ChunkShardingSpec``, ``EnumerableShardingSpec`` and their bases.

Names follow ``torch.distributed._shard.sharding_spec`` (torch 2.13).
"""

from __future__ import annotations

from shardwise._tensor.custom_ops import custom_sharding_spec_op
from shardwise._tensor.specs import (
    ChunkShardingSpec,
    DevicePlacementSpec,
    EnumerableShardingSpec,
    PlacementSpec,
    ShardingSpec,
    chunk_sizes,
    infer_sharding_spec,
    spec_from_dict,
)
from shardwise._vocab.metadata import Placement, ShardMetadata

# Public module paths in reprs, messages and pickles (the classes live in private modules).
for _cls in (ChunkShardingSpec, DevicePlacementSpec, EnumerableShardingSpec, PlacementSpec, ShardingSpec, Placement):
    _cls.__module__ = __name__
del _cls

#: torch 2.13's private name for :func:`infer_sharding_spec`.
_infer_sharding_spec_from_shards_metadata = infer_sharding_spec

__all__ = [
    "ChunkShardingSpec",
    "DevicePlacementSpec",
    "EnumerableShardingSpec",
    "Placement",
    "PlacementSpec",
    "ShardMetadata",
    "ShardingSpec",
    "chunk_sizes",
    "custom_sharding_spec_op",
    "infer_sharding_spec",
    "spec_from_dict",
]
