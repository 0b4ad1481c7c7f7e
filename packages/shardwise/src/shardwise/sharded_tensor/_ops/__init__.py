"""The core's sharded-op implementations, grouped by kind.

Each module exposes ``records() -> list[ShardedOp]``; :func:`all_records`
collects them for the ``shardwise._core_ops`` plugin.
"""

from __future__ import annotations

from shardwise._records import ShardedOp


def all_records() -> list[ShardedOp]:
    """Records from every op module of the core."""
    from shardwise.sharded_tensor._ops import _attributes

    records: list[ShardedOp] = []
    for module in (_attributes,):
        records.extend(module.records())
    return records
