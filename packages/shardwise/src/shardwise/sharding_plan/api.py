"""``ShardingPlan`` and ``ShardingPlanner``, at torch 2.13's path ``sharding_plan.api``.

A torch-compatible public face over :mod:`shardwise.sharding_plan._api`.
"""

from __future__ import annotations

from shardwise.sharder import Sharder
from shardwise.sharding_plan._api import ShardingPlan, ShardingPlanner
from shardwise.sharding_spec import ShardingSpec

__all__ = ["Sharder", "ShardingPlan", "ShardingPlanner", "ShardingSpec"]
