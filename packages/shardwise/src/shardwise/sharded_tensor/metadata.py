"""Sharded tensor metadata records, at torch 2.13's path ``sharded_tensor.metadata``.

A torch-compatible public face over :mod:`shardwise._vocab.metadata`, plus torch's
``MEM_FORMAT_ENCODING``.
"""

from __future__ import annotations

from enum import Enum

from shardwise._vocab.metadata import ShardMetadata, ShardedTensorMetadata, TensorProperties

__all__ = ["MEM_FORMAT_ENCODING", "ShardMetadata", "ShardedTensorMetadata", "TensorProperties"]


class MEM_FORMAT_ENCODING(Enum):  # noqa: N801 - torch 2.13's name
    """The integer codes torch 2.13 pickles a ``TensorProperties.memory_format`` as.

    shardwise pickles the format by name instead (``TensorProperties.to_dict``);
    the codes are here, with torch's values, for code that reads torch's.
    """

    TORCH_CONTIGUOUS_FORMAT = 0
    TORCH_CHANNELS_LAST = 1
    TORCH_PRESERVE_FORMAT = 2
