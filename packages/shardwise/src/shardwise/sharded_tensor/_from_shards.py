"""``init_from_local_shards``: assemble a ShardedTensor from each rank's own shards."""

from __future__ import annotations

from typing import Any

import torch

from shardwise._metadata import (
    ShardMetadata,
    ShardedTensorMetadata,
    TensorProperties,
    check_covering,
    validate_non_overlapping,
)
from shardwise.sharded_tensor._api import ShardedTensor, _check_no_rrefs, flatten_size, validate_placements
from shardwise.sharded_tensor._shard import Shard
from shardwise.sharding_spec._api import infer_sharding_spec

__all__ = ["init_from_local_shards"]


def _local_payload(local_shards: list[Shard], global_size: tuple[Any, ...], rank: int, size_: int) -> dict[str, Any]:
    size = flatten_size(global_size)
    if not isinstance(local_shards, (list, tuple)):
        raise TypeError(f"local_shards must be a list of Shard, got {type(local_shards).__name__}")
    props = None
    for i, shard in enumerate(local_shards):
        if not isinstance(shard, Shard):
            raise TypeError(f"local_shards[{i}] must be a Shard, got {type(shard).__name__}")
        md = shard.metadata
        if md.placement is not None and md.placement.rank() >= size_:
            raise ValueError(
                f"local shard {i} ({md.describe()}) is placed on rank {md.placement.rank()}, "
                f"but the group has {size_} rank(s) (0..{size_ - 1})"
            )
        if md.placement is None or md.placement.rank() != rank:
            raise ValueError(
                f"local shard {i} ({md.describe()}) is placed on {md.placement}, but it was passed on rank {rank}; "
                f"a rank may only pass shards placed on 'rank:{rank}/...'"
            )
        if len(md.shard_offsets) != len(size):
            raise ValueError(
                f"local shard {i} ({md.describe()}) has {len(md.shard_offsets)} dimensions, "
                f"the global size {list(size)} has {len(size)}"
            )
        if not shard.tensor.is_contiguous():
            raise ValueError(f"local shard {i} ({md.describe()}) is not contiguous; call .contiguous() first")
        if shard.tensor.layout != torch.strided:
            raise ValueError(f"local shard {i} has layout {shard.tensor.layout}; only torch.strided is supported")
        mine = TensorProperties.create_from_tensor(shard.tensor)
        if props is None:
            props = mine
        elif mine != props:
            raise ValueError(
                f"local shards on rank {rank} disagree: shard 0 has {props.to_dict()}, shard {i} has {mine.to_dict()}"
            )
    return {
        "size": list(size),
        "shards": [s.metadata.to_dict() for s in local_shards],
        "props": None if props is None else props.to_dict(),
    }


def init_from_local_shards(
    local_shards: list[Shard],
    *global_size: Any,
    process_group: Any = None,
    init_rrefs: bool = False,
) -> ShardedTensor:
    """Build a ShardedTensor from the shards each rank holds, checked across ranks.

    Every rank of the group calls it. Ranks exchange their shards'
    metadata (as JSON, through ``Group.exchange``) and each validates the
    whole picture the same way, so invalid input raises the same error on
    every rank instead of hanging some of them.

    Args:
        local_shards: This rank's shards (possibly none).
        *global_size: Size of the whole tensor.
        process_group: Group, torch ProcessGroup or None.
        init_rrefs: Must be False.

    Returns:
        The ShardedTensor; its spec is inferred from the shards (a chunk
        spec when they form one).

    Raises:
        ValueError: ranks disagree on the size or tensor properties, shards
            overlap, leave part of the tensor uncovered, stick out of it,
            or name a rank outside the group or another rank than the one
            passing them. A rank whose own input is bad raises the real
            error; its peers raise :class:`~shardwise.errors.PeerError`.
        TypeError: a local shard is not a :class:`Shard`.
    """
    from shardwise._runtime import resolve_group

    _check_no_rrefs(init_rrefs)
    group = resolve_group(process_group)
    try:
        payload = _local_payload(local_shards, global_size, group.rank, group.size)
    except (TypeError, ValueError) as exc:
        group.reject(exc, op="init_from_local_shards")
    gathered = group.exchange(payload, op="init_from_local_shards")
    size = gathered[group.rank]["size"]
    for r, entry in enumerate(gathered):
        if entry["size"] != size:
            raise ValueError(
                f"ranks disagree on the global size: rank {group.rank} passed {size}, rank {r} passed {entry['size']}"
            )
    props_dict = None
    props_rank = -1
    for r, entry in enumerate(gathered):
        if entry["props"] is None:
            continue
        if props_dict is None:
            props_dict, props_rank = entry["props"], r
        elif entry["props"] != props_dict:
            raise ValueError(
                f"ranks disagree on the tensor properties: rank {props_rank} has {props_dict}, "
                f"rank {r} has {entry['props']}"
            )
    shards_md = [ShardMetadata.from_dict(s) for entry in gathered for s in entry["shards"]]
    if not shards_md:
        raise ValueError(f"no rank passed a local shard for a tensor of size {size}")
    props = TensorProperties.from_dict(props_dict) if props_dict is not None else TensorProperties()
    validate_placements(shards_md, group.size)
    validate_non_overlapping(shards_md)
    check_covering(shards_md, size)
    metadata = ShardedTensorMetadata(shards_md, torch.Size(size), props)
    spec = infer_sharding_spec(shards_md, size)
    mine = [s for s in shards_md if s.placement is not None and s.placement.rank() == group.rank]
    # Reuse the global metadata objects so local shards and metadata agree by identity too.
    local = [Shard(shard.tensor, md) for shard, md in zip(local_shards, mine, strict=False)]
    return ShardedTensor._create(spec, metadata, local, group)


