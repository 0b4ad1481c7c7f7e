"""``torch.distributed.checkpoint`` (DCP) protocol for :class:`ShardedTensor`.

DCP calls three methods on any tensor that has them (see torch's
``torch/distributed/_checkpointable.py``): what a rank writes for a key,
which chunks of the global tensor a rank holds (so a load computes reads
by box overlap against the saved chunks, whatever spec or world size saved
them), and the tensor behind one chunk. Loading copies into that tensor
with ``copy_``, so it must be the local shard itself, never a copy.

Empty shards (trailing chunks of a ``ChunkShardingSpec``) hold no data and
are left out: DCP requires the saved chunks to cover the tensor exactly,
which they still do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from shardwise.sharded_tensor._api import ShardedTensor
    from shardwise.sharded_tensor._shard import Shard

__all__ = ["chunk_list", "tensor_shard", "write_items"]


def _filled(st: ShardedTensor) -> list[Shard]:
    return [s for s in st.local_shards() if s.tensor.numel() > 0]


def _chunk(shard: Shard) -> Any:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    return ChunkStorageMetadata(
        offsets=torch.Size(shard.metadata.shard_offsets), sizes=torch.Size(shard.metadata.shard_sizes)
    )


def write_items(st: ShardedTensor, fqn: str) -> list[Any]:
    """One ``WriteItem`` (type SHARD) per non-empty local shard of ``st``, stored under ``fqn``."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    items = []
    for shard in _filled(st):
        chunk = _chunk(shard)
        items.append(
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=chunk,
                    properties=TensorProperties.create_from_tensor(shard.tensor),
                    size=torch.Size(st.size()),
                ),
            )
        )
    return items


def chunk_list(st: ShardedTensor) -> list[Any]:
    """``ChunkStorageMetadata`` (offsets and sizes in the global tensor) of each non-empty local shard."""
    return [_chunk(shard) for shard in _filled(st)]


def tensor_shard(st: ShardedTensor, index: Any) -> torch.Tensor:
    """The local shard tensor (not a copy) starting at ``index.offset``.

    Raises:
        ValueError: no local shard starts there (the message names the key
            and the offsets this rank holds).
    """
    offset = None if index.offset is None else torch.Size(index.offset)
    for shard in st.local_shards():
        if torch.Size(shard.metadata.shard_offsets) == offset:
            return shard.tensor
    held = [list(s.metadata.shard_offsets) for s in st.local_shards()]
    raise ValueError(
        f"checkpoint key {index.fqn!r}: this rank holds no shard of the ShardedTensor at offsets "
        f"{None if offset is None else list(offset)}; its shards start at {held}"
    )
