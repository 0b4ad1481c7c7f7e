"""shardwise sharded embeddings: the ops ``embedding`` and ``embedding_bag``, and embedding collections.

**Collections** (TorchRec's names): :class:`KeyedJaggedTensor` input,
:class:`EmbeddingBagConfig` tables, the dense :class:`EmbeddingBagCollection`,
an :class:`EmbeddingShardingPlan` (from :class:`EmbeddingShardingPlanner`, or
by hand), and :func:`shard_collection`, which shards a collection by a plan
over a group: one input and one output exchange per step for all tables.
Row-sparse optimizers (:class:`RowSparseSGD`, :class:`RowSparseAdagrad`,
:class:`RowWiseAdagrad`, :class:`RowSparseAdam`) update only the rows a
batch touched, and checkpoint their state laid out like the tables.

**Ops** on chunk-sharded weights:

Importing this package registers nothing: the ops reach shardwise through the
``shardwise_sharded_ops`` hook of :mod:`shardwise_embedding.plugin`, which
shardwise loads through its entry point the first time an op is looked up.

:func:`sharded_embedding` and :func:`sharded_embedding_bag` are those ops'
implementations, callable directly with torch 2.13's op-implementation
signature ``(types, args, kwargs, pg)``; shardwise's torch-compatible
modules ``shardwise.sharding_spec.chunk_sharding_spec_ops.embedding`` and
``.embedding_bag`` re-export them.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from shardwise_embedding import _ops
from shardwise_embedding._blocks import LocalBlock
from shardwise_embedding._collection import ShardedEmbeddingBagCollection, shard_collection
from shardwise_embedding._jagged import JaggedTensor, KeyedJaggedTensor
from shardwise_embedding._keyed_tensor import KeyedTensor
from shardwise_embedding._pipeline import SparseDistPipeline
from shardwise_embedding._plan_data import (
    SHARDING_TYPES,
    Block,
    EmbeddingShardingPlan,
    PlanError,
    RankLoad,
    TablePlan,
    make_blocks,
)
from shardwise_embedding._planner import EmbeddingShardingPlanner, ParameterConstraints
from shardwise_embedding._sparse_optim import RowSparseAdagrad, RowSparseAdam, RowSparseSGD, RowWiseAdagrad
from shardwise_embedding._tables import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType

__version__ = "0.1.0"
__all__ = [
    "SHARDING_TYPES",
    "Block",
    "EmbeddingBagCollection",
    "EmbeddingBagConfig",
    "EmbeddingShardingPlan",
    "EmbeddingShardingPlanner",
    "JaggedTensor",
    "KeyedJaggedTensor",
    "KeyedTensor",
    "LocalBlock",
    "ParameterConstraints",
    "PlanError",
    "PoolingType",
    "RankLoad",
    "RowSparseAdagrad",
    "RowSparseAdam",
    "RowSparseSGD",
    "RowWiseAdagrad",
    "ShardedEmbeddingBagCollection",
    "SparseDistPipeline",
    "TablePlan",
    "__version__",
    "make_blocks",
    "shard_collection",
    "sharded_embedding",
    "sharded_embedding_bag",
]


def sharded_embedding(types: Any, args: Any, kwargs: Optional[dict[str, Any]], pg: Any) -> torch.Tensor:
    """``F.embedding`` on a chunk-sharded weight: what ``F.embedding(input, sharded_weight, ...)`` runs.

    Every rank of the weight's group calls it, each with its own ``input``;
    each gets the embeddings of its own ids (and, in backward, the
    gradients of its own rows or columns of the weight).

    Args:
        types: The ``__torch_function__`` types (unused).
        args: ``F.embedding``'s positional arguments: ``input``, ``weight``
            (a ShardedTensor sharded by ``ChunkShardingSpec`` on dim 0 or 1), ...
        kwargs: ``F.embedding``'s keyword arguments (or None).
        pg: The weight's group (None: the weight's own).

    Returns:
        The embeddings, as ``F.embedding`` on the dense weight returns them.

    Raises:
        NotImplementedError: the weight is sharded otherwise.
        IndexError: an id is out of range on any rank (on every rank).
    """
    return _ops.sharded_embedding(args, kwargs or {}, pg)


def sharded_embedding_bag(types: Any, args: Any, kwargs: Optional[dict[str, Any]], pg: Any) -> torch.Tensor:
    """``F.embedding_bag`` on a chunk-sharded weight: what ``F.embedding_bag(input, sharded_weight, ...)`` runs.

    Every rank of the weight's group calls it, each with its own bags.

    Args:
        types: The ``__torch_function__`` types (unused).
        args: ``F.embedding_bag``'s positional arguments: ``input``,
            ``weight`` (a ShardedTensor sharded by ``ChunkShardingSpec`` on
            dim 0 or 1), ``offsets``, ...
        kwargs: ``F.embedding_bag``'s keyword arguments (or None).
        pg: The weight's group (None: the weight's own).

    Returns:
        The pooled bags, as ``F.embedding_bag`` on the dense weight returns them.

    Raises:
        NotImplementedError: the weight is sharded otherwise.
        IndexError: an id is out of range on any rank (on every rank).
    """
    return _ops.sharded_embedding_bag(args, kwargs or {}, pg)
