"""``shard_tensor``: cut a whole tensor held by one rank into a :class:`~shardwise.ShardedTensor`.

Each rank validates its arguments locally, including that it can use the
devices the spec places its shards on (a failing rank rejects the
agreement, so its peers raise PeerError instead of hanging), then the ranks
exchange what they were asked to do (spec, ``src_rank``, the source
tensor's size and properties) and stop with the same ValueError everywhere
if they disagree. Only then does data move, through
:mod:`shardwise._layout.redistribute`: a redistribution from "the whole
tensor on ``src_rank``" to the spec's layout, each element straight to the
rank that owns it, once.
"""

from __future__ import annotations

from typing import Any

import torch

from shardwise._comm.default_group import resolve_group
from shardwise._comm.group import Group
from shardwise._layout.redistribute import redistribute
from shardwise._tensor.layout_checks import (
    build_target,
    check_same,
    check_same_spec,
    declared_placements,
    layout_digest,
    spec_fingerprint,
)
from shardwise._tensor.placements import check_local_devices
from shardwise._tensor.sharded_tensor import ShardedTensor
from shardwise._tensor.specs import ShardingSpec
from shardwise._vocab.metadata import ShardMetadata, ShardedTensorMetadata, TensorProperties
from shardwise._vocab.shard import Shard

__all__ = ["scatter_tensor", "shard_tensor"]


def _local_payload(tensor: Any, spec: Any, src_rank: Any, group: Group) -> dict[str, Any]:
    if not isinstance(spec, ShardingSpec):
        raise TypeError(f"sharding_spec must be a ShardingSpec, got {type(spec).__name__}")
    if isinstance(src_rank, bool) or not isinstance(src_rank, int):
        raise TypeError(f"src_rank must be an int, got {src_rank!r}")
    if not 0 <= src_rank < group.size:
        raise ValueError(
            f"src_rank={src_rank} is not a rank of the group (size {group.size}, ranks 0..{group.size - 1})"
        )
    if not isinstance(tensor, torch.Tensor) or isinstance(tensor, ShardedTensor):
        what = (
            "a ShardedTensor (use reshard to change its spec)"
            if isinstance(tensor, ShardedTensor)
            else type(tensor).__name__
        )
        raise TypeError(f"shard_tensor takes a plain torch.Tensor, got {what}")
    if tensor.layout != torch.strided:
        raise TypeError(f"shard_tensor takes a dense (strided) tensor, got layout {tensor.layout}")
    if not tensor.is_contiguous():
        raise ValueError(
            f"input tensor on rank {group.rank} is not a contiguous Tensor (strides {tensor.stride()}); "
            "call .contiguous() first"
        )
    payload: dict[str, Any] = {"src_rank": src_rank, "spec": spec_fingerprint(spec)}
    if group.rank == src_rank:
        props = TensorProperties.create_from_tensor(tensor)
        payload["tensor"] = {"size": list(tensor.size()), "props": props.to_dict()}
    return payload


def shard_tensor(
    tensor: torch.Tensor, sharding_spec: ShardingSpec, src_rank: int = 0, process_group: Any = None
) -> ShardedTensor:
    """Shard ``tensor``, held by ``src_rank``, across the group by ``sharding_spec``.

    torch 2.13's ``_shard_tensor``, for any spec (torch supports only
    ``ChunkShardingSpec``). Every rank calls it. Ranks first exchange their
    ``src_rank`` and spec (as JSON) and ``src_rank`` its tensor's size,
    dtype and ``requires_grad``; then each shard goes straight from
    ``src_rank`` to its owner in one all-to-all (``src_rank``'s own shards
    are copied locally).

    Only ``src_rank``'s ``tensor`` is read. The other ranks must pass a
    contiguous tensor too, but its size and dtype are ignored, so a
    placeholder such as ``torch.empty(0)`` will do (torch needs the same
    size everywhere; passing it is of course fine).

    Args:
        tensor: The whole tensor (on ``src_rank``); contiguous on every rank.
        sharding_spec: How to shard it; the same on every rank.
        src_rank: Rank of the group whose ``tensor`` is sharded; the same on
            every rank.
        process_group: Group, torch ProcessGroup or None (default group).

    Returns:
        The ShardedTensor; its local shards are new leaf tensors (never
        views of ``tensor``) whose ``requires_grad`` is that of
        ``src_rank``'s tensor.

    Raises:
        ValueError: ranks pass different specs or ``src_rank`` values; the
            spec cannot shard a tensor of that size or places a shard
            outside the group (all on every rank); ``src_rank`` is outside
            the group, a rank's tensor is not contiguous, or the spec places
            a shard on a device its rank cannot use, such as ``cuda`` on a
            CPU-only host (on that rank; its peers raise
            :class:`~shardwise.errors.PeerError`).
        TypeError: a rank passed something other than a tensor or a spec
            (on that rank; peers raise PeerError).
    """
    if _overrides_shard(sharding_spec):
        # As torch's _shard_tensor: a spec that implements shard() itself decides how it shards.
        result: ShardedTensor = sharding_spec.shard(tensor, src_rank=src_rank, process_group=process_group)
        return result
    return scatter_tensor(tensor, sharding_spec, src_rank, process_group)


