"""The core's sharded-op implementations, grouped by kind.

Each module exposes ``records() -> list[ShardedOp]``; :func:`all_records`
collects them for the ``shardwise._tensor.core_ops`` plugin.
"""

from __future__ import annotations

from shardwise._registry.records import ShardedOp
from shardwise._tensor.ops import attributes as _attributes
from shardwise._tensor.ops import compare as _compare
from shardwise._tensor.ops import init as _init
from shardwise._tensor.ops import pointwise as _pointwise
from shardwise._tensor.ops import tensor_methods as _tensor


def all_records() -> list[ShardedOp]:
    """Records from every op module of the core."""
    records: list[ShardedOp] = []
    for module in (_attributes, _compare, _init, _pointwise, _tensor):
        records.extend(module.records())
    return records
