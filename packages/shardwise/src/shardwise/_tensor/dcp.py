"""``torch.distributed.checkpoint`` (DCP) protocol for :class:`ShardedTensor`.

DCP calls three methods on any tensor that has them (see torch's
``torch/distributed/_checkpointable.py``): what a rank writes for a key,
which chunks of the global tensor a rank holds (so a load computes reads
by box overlap against the saved chunks, whatever spec or world size saved
them), and the tensor behind one chunk. Loading copies into that tensor
with ``copy_``, so it must be the local shard itself, never a copy.

Empty shards (trailing chunks of a ``ChunkShardingSpec``) hold no data and
are left out: DCP requires the saved chunks to cover the tensor exactly,
which they still do. A tensor with no element at all is the exception: it is
saved through its empty shards (one per box; DCP keeps one copy of a box
several ranks write), as torch's ShardedTensor saves it, or it would be
missing from the checkpoint.

A local shard may itself be a ShardedTensor (FSDP chunks nested in a
tensor-parallel shard, see shardwise-fsdp): its own local shards are the
data, at the outer shard's offsets plus theirs, so a nested tensor saves and
loads like a flat one with those boxes.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import torch

from shardwise._vocab.shard import Shard, ShardHolder

__all__ = ["chunk_list", "leaves", "tensor_shard", "write_items"]


class Leaf(NamedTuple):
    """A local tensor holding data and its box in the outermost tensor."""

    tensor: torch.Tensor
    offsets: torch.Size
    sizes: torch.Size


def leaves(shards: Sequence[Shard]) -> list[Leaf]:
    """The local data tensors of ``shards``, nested shards unwrapped, with their global boxes."""
    found = []
    for shard in shards:
        base = shard.metadata.shard_offsets
        if isinstance(shard.tensor, ShardHolder):
            for leaf in leaves(shard.tensor.local_shards()):
                offsets = torch.Size(b + o for b, o in zip(base, leaf.offsets, strict=True))
                found.append(Leaf(leaf.tensor, offsets, leaf.sizes))
        else:
            found.append(Leaf(shard.tensor, torch.Size(base), torch.Size(shard.metadata.shard_sizes)))
    return found


def _filled(shards: Sequence[Shard]) -> list[Leaf]:
    return [leaf for leaf in leaves(shards) if leaf.tensor.numel() > 0]


def _chunk(leaf: Leaf) -> Any:
    # torch.distributed.checkpoint is heavy to import; only a checkpoint save or load needs it.
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    return ChunkStorageMetadata(offsets=leaf.offsets, sizes=leaf.sizes)


def write_items(shards: Sequence[Shard], size: Sequence[int], fqn: str) -> list[Any]:
    """One ``WriteItem`` (type SHARD) per non-empty local shard, stored under ``fqn``; ``size`` is the global size.

    A tensor of no element gets one item per distinct empty box instead.
    """
    # torch.distributed.checkpoint is heavy to import; only a checkpoint save or load needs it.
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    held = _filled(shards)
    if not held and any(n == 0 for n in size):
        # Nothing to write, but the key must be in the checkpoint: its empty boxes stand for it.
        held = list({(tuple(leaf.offsets), tuple(leaf.sizes)): leaf for leaf in leaves(shards)}.values())
    items = []
    for leaf in held:
        chunk = _chunk(leaf)
        items.append(
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=chunk,
                    properties=TensorProperties.create_from_tensor(leaf.tensor),
                    size=torch.Size(size),
                ),
            )
        )
    return items


def chunk_list(shards: Sequence[Shard]) -> list[Any]:
    """``ChunkStorageMetadata`` (offsets and sizes in the global tensor) of each non-empty local shard."""
    return [_chunk(leaf) for leaf in _filled(shards)]


def tensor_shard(shards: Sequence[Shard], index: Any) -> torch.Tensor:
    """The local shard tensor (not a copy) starting at ``index.offset``.

    Raises:
        ValueError: no local shard starts there (the message names the key
            and the offsets this rank holds).
    """
    offset = None if index.offset is None else torch.Size(index.offset)
    held = leaves(shards)
    for leaf in sorted(held, key=lambda leaf: leaf.tensor.numel() == 0):  # an empty box may share the offset
        if leaf.offsets == offset:
            return leaf.tensor
    starts = [list(leaf.offsets) for leaf in held]
    raise ValueError(
        f"checkpoint key {index.fqn!r}: this rank holds no shard of the ShardedTensor at offsets "
        f"{None if offset is None else list(offset)}; its shards start at {starts}"
    )
