"""``init_from_local_shards``'s work: a ShardedTensor's parts from each rank's own shards, checked across ranks."""

from __future__ import annotations

from typing import Any

import torch

from shardwise._comm.default_group import resolve_group
from shardwise._comm.group import Group
from shardwise._tensor.placements import alone_hint, check_no_rrefs, flatten_size, validate_placements
from shardwise._tensor.specs import ShardingSpec, infer_sharding_spec
from shardwise._vocab.metadata import (
    ShardMetadata,
    ShardedTensorMetadata,
    TensorProperties,
)
from shardwise._vocab.shard import Shard
from shardwise._vocab.validation import validate_layout

__all__ = ["assemble_local_shards", "stacked_along_dim0"]


def _local_payload(local_shards: list[Shard], global_size: tuple[Any, ...], group: Any) -> dict[str, Any]:
    rank = group.global_rank
    size = flatten_size(global_size)
    if not isinstance(local_shards, (list, tuple)):
        raise TypeError(f"local_shards must be a list of Shard, got {type(local_shards).__name__}")
    props = None
    for i, shard in enumerate(local_shards):
        if not isinstance(shard, Shard):
            raise TypeError(f"local_shards[{i}] must be a Shard, got {type(shard).__name__}")
        md = shard.metadata
        placed = None if md.placement is None else md.placement.rank()
        if placed is not None and placed not in group.ranks:
            raise ValueError(
                f"local shard {i} ({md.describe()}) is placed on rank {placed}, but the group has {group.size} "
                f"rank(s) ({group.describe_members()}){alone_hint(group.size)}: Global rank {placed} does not "
                f"exist in input process group: {list(group.ranks)}"
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
        # Layout first: a sparse tensor has no is_contiguous().
        if shard.tensor.layout != torch.strided:
            raise ValueError(
                f"local shard {i} has layout {shard.tensor.layout}; only torch.strided is supported (Only "
                "torch.strided layout is currently supported)"
            )
        if not shard.tensor.is_contiguous():
            raise ValueError(
                f"local shard {i} ({md.describe()}) is not contiguous; call .contiguous() first (Only "
                "torch.contiguous_format memory_format is currently supported!)"
            )
        mine = TensorProperties.create_from_tensor(shard.tensor)
        if props is None:
            props = mine
        elif mine != props:
            key = _first_difference(props.to_dict(), mine.to_dict())
            raise ValueError(
                f"local shards on rank {rank} disagree: shard 0 has {props.to_dict()}, shard {i} has {mine.to_dict()} "
                f"(Local shards' tensor {key} property need to be the same on rank:{rank}!)"
            )
    return {
        "size": list(size),
        "shards": [s.metadata.to_dict() for s in local_shards],
        "props": None if props is None else props.to_dict(),
    }


def _first_difference(a: dict[str, Any], b: dict[str, Any]) -> str:
    """The first tensor property (in torch's order of checks) on which two property dicts differ."""
    keys = ["dtype", "requires_grad", "pin_memory", *a]
    return next((k for k in keys if a.get(k) != b.get(k)), "tensor")


def stacked_along_dim0(shards: list[ShardMetadata]) -> tuple[list[ShardMetadata], list[int]]:
    """The shards laid end to end along dim 0 in the order of their placement ranks, and the size they make.

    torch 2.13's answer to ``init_from_local_shards(shards, None, ...)``:
    the passed offsets are ignored, every other dim starts at 0, and the
    size is the sum along dim 0 by the first shard's other dims.
    """
    order = sorted(range(len(shards)), key=lambda i: shards[i].rank or 0)
    out = list(shards)
    offset = 0
    for i in order:
        md = shards[i]
        out[i] = ShardMetadata([offset] + [0] * (len(md.shard_sizes) - 1), md.shard_sizes, md.placement)
        offset += md.shard_sizes[0] if md.shard_sizes else 0
    first = shards[order[0]].shard_sizes
    return out, [offset, *first[1:]] if first else []


def assemble_local_shards(
    local_shards: list[Shard],
    *global_size: Any,
    process_group: Any = None,
    init_rrefs: bool = False,
) -> tuple[ShardingSpec, ShardedTensorMetadata, list[Shard], Group]:
    """The parts of a ShardedTensor built from the shards each rank holds, checked across ranks.

    What ``ShardedTensor._init_from_local_shards`` (and so
    ``init_from_local_shards``) builds its tensor from; see
    :func:`shardwise._tensor.sharded_tensor.init_from_local_shards` for the
    arguments and the errors.

    Returns:
        The inferred spec, the global metadata, this rank's shards and the group.
    """
    # As torch 2.13: the shards are validated first (so bad input raises its ValueError even with
    # init_rrefs=True) and only a valid tensor needs the RPC shardwise lacks.
    group = resolve_group(process_group)
    if not group.is_member:
        # As in torch, which gathers nothing on such a rank and finds no shard.
        raise ValueError(
            "init_from_local_shards: this rank is not a member of process_group (torch's "
            "GroupMember.NON_GROUP_MEMBER), so it cannot learn the other ranks' shards; call it on the group's "
            "members only, or build the tensor with ShardedTensor._init_from_local_shards_and_global_metadata: "
            "ShardedTensor have no local shards on all ranks!"
        )
    # None in the size (torch's "recalc" form): stack each rank's one shard along dim 0 in rank order.
    stack = any(s is None for s in global_size)
    if stack:
        global_size = tuple(0 if s is None else s for s in global_size)

    def check() -> dict[str, Any]:
        payload = _local_payload(local_shards, global_size, group)
        if stack and len(local_shards) != 1:
            raise ValueError(
                f"init_from_local_shards with None in the global size stacks one shard per rank along dim 0, but "
                f"rank {group.global_rank} passed {len(local_shards)}; pass exactly one, or give the whole size"
            )
        return payload

    gathered = group.agree(check, op="init_from_local_shards", gather=True)
    size = gathered[group.rank]["size"]
    for r, entry in enumerate(gathered):
        if entry["size"] != size:
            raise ValueError(
                f"ranks disagree on the global size: rank {group.rank} passed {size}, rank {r} passed {entry['size']} "
                "(ShardedTensor global_size property does not match from different ranks!)"
            )
    props_dict = None
    props_rank = -1
    for r, entry in enumerate(gathered):
        if entry["props"] is None:
            continue
        if props_dict is None:
            props_dict, props_rank = entry["props"], r
        elif entry["props"] != props_dict:
            key = _first_difference(props_dict, entry["props"])
            raise ValueError(
                f"ranks disagree on the tensor properties: rank {props_rank} has {props_dict}, "
                f"rank {r} has {entry['props']} (ShardedTensor {key} property does not match from different ranks!)"
            )
    shards_md = [ShardMetadata.from_dict(s) for entry in gathered for s in entry["shards"]]
    if not shards_md:
        raise ValueError(
            f"no rank passed a local shard for a tensor of size {size} (ShardedTensor have no local shards on all "
            "ranks!)"
        )
    props = TensorProperties.from_dict(props_dict) if props_dict is not None else TensorProperties()
    if stack:
        shards_md, size = stacked_along_dim0(shards_md)
    validate_placements(shards_md, group)
    validate_layout(shards_md, size)
    check_no_rrefs(init_rrefs)
    metadata = ShardedTensorMetadata(shards_md, torch.Size(size), props)
    spec = infer_sharding_spec(shards_md, size)
    mine = [s for s in shards_md if s.placement is not None and s.placement.rank() == group.global_rank]
    # Reuse the global metadata objects so local shards and metadata agree by identity too.
    local = [Shard(shard.tensor, md) for shard, md in zip(local_shards, mine, strict=False)]
    return spec, metadata, local, group


