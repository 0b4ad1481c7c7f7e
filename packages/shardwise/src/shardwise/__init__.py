"""shardwise: shard PyTorch tensors and modules across processes, over any backend.

Importing shardwise does no work: the plugin manager is built on first use,
and backend libraries (mpi4py, CUDA) load only when their backend is chosen.
"""

from __future__ import annotations

from shardwise._group import Group
from shardwise._records import Availability, Backend, LaunchInfo, Launcher, ShardedOp
from shardwise._runtime import (
    DEFAULT_TIMEOUT,
    destroy,
    get_default_group,
    init,
    is_initialized,
    resolve_group,
)
from shardwise.hookspecs import hookimpl

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_TIMEOUT",
    "Availability",
    "Backend",
    "Group",
    "LaunchInfo",
    "Launcher",
    "ShardedOp",
    "destroy",
    "get_default_group",
    "hookimpl",
    "init",
    "is_initialized",
    "resolve_group",
]