def _overrides_shard(spec: Any) -> bool:
    """Whether ``spec``'s class defines its own ``shard`` (the base class's is :func:`scatter_tensor`)."""
    return isinstance(spec, ShardingSpec) and type(spec).shard is not ShardingSpec.shard


def scatter_tensor(
    tensor: torch.Tensor, sharding_spec: ShardingSpec, src_rank: int = 0, process_group: Any = None
) -> ShardedTensor:
    """:func:`shard_tensor`'s data movement, which ``ShardingSpec.shard`` runs (it never calls a spec's ``shard``)."""
    group = resolve_group(process_group)
    if not group.is_member:
        return _outside_group(tensor, sharding_spec, group)

    def check() -> dict[str, Any]:
        payload = _local_payload(tensor, sharding_spec, src_rank, group)
        # This rank's shards must fit on devices it has; a built-in spec says where they go without the size.
        declared = declared_placements(sharding_spec)
        if declared is not None:
            check_local_devices(declared, group)
        payload["devices_checked"] = declared is not None
        return payload

    entries = group.agree(check, op="shard_tensor", gather=True)
    check_same([e["src_rank"] for e in entries], "src_rank", "every rank must pass the same src_rank")
    check_same_spec([e["spec"] for e in entries], "every rank must pass the same spec")
    info = entries[src_rank]["tensor"]
    size = torch.Size(info["size"])
    props = TensorProperties.from_dict(info["props"])
    device = str(tensor.device) if group.rank == src_rank else "cpu"
    # src_rank is a rank of the group; placements name global ranks.
    whole = ShardedTensorMetadata(
        [ShardMetadata([0] * len(size), list(size), f"rank:{group.ranks[src_rank]}/{device}")], size, props
    )
    target = build_target(sharding_spec, whole, group, "shard")
    if not all(e.get("devices_checked") is True for e in entries):
        # A spec only its metadata places (a user's spec class): now that the size is known, a second
        # agreement, decided from agreed data so every rank joins it or none, on the devices and on the
        # layout the spec builds (its repr alone cannot tell two such specs apart).
        def check_target() -> str:
            check_local_devices([e.placement for e in target.shards_metadata], group)
            return layout_digest(target)

        built = group.agree(check_target, op="shard_tensor", gather=True)
        if len(set(built)) > 1:
            texts = [entry["spec"]["text"] for entry in entries]
            check_same_spec(
                [{"digest": digest, "text": text} for digest, text in zip(built, texts, strict=True)],
                "every rank must pass the same spec",
            )
    mine = [Shard(tensor, whole.shards_metadata[0])] if group.rank == src_rank else []
    shards = redistribute(mine, whole, target, group, trusted=True)
    return ShardedTensor._create(sharding_spec, target, shards, group)


def _outside_group(tensor: Any, spec: Any, group: Group) -> ShardedTensor:
    """``shard_tensor`` on a rank outside the group: no local shards, metadata from this rank's own arguments.

    Such a rank cannot hear from ``src_rank``; torch requires every rank to
    pass a tensor of the full size, so its own tensor gives the size and
    properties (torch 2.13 itself fails here with a bare AssertionError).
    """
    if not isinstance(spec, ShardingSpec):
        raise TypeError(f"sharding_spec must be a ShardingSpec, got {type(spec).__name__}")
    if not isinstance(tensor, torch.Tensor) or isinstance(tensor, ShardedTensor):
        raise TypeError(f"shard_tensor takes a plain torch.Tensor, got {type(tensor).__name__}")
    md = spec.build_metadata(tensor.size(), TensorProperties.create_from_tensor(tensor))
    return ShardedTensor._create(spec, md, [], group)
