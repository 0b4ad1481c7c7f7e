"""``ShardedTensor`` and its metadata helpers, at torch 2.13's path ``sharded_tensor.api``.

A torch-compatible public face over :mod:`shardwise._tensor.sharded_tensor`
and the helpers torch's module re-exports.
"""

from __future__ import annotations

from typing import Any

import torch

from shardwise import sharding_spec as shard_spec
from shardwise._tensor.sharded_tensor import ShardedTensor, ShardedTensorBase
from shardwise._vocab.metadata import ShardedTensorMetadata, TensorProperties
from shardwise._vocab.shard import Shard
from shardwise.sharded_tensor.reshard import reshard_local_shard, reshuffle_local_shard
from shardwise.sharded_tensor.utils import (
    build_global_metadata,
    build_metadata_from_local_shards,
    check_tensor,
    validate_non_overlapping_shards_metadata,
)

__all__ = [
    "DEPRECATE_MSG",
    "Shard",
    "ShardedTensor",
    "ShardedTensorBase",
    "ShardedTensorMetadata",
    "TensorProperties",
    "build_global_metadata",
    "build_metadata_from_local_shards",
    "check_tensor",
    "reshard_local_shard",
    "reshuffle_local_shard",
    "shard_spec",
    "validate_non_overlapping_shards_metadata",
]

#: torch 2.13's deprecation notice for its own ShardedTensor, with torch's
#: text, for warning filters written against it. shardwise never emits it.
DEPRECATE_MSG = "Please use DTensor instead and we are deprecating ShardedTensor."


def _create_tensor_from_params(*size: Any, local_device: Any, tensor_properties: TensorProperties) -> torch.Tensor:
    """An uninitialised local tensor of ``size`` on ``local_device`` with ``tensor_properties`` (torch 2.13's name).

    Args:
        *size: The tensor's size (ints, or one sequence).
        local_device: Its device.
        tensor_properties: Its dtype, layout, ``requires_grad``, memory
            format and pinning.

    Returns:
        A new tensor, as ``torch.empty`` makes it.
    """
    props = tensor_properties
    return torch.empty(
        *size,
        dtype=props.dtype,
        layout=props.layout,
        device=local_device,
        requires_grad=props.requires_grad,
        memory_format=props.memory_format,
        pin_memory=props.pin_memory,
    )
