"""Sharding plans: which parameters and submodules of a module to shard, and how.

Names follow ``torch.distributed._shard.sharding_plan`` (torch 2.13).
"""

from __future__ import annotations

from shardwise._modules.plan import ShardingPlan, ShardingPlanner

__all__ = ["ShardingPlan", "ShardingPlanner"]
