"""The sharded ``F.embedding`` op, at torch 2.13's path ``chunk_sharding_spec_ops.embedding``.

A torch-compatible public face over the ``shardwise-embedding``
distribution's :func:`shardwise_embedding.sharded_embedding`. Importing this
module without that distribution raises ModuleNotFoundError saying to
``pip install shardwise-embedding``.
"""

from __future__ import annotations

from shardwise._tensor.custom_ops import custom_sharding_spec_op
from shardwise.sharded_tensor import ShardedTensor
from shardwise.sharding_spec import ChunkShardingSpec
from shardwise.sharding_spec.chunk_sharding_spec_ops._plugin import load

__all__ = ["ChunkShardingSpec", "ShardedTensor", "custom_sharding_spec_op", "sharded_embedding"]

sharded_embedding = load(__name__).sharded_embedding
