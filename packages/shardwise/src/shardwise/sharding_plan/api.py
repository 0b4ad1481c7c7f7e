"""``ShardingPlan`` and ``ShardingPlanner``, at torch 2.13's path ``sharding_plan.api``.

A torch-compatible public face over :mod:`shardwise._modules.plan`.
"""

from __future__ import annotations

from shardwise._modules.plan import ShardingPlan, ShardingPlanner
from shardwise._modules.sharder import Sharder
from shardwise.sharding_spec import ShardingSpec

__all__ = ["Sharder", "ShardingPlan", "ShardingPlanner", "ShardingSpec"]
