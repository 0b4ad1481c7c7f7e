"""``Shard``: one local piece of a sharded tensor and its metadata."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence, runtime_checkable

import torch

from shardwise._vocab.metadata import ShardMetadata

__all__ = ["Shard", "ShardHolder"]


@dataclass
class Shard:
    """A local tensor holding one shard, and the shard's metadata.

    Args:
        tensor: The shard's data; its size must equal
            ``metadata.shard_sizes`` and its device the placement's device.
        metadata: Where the shard sits in the whole tensor and which rank
            holds it.

    Raises:
        ValueError: size or device disagree with the metadata.
    """

    __slots__ = ("tensor", "metadata")

    tensor: torch.Tensor
    metadata: ShardMetadata

    def __post_init__(self) -> None:
        if not isinstance(self.tensor, torch.Tensor):
            raise TypeError(f"Shard.tensor must be a torch.Tensor, got {type(self.tensor).__name__}")
        if not isinstance(self.metadata, ShardMetadata):
            raise TypeError(f"Shard.metadata must be a ShardMetadata, got {type(self.metadata).__name__}")
        if list(self.tensor.size()) != self.metadata.shard_sizes:
            raise ValueError(
                f"shard tensor of size {list(self.tensor.size())} does not match its metadata "
                f"({self.metadata.describe()}) (Shard tensor size does not match with metadata.shard_lengths)"
            )
        placement = self.metadata.placement
        if placement is not None and not _same_device(placement.device(), self.tensor.device):
            raise ValueError(
                f"shard tensor is on {self.tensor.device} but its metadata places it on {placement} "
                "(Local shard tensor device does not match with local Shard's placement)"
            )

    @classmethod
    def from_tensor_and_offsets(cls, tensor: torch.Tensor, shard_offsets: Sequence[int], rank: int) -> Shard:
        """A shard of ``tensor`` at ``shard_offsets``, placed on ``rank`` and the tensor's device."""
        return cls(tensor, ShardMetadata(shard_offsets, list(tensor.size()), f"rank:{rank}/{tensor.device}"))


def _same_device(placed: torch.device, actual: torch.device) -> bool:
    # "cuda" in a placement means the current CUDA device, as torch reads it.
    if placed.type != actual.type:
        return False
    if placed.index is None or actual.index is None:
        return True
    return placed.index == actual.index


@runtime_checkable
class ShardHolder(Protocol):
    """Anything that holds local shards of a global tensor: shardwise's ``ShardedTensor`` or torch's.

    Code below the tensor layer's class (the DCP protocol, ``gather``) tells
    a sharded tensor from a plain one by this protocol, so it need not import
    the class that calls it.
    """

    def local_shards(self) -> list[Any]:
        """The shards this rank holds."""
        ...

    def metadata(self) -> Any:
        """The global metadata (every shard's box and placement)."""
        ...
