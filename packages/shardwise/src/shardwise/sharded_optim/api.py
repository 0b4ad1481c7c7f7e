"""``ShardedOptimizer``, at torch 2.13's path ``sharded_optim.api``.

A torch-compatible public face over :mod:`shardwise._modules.optim`.
"""

from __future__ import annotations

from shardwise._modules.optim import ShardedOptimizer
from shardwise.sharded_tensor import ShardedTensor

__all__ = ["ShardedOptimizer", "ShardedTensor"]
