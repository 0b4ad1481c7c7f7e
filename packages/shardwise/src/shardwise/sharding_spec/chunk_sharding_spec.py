"""``ChunkShardingSpec``, at torch 2.13's path ``sharding_spec.chunk_sharding_spec``.

A torch-compatible public face over :mod:`shardwise._tensor.specs`,
plus ``narrow_tensor``, which torch's module re-exports.
"""

from __future__ import annotations

import torch

from shardwise._tensor.specs import ChunkShardingSpec, ShardingSpec
from shardwise._vocab.metadata import ShardMetadata
from shardwise._vocab.shard import Shard
from shardwise.sharded_tensor import metadata as sharded_tensor_meta
from shardwise.sharding_spec._internals import get_chunked_dim_size, get_split_size

__all__ = [
    "ChunkShardingSpec",
    "Shard",
    "ShardMetadata",
    "ShardingSpec",
    "get_chunked_dim_size",
    "get_split_size",
    "narrow_tensor",
    "sharded_tensor_meta",
]


def narrow_tensor(tensor: torch.Tensor, metadata: ShardMetadata) -> torch.Tensor:
    """The view of ``tensor`` that the shard ``metadata`` covers.

    As in torch 2.13, a dimension the shard spans in full (its size is not
    smaller than the tensor's) is left as it is, whatever its offset.

    Args:
        tensor: The whole tensor.
        metadata: The shard (its offsets and sizes are used).

    Returns:
        A view of ``tensor`` (no copy).

    Raises:
        ValueError: the shard has more dimensions than ``tensor``.
        RuntimeError: the shard lies outside ``tensor`` (from ``narrow``).
    """
    offsets, sizes = metadata.shard_offsets, metadata.shard_sizes
    if len(sizes) > tensor.dim():
        raise ValueError(
            f"cannot narrow a tensor of size {list(tensor.shape)} to the shard {metadata!r}: "
            f"the shard has {len(sizes)} dimensions, the tensor {tensor.dim()}"
        )
    view = tensor
    for dim, (offset, size) in enumerate(zip(offsets, sizes, strict=False)):
        if size < tensor.size(dim):
            view = view.narrow(dim, offset, size)
    return view
