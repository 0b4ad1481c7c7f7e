"""Sharding tensors and modules, at torch 2.13's path ``torch.distributed._shard.api``.

A torch-compatible public face over :mod:`shardwise._tensor.scatter`,
:mod:`shardwise._modules.sharding` and :mod:`shardwise._tensor.pickling`, with torch's
public names and the private ones outside code imports (``_shard_tensor``,
``_reshard_output``, ``_collect_local_shard``, ``_get_current_process_group``).
"""

from __future__ import annotations

from typing import Any

from shardwise._comm.group import Group
from shardwise._modules.sharder import Sharder
from shardwise._modules.sharding import (  # noqa: F401 - torch's private hooks, imported by outside code from here
    _collect_local_shard,
    _reshard_output,
    shard_module,
    shard_parameter,
)
from shardwise._tensor.loading import load_with_process_group
from shardwise._tensor.pickling import current_process_group
from shardwise._tensor.scatter import shard_tensor
from shardwise.sharded_tensor import ShardedTensor
from shardwise.sharding_plan import ShardingPlan
from shardwise.sharding_spec import ChunkShardingSpec, ShardingSpec

__all__ = [
    "ChunkShardingSpec",
    "ShardedTensor",
    "Sharder",
    "ShardingPlan",
    "ShardingSpec",
    "load_with_process_group",
    "shard_module",
    "shard_parameter",
]


def _shard_tensor(
    tensor: Any, sharding_spec: ShardingSpec, src_rank: int = 0, process_group: Any = None
) -> ShardedTensor:
    """Shard ``tensor``, held by ``src_rank``, across the group by ``sharding_spec`` (torch 2.13's name).

    The same as :func:`shardwise.shard_tensor`, which documents it in full.

    Args:
        tensor: The whole tensor (read on ``src_rank`` only); contiguous.
        sharding_spec: How to shard it; the same on every rank.
        src_rank: Rank whose ``tensor`` is sharded; the same on every rank.
        process_group: Group, torch ProcessGroup or None (default group).

    Returns:
        The :class:`ShardedTensor`.

    Raises:
        ValueError: ranks disagree on the spec or ``src_rank``, or the
            tensor is not contiguous (see :func:`shardwise.shard_tensor`).
    """
    return shard_tensor(tensor, sharding_spec, src_rank, process_group)


def _get_current_process_group() -> Group:
    """The group set by :func:`load_with_process_group`, else the default group (torch 2.13's name).

    Returns:
        A shardwise :class:`~shardwise.Group`.

    Raises:
        LaunchError: no ``load_with_process_group`` block is open and there
            is no default group.
    """
    return current_process_group()
