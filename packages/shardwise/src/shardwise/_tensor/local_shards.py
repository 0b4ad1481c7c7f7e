"""Matching the shards a rank passes with the global metadata's entries for it.

Used by ``ShardedTensor._init_from_local_shards_and_global_metadata``. The
messages say which shard is wrong and how, and also carry torch 2.13's
wording ("Number of local shards ... does not match number of local shards
metadata", "Local shards' tensor dtype property is incompatible with ...").
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from shardwise._comm.default_group import is_initialized
from shardwise._vocab.metadata import ShardMetadata, ShardedTensorMetadata, TensorProperties
from shardwise._vocab.shard import Shard
from shardwise.errors import LocalShardsMismatchError

__all__ = ["check_properties", "match_local_shards", "no_default_group", "shards_without_group"]


def no_default_group() -> bool:
    """True when neither ``shardwise.init`` nor ``torch.distributed.init_process_group`` was called."""
    return not is_initialized() and not (dist.is_available() and dist.is_initialized())


def check_properties(
    tensor: torch.Tensor, props: TensorProperties, what: str, rank: Any, *, contiguous: bool = True
) -> None:
    """Raise unless ``tensor`` has the dtype, layout and grad flag the metadata says (and, if asked, is contiguous).

    Raises:
        ValueError: naming the property, both values and the shard.
    """
    for name, expected, actual in (
        ("dtype", props.dtype, tensor.dtype),
        ("layout", props.layout, tensor.layout),
        ("requires_grad", props.requires_grad, tensor.requires_grad),
    ):
        if expected != actual:
            raise ValueError(
                f"{what} has {name} {actual}, the metadata says {expected} (Local shards' tensor {name} property "
                f"is incompatible with tensor property on rank {rank}: tensor property {name}={expected}, local "
                f"shard tensor {name}={actual})"
            )
    if contiguous and not tensor.is_contiguous():
        raise ValueError(
            f"{what} is not contiguous; call .contiguous() first (Only torch.contiguous_format memory_format is "
            "currently supported)"
        )


def match_local_shards(
    local_shards: Sequence[Any], mine: Sequence[ShardMetadata], props: TensorProperties, rank: Any
) -> list[Shard]:
    """``local_shards`` checked against ``mine``, the metadata entries placed on this rank.

    Args:
        local_shards: What the caller passed.
        mine: The global metadata's entries for this rank.
        props: The tensor's properties.
        rank: This rank (for messages).

    Returns:
        The shards, in the order passed.

    Raises:
        TypeError: an entry is not a :class:`Shard`.
        LocalShardsMismatchError: as many shards were not passed as the
            metadata places here, or a shard matches no entry (or one
            another shard already matched).
        ValueError: a shard's tensor disagrees with the properties.
    """
    for shard in local_shards:
        if not isinstance(shard, Shard):
            raise TypeError(f"local_shards must hold Shard objects, got {type(shard).__name__}")
    if len(local_shards) != len(mine):
        raise LocalShardsMismatchError(
            f"rank {rank} passed {len(local_shards)} local shard(s), but the global metadata places {len(mine)} on it "
            f"({[md.describe() for md in mine]}): Number of local shards ({len(local_shards)}) does not match number "
            f"of local shards metadata in sharded_tensor_metadata ({len(mine)}) on rank ({rank})"
        )
    unmatched = list(mine)
    for i, shard in enumerate(local_shards):
        if shard.metadata not in unmatched:
            earlier = [j for j in range(i) if local_shards[j].metadata == shard.metadata]
            why = (
                f"local shard {earlier[0]} already has that box"
                if earlier
                else f"the global metadata places on rank {rank} only {[md.describe() for md in mine]}"
            )
            raise LocalShardsMismatchError(f"local shard {i} ({shard.metadata.describe()}) matches no entry: {why}")
        unmatched.remove(shard.metadata)
        check_properties(shard.tensor, props, f"local shard {i} ({shard.metadata.describe()})", rank)
    return list(local_shards)


def shards_without_group(local_shards: Sequence[Any], metadata: ShardedTensorMetadata) -> list[Shard]:
    """The shards of a tensor built with no process group anywhere: every shard passed is held here.

    As torch 2.13's ``ShardedTensorBase._init_from_local_shards_and_global_metadata``:
    with no group there is no rank to compare placements with, so every
    shard passed is a local one; each must be an entry of the metadata, and
    (as torch) need not be contiguous.

    Raises:
        TypeError: an entry is not a :class:`Shard`.
        LocalShardsMismatchError: a shard is not in the metadata, or two
            shards have the same entry.
        ValueError: a shard's tensor disagrees with the properties.
    """
    entries = list(metadata.shards_metadata)
    for i, shard in enumerate(local_shards):
        if not isinstance(shard, Shard):
            raise TypeError(f"local_shards must hold Shard objects, got {type(shard).__name__}")
        if shard.metadata not in entries:
            raise LocalShardsMismatchError(
                f"local shard {i} ({shard.metadata.describe()}) is not in the global metadata, or another local "
                "shard already has its entry"
            )
        entries.remove(shard.metadata)
        check_properties(
            shard.tensor,
            metadata.tensor_properties,
            f"local shard {i} ({shard.metadata.describe()})",
            "(no group)",
            contiguous=False,
        )
    return list(local_shards)
