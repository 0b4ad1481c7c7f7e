"""shardwise: shard PyTorch tensors and modules across processes, over any backend.

Importing shardwise does no work: the plugin manager is built on first use,
and backend libraries (mpi4py, CUDA) load only when their backend is chosen.
"""

from __future__ import annotations

from shardwise._comm.buffers import empty_cache
from shardwise._comm.group import Group
from shardwise._comm.work import Work
from shardwise._modules.plan import ShardingPlan
from shardwise._modules.sharder import Sharder
from shardwise._modules.sharding import shard_module, shard_parameter
from shardwise._registry.records import Availability, Backend, CliCommand, LaunchInfo, Launcher, ShardedOp
from shardwise._session.runtime import (
    DEFAULT_TIMEOUT,
    destroy,
    get_default_group,
    init,
    is_initialized,
    launch_info,
    resolve_group,
)
from shardwise._tensor.loading import load_with_process_group
from shardwise._tensor.scatter import shard_tensor
from shardwise._tensor.specs import (
    ChunkShardingSpec,
    DevicePlacementSpec,
    EnumerableShardingSpec,
    ShardingSpec,
)
from shardwise._vocab.launch import Host
from shardwise._vocab.version import __version__ as __version__
from shardwise.api import _shard_tensor
from shardwise.hookspecs import hookimpl
from shardwise.sharded_tensor import (
    Shard,
    ShardMetadata,
    ShardedTensor,
    ShardedTensorMetadata,
    TensorProperties,
    from_torch,
    to_torch,
)

__all__ = [
    "_shard_tensor",
    "DEFAULT_TIMEOUT",
    "Availability",
    "Backend",
    "ChunkShardingSpec",
    "CliCommand",
    "DevicePlacementSpec",
    "EnumerableShardingSpec",
    "Group",
    "Host",
    "LaunchInfo",
    "Launcher",
    "Shard",
    "ShardMetadata",
    "ShardedOp",
    "ShardedTensor",
    "ShardedTensorMetadata",
    "Sharder",
    "ShardingPlan",
    "ShardingSpec",
    "TensorProperties",
    "Work",
    "destroy",
    "empty_cache",
    "from_torch",
    "get_default_group",
    "hookimpl",
    "init",
    "is_initialized",
    "launch_info",
    "load_with_process_group",
    "resolve_group",
    "shard_module",
    "shard_parameter",
    "shard_tensor",
    "to_torch",
]
