"""The core's own sharded ops, registered through the ``shardwise_sharded_ops`` hook.

Declared for the ``ShardingSpec`` base class, so they serve every spec; a
plugin that registers the same op for a more specific spec takes over for
that spec.
"""

from __future__ import annotations

from shardwise._registry.records import ShardedOp
from shardwise._tensor.ops import all_records
from shardwise.hookspecs import hookimpl


@hookimpl
def shardwise_sharded_ops() -> list[ShardedOp]:
    """Every op implemented by the core (imported on first lookup, not at import time)."""
    return all_records()
