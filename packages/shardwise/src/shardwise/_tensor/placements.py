"""Which shards are this rank's: sizes, placements checked against a group, and the RPC option.

Placement ranks are global ranks (ranks of the default group), as in torch
2.13; a group knows its members' global ranks (``Group.ranks``), so these
checks work the same on the world group, a subgroup and, form only, on a
rank outside the group.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from shardwise._vocab.metadata import PlacementError, ShardMetadata

__all__ = ["check_no_rrefs", "flatten_size", "is_local", "local_device", "validate_placements"]


def flatten_size(size: Sequence[Any]) -> torch.Size:
    """``(2, 3)``, ``((2, 3),)`` or ``(torch.Size([2, 3]),)`` -> ``torch.Size([2, 3])``."""
    if len(size) == 1 and isinstance(size[0], (list, tuple, torch.Size)):
        size = tuple(size[0])
    out = []
    for s in size:
        if isinstance(s, bool) or not isinstance(s, int):
            raise TypeError(f"size must be a sequence of ints, got {tuple(size)!r}")
        if s < 0:
            raise ValueError(f"size must not be negative, got {tuple(size)!r}")
        out.append(int(s))
    return torch.Size(out)


def validate_placements(shards: Sequence[ShardMetadata], group: Any, *, need_rank: bool = False) -> None:
    """Raise unless every shard's placement names a member of ``group`` (or no rank at all).

    Placement ranks are global ranks (ranks of the default group), as in
    torch; each must belong to the group. As in torch, a placement without
    a rank (``"cpu"``) is accepted, and means a shard no rank holds; on a
    rank outside the group (``group.is_member`` False) the members are
    unknown, so only the form is checked there.

    Args:
        shards: The shards.
        group: The tensor's :class:`~shardwise.Group`, or a group size (the
            world's first ranks).
        need_rank: Refuse placements without a rank (data must move to them).

    Raises:
        ValueError: a shard has no placement, names a rank outside the
            group (naming the shard; the message carries torch's wording),
            or, with ``need_rank``, names no rank.
        PlacementError: a placement names an RPC worker (shardwise has no RPC).
    """
    size = group if isinstance(group, int) else group.size
    member = isinstance(group, int) or group.is_member
    to_group = None if isinstance(group, int) else group.global_to_group()
    for i, shard in enumerate(shards):
        placement = shard.placement
        if placement is None:
            raise ValueError(f"shard {i} ({shard.describe()}) has no placement; give it 'rank:R/DEVICE'")
        if placement.worker_name() is not None:
            raise PlacementError(
                f"shard {i} ({shard.describe()}) names the RPC worker {placement.worker_name()!r}; shardwise does "
                "not support torch RPC, name a global rank instead ('rank:R/DEVICE'): RPC framework needs to be "
                f"initialized for using worker names: {placement.worker_name()}"
            )
        rank = placement.rank()
        if rank is None:
            if need_rank:
                raise ValueError(
                    f"shard {i} ({shard.describe()}) is placed on {placement}, which names no rank, so no rank "
                    "could hold its data; place it on 'rank:R/DEVICE'"
                )
            continue
        if not member or (rank in to_group if to_group is not None else rank < size):
            continue
        members = list(group.ranks) if not isinstance(group, int) else list(range(size))
        where = f"0..{size - 1}" if to_group is None else f"global ranks {members}; placements name global ranks"
        raise ValueError(
            f"shard {i} ({shard.describe()}) is placed on rank {rank}, but the group has {size} rank(s) ({where}): "
            f"Global rank {rank} does not exist in input process group: {members}"
        )


def is_local(shard: ShardMetadata, group: Any) -> bool:
    """Whether this rank holds ``shard``: its placement names this rank's global rank."""
    return (
        group is not None
        and group.is_member
        and shard.placement is not None
        and shard.placement.rank() == group.global_rank
    )


def local_device(shards: Sequence[ShardMetadata], group: Any) -> torch.device:
    """The device of this rank's first shard (the CPU when it holds none)."""
    for shard in shards:
        if is_local(shard, group):
            assert shard.placement is not None
            return shard.placement.device()
    return torch.device("cpu")


def check_no_rrefs(init_rrefs: bool) -> None:
    if init_rrefs:
        raise NotImplementedError(
            "init_rrefs=True (torch RPC remote shards) is not supported by shardwise, which has no RPC; pass "
            "init_rrefs=False (torch: RPC Framework needs to be initialized for init_rrefs=True)"
        )
