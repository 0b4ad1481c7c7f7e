"""The core's sharded-op implementations, grouped by kind.

Each module exposes ``records() -> list[ShardedOp]``; :func:`all_records`
collects them for the ``shardwise._core_ops`` plugin.
"""

from __future__ import annotations

from shardwise._records import ShardedOp


def all_records() -> list[ShardedOp]:
    """Records from every op module of the core."""
    from shardwise.sharded_tensor._ops import _attributes, _compare, _init, _pointwise, _tensor

    records: list[ShardedOp] = []
    for module in (_attributes, _compare, _init, _pointwise, _tensor):
        records.extend(module.records())
    return records
