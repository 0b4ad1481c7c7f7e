"""The tensor layer: ``ShardedTensor``, its specs and verbs, creation, ops and pickling.

Its one piece of wiring: :meth:`ShardingSpec.shard` returns a
``ShardedTensor``, whose module imports the specs (it infers and rebuilds
them), so the specs get the scatter verb bound here, once, when the layer is
first imported, instead of importing it back from inside the method.
"""

from __future__ import annotations

from shardwise._tensor import scatter as _scatter
from shardwise._tensor import specs as _specs

_specs.bind_scatter(_scatter.scatter_tensor)
