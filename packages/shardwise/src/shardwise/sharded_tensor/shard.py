"""``Shard``, at torch 2.13's path ``sharded_tensor.shard``.

A torch-compatible public face over :mod:`shardwise._vocab.shard`.
"""

from __future__ import annotations

from shardwise._vocab.metadata import ShardMetadata
from shardwise._vocab.shard import Shard

__all__ = ["Shard", "ShardMetadata"]
