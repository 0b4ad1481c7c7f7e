"""``ShardedTensor.reshard``: re-cut a tensor by another spec in place, in one exchange.

The ranks agree on the spec and on the tensor they hold (a digest of its
metadata, as :mod:`shardwise._tensor.scatter` does for the other verbs), then move
each element once from its old owner to its new one
(:func:`shardwise._layout.redistribute.redistribute`), in as many dim-0 slabs as keep
every rank within twice its shard (:attr:`shardwise._layout.plan.TransferPlan.rounds`).
The result lists its shards by rank, as torch 2.13's ``reshard`` does.
"""

from __future__ import annotations

from typing import Any

import torch

from shardwise._comm.group import Group
from shardwise._layout.plan import MAX_ROUNDS
from shardwise._layout.redistribute import match_sources, plan, redistribute
from shardwise._tensor.layout_checks import SAME_TENSOR, build_target, check_same, layout_digest
from shardwise._tensor.placements import check_local_devices
from shardwise._tensor.specs import ShardingSpec
from shardwise._vocab.metadata import ShardMetadata, ShardedTensorMetadata, TensorProperties
from shardwise._vocab.shard import Shard

__all__ = ["reshard_shards"]


def reshard_shards(
    shards: list[Shard], old: ShardedTensorMetadata, spec: Any, group: Group
) -> tuple[ShardedTensorMetadata, list[Shard]]:
    """A tensor's metadata and local shards re-cut by ``spec`` (any spec to any spec).

    Every rank calls it with the same spec. New local shards are leaves
    with the tensor's ``requires_grad``; ``ShardedTensor.reshard`` stores
    what this returns in place of its old layout.

    Args:
        shards: This rank's local shards.
        old: The tensor's global metadata now.
        spec: The spec to re-cut by (checked: a ShardingSpec).
        group: The tensor's group.

    Returns:
        The new global metadata (shards listed by rank) and this rank's new
        local shards.

    Raises:
        TypeError: ``spec`` is not a ShardingSpec (on that rank; peers raise
            :class:`~shardwise.errors.PeerError`).
        ValueError: ranks pass different specs, or the spec does not fit
            the tensor's size or the group (on every rank); the spec places
            a shard on a device its rank cannot use (on that rank; its peers
            raise PeerError).
    """
    if not group.is_member:
        # Outside the group: no data here, only the new global metadata (torch holds no shard there either).
        if not isinstance(spec, ShardingSpec):
            raise TypeError(f"reshard takes a ShardingSpec, got {type(spec).__name__}")
        return _in_rank_order(build_target(spec, old, group, "reshard"), old), []
    local: dict[str, Any] = {}

    def check() -> dict[str, Any]:
        if not isinstance(spec, ShardingSpec):
            raise TypeError(f"reshard takes a ShardingSpec, got {type(spec).__name__}")
        mine: dict[str, Any] = {"spec": spec.to_dict(), "layout": layout_digest(old)}
        local["target"] = _in_rank_order(build_target(spec, old, group, "reshard"), old)
        # Before any data moves: this rank's new shards must fit on devices it has.
        check_local_devices((e.placement for e in local["target"].shards_metadata), group)
        local["have"] = match_sources(shards, old, group.global_rank)
        # Each rank's own need; the agreement makes every rank use the largest.
        local["plan"] = pl = plan(old, local["target"], group.rank, group.size, group.global_to_group())
        mine["rounds"] = pl.rounds
        return mine

    entries = group.agree(check, op="reshard", gather=True)
    target: ShardedTensorMetadata = local["target"]
    have: dict[int, torch.Tensor] = local["have"]
    check_same([e["spec"] for e in entries], "resharding spec", "every rank must reshard to the same spec")
    check_same([e["layout"] for e in entries], "tensor's layout (digest of its metadata)", SAME_TENSOR)
    rounds = _agreed_rounds([e.get("rounds") for e in entries])
    if target.shards_metadata == old.shards_metadata:
        # Same boxes on the same ranks: nothing moves, the shard tensors stay.
        kept = [
            Shard(have[j] if j in have else _empty(e, target.tensor_properties), e)
            for j, e in enumerate(target.shards_metadata)
            if e.rank == group.global_rank
        ]
        return target, kept
    return target, redistribute(shards, old, target, group, trusted=True, rounds=rounds, planned=local["plan"])


def _in_rank_order(target: ShardedTensorMetadata, old: ShardedTensorMetadata) -> ShardedTensorMetadata:
    """``target`` with its shards listed by rank, as torch's ``reshard`` lists them, unless nothing changes.

    torch keeps the metadata of a reshard to the same layout (it returns the
    tensor as it is), and otherwise fills one entry per rank in rank order.
    The sort is stable, so several shards of one rank keep the spec's order.
    """
    if target.shards_metadata == old.shards_metadata:
        return target
    shards = sorted(target.shards_metadata, key=lambda e: -1 if e.rank is None else e.rank)
    return ShardedTensorMetadata(shards, target.size, target.tensor_properties)


def _agreed_rounds(counts: list[Any]) -> int:
    """The largest round count the ranks asked for (every rank sees the same list, so all agree or all raise)."""
    for rank, count in enumerate(counts):
        if type(count) is not int or not 1 <= count <= MAX_ROUNDS:
            raise ValueError(
                f"reshard: rank {rank} sent the round count {count!r}, not an int from 1 to {MAX_ROUNDS}; "
                "every rank must run the same shardwise version"
            )
    return max(int(count) for count in counts)


def _empty(entry: ShardMetadata, props: TensorProperties) -> torch.Tensor:
    """A shard a rank may omit because it holds no element."""
    assert entry.placement is not None
    device = entry.placement.device()
    return torch.empty(entry.shard_sizes, dtype=props.dtype, device=device, requires_grad=props.requires_grad)
