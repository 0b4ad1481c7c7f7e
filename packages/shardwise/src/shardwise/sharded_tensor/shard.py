"""``Shard``, at torch 2.13's path ``sharded_tensor.shard``.

A torch-compatible public face over :mod:`shardwise.sharded_tensor._shard`.
"""

from __future__ import annotations

from shardwise._metadata import ShardMetadata
from shardwise.sharded_tensor._shard import Shard

__all__ = ["Shard", "ShardMetadata"]
