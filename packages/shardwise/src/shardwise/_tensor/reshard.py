"""``ShardedTensor.reshard``: re-cut a tensor by another spec in place, in one exchange.

The ranks agree on the spec and on the tensor they hold (a digest of its
metadata, as :mod:`shardwise._tensor.scatter` does for the other verbs), then move
each element once from its old owner to its new one
(:func:`shardwise._layout.redistribute.redistribute`), in as many parts as keep
every rank within twice its shard (:attr:`shardwise._layout.plan_records.TransferPlan.rounds`).
The result lists its shards by rank, as torch 2.13's ``reshard`` does.

The ranks compare the layout each built from its spec (a digest), not the
specs themselves: a spec of a user's class is known only by its ``repr``,
which may name an object's address (different in every process) or hide a
difference, and a digest costs the same at 4 096 ranks as at 2.

With grad mode on and a tensor that requires grad, the move is recorded by
autograd as torch's reshard (an all-to-all of ``torch.distributed.nn``)
records it: the new shards are not leaves, and their gradients travel back
to the old shards by the reverse move, a collective every rank runs in its
backward.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import torch

from shardwise._comm.group import Group
from shardwise._layout.plan_rounds import MAX_ROUNDS
from shardwise._layout.redistribute import match_sources, plan, redistribute
from shardwise._tensor.layout_checks import SAME_TENSOR, build_target, check_same, layout_digest, spec_text
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
        local["target"] = target = _in_rank_order(build_target(spec, old, group, "reshard"), old)
        # Grad mode must be the same everywhere: with it, every rank's backward runs the reverse move.
        local["grad"] = grad = torch.is_grad_enabled() and old.tensor_properties.requires_grad
        mine: dict[str, Any] = {"target": layout_digest(target), "spec": spec_text(spec),
                                "layout": layout_digest(old), "grad": grad}
        # Before any data moves: this rank's new shards must fit on devices it has.
        check_local_devices((e.placement for e in target.shards_metadata), group)
        local["have"] = match_sources(shards, old, group.global_rank)
        # Each rank's own need; the agreement makes every rank use the largest.
        local["plan"] = pl = plan(old, target, group.rank, group.size, group.global_to_group())
        mine["rounds"] = pl.rounds
        if grad:
            local["back"] = back = plan(target, old, group.rank, group.size, group.global_to_group())
            mine["back_rounds"] = back.rounds
        return mine

    entries = group.agree(check, op="reshard", gather=True)
    target: ShardedTensorMetadata = local["target"]
    have: dict[int, torch.Tensor] = local["have"]
    # The tensors first: a spec builds different shards from tensors of different sizes.
    check_same([e["layout"] for e in entries], "tensor's layout (digest of its metadata)", SAME_TENSOR)
    _check_same_target(entries)
    check_same([e["grad"] for e in entries], "grad mode (grad enabled and the tensor requiring grad)",
               "call reshard under torch.no_grad() on every rank or on none")
    rounds = _agreed_rounds([e.get("rounds") for e in entries])
    if target.shards_metadata == old.shards_metadata:
        # Same boxes on the same ranks: nothing moves, the shard tensors stay.
        kept = [
            Shard(have[j] if j in have else _empty(e, target.tensor_properties), e)
            for j, e in enumerate(target.shards_metadata)
            if e.rank == group.global_rank
        ]
        return target, kept
    if not local["grad"]:
        return target, redistribute(shards, old, target, group, trusted=True, rounds=rounds, planned=local["plan"])
    back_rounds = _agreed_rounds([e.get("back_rounds") for e in entries])

    def there() -> list[Shard]:
        return redistribute(shards, _no_grad(old), _no_grad(target), group, trusted=True, rounds=rounds,
                            planned=local["plan"])

    def back(grads: list[Shard]) -> list[Shard]:
        return redistribute(grads, _no_grad(target), _no_grad(old), group, trusted=True, rounds=back_rounds,
                            planned=local["back"])

    return target, _moved_with_grad(shards, target, group.global_rank, there, back)


def _check_same_target(entries: Sequence[dict[str, Any]]) -> None:
    """Raise ValueError on every rank unless every rank's spec cut the tensor into the same shards."""
    for r, entry in enumerate(entries):
        if entry["target"] != entries[0]["target"]:
            raise ValueError(
                f"ranks disagree on the resharding spec: rank 0's {entries[0]['spec']} and rank {r}'s "
                f"{entry['spec']} cut the tensor into different shards; every rank must reshard to the same spec"
            )


def _no_grad(md: ShardedTensorMetadata) -> ShardedTensorMetadata:
    """``md`` whose targets are plain tensors: inside the autograd function, autograd links them itself."""
    props = dataclasses.replace(md.tensor_properties, requires_grad=False)
    return ShardedTensorMetadata(md.shards_metadata, md.size, props)


_There = Callable[[], list[torch.Tensor]]
_Back = Callable[[Sequence[Optional[torch.Tensor]]], list[torch.Tensor]]


class _Moved(torch.autograd.Function):
    """The local shards moved to their new layout; backward moves the gradients the other way.

    ``anchor`` (an empty tensor that requires grad) puts the move in the
    graph of a rank that holds no old shard but receives new ones.
    """

    @staticmethod
    def forward(ctx: Any, there: _There, back: _Back, anchor: torch.Tensor, *old: torch.Tensor) -> tuple[Any, ...]:
        ctx.back = back
        return tuple(there())

    @staticmethod
    def backward(ctx: Any, *grads: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], ...]:
        return (None, None, None, *ctx.back(grads))


def _moved_with_grad(
    shards: list[Shard],
    target: ShardedTensorMetadata,
    global_rank: int,
    there: Callable[[], list[Shard]],
    back: Callable[[list[Shard]], list[Shard]],
) -> list[Shard]:
    """:func:`redistribute` through :class:`_Moved`: this rank's new shards, linked to ``shards`` by autograd."""
    mine = [e for e in target.shards_metadata if e.rank == global_rank]

    def forward() -> list[torch.Tensor]:
        return [shard.tensor for shard in there()]

    def backward(grads: Sequence[Optional[torch.Tensor]]) -> list[torch.Tensor]:
        filled = [Shard(_zeros(e, target.tensor_properties) if g is None else g.contiguous(), e)
                  for g, e in zip(grads, mine, strict=True)]
        by_box = {(tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes)): s.tensor for s in back(filled)}
        return [by_box[(tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes))] for s in shards]

    anchor = torch.empty(0, requires_grad=True)
    moved = _Moved.apply(forward, backward, anchor, *(s.tensor for s in shards))
    return [Shard(t, e) for t, e in zip(moved, mine, strict=True)]


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


def _zeros(entry: ShardMetadata, props: TensorProperties) -> torch.Tensor:
    """The gradient of a new shard the loss did not use, on the shard's device."""
    assert entry.placement is not None
    return torch.zeros(entry.shard_sizes, dtype=props.dtype, device=entry.placement.device())


def _empty(entry: ShardMetadata, props: TensorProperties) -> torch.Tensor:
    """A shard a rank may omit because it holds no element."""
    assert entry.placement is not None
    device = entry.placement.device()
    return torch.empty(entry.shard_sizes, dtype=props.dtype, device=device, requires_grad=props.requires_grad)
