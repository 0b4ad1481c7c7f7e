"""``ShardMetadata``, at torch 2.13's path ``torch.distributed._shard.metadata``.

A torch-compatible public face over :mod:`shardwise._vocab.metadata`.
"""

from __future__ import annotations

from shardwise._vocab.metadata import ShardMetadata

__all__ = ["ShardMetadata"]
