"""Which shards are this rank's: sizes, placements checked against a group, and the RPC option.

Placement ranks are global ranks (ranks of the default group), as in torch
2.13; a group knows its members' global ranks (``Group.ranks``), so these
checks work the same on the world group, a subgroup and, form only, on a
rank outside the group.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

import torch

from shardwise._comm.default_group import current_default_group
from shardwise._vocab.metadata import Placement, PlacementError, ShardMetadata

__all__ = [
    "agree_on_local_devices",
    "alone_hint",
    "check_local_devices",
    "check_no_rrefs",
    "flatten_size",
    "is_local",
    "local_device",
    "off_cpu",
    "validate_placements",
]


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
            f"shard {i} ({shard.describe()}) is placed on rank {rank}, but the group has {size} rank(s) ({where})"
            f"{alone_hint(size)}: Global rank {rank} does not exist in input process group: {members}"
        )


def alone_hint(size: int) -> str:
    """What to add where a placement names a rank a group of ``size`` lacks: a group of one was probably not launched.

    A program written for N ranks and started with plain ``python`` runs as
    rank 0 of 1 (no launcher found), and its first placement on rank 1 is
    where it fails: say so, with the fix.
    """
    world = current_default_group()
    if size != 1 or (world is not None and world.size != 1):
        return ""  # a subgroup of one in a larger job: the placement is simply wrong
    return (
        "; this process runs alone (rank 0 of 1): a program that places shards on more ranks must be started "
        "by a launcher, e.g. `torchrun --nproc-per-node N prog.py` or `mpiexec -n N python prog.py`"
    )


def off_cpu(placements: Iterable[Optional[Placement]]) -> bool:
    """Whether a placement that names a rank puts its shard on a device other than the CPU.

    Only then can ranks disagree on whether the layout is usable (every
    rank has a CPU), so only then must a verb that has nothing else to
    agree on spend an agreement on :func:`check_local_devices`.
    """
    return any(p is not None and p.rank() is not None and p.device().type != "cpu" for p in placements)


def check_local_devices(placements: Iterable[Optional[Placement]], group: Any) -> None:
    """Raise unless this rank can use the device of every placement that names it.

    Run inside the agreement of each verb that makes local shards on their
    placements' devices (``shard_tensor``, ``reshard``, the creation
    functions), so a rank without the device raises the
    :class:`~shardwise._vocab.placement.PlacementError` and its peers
    :class:`~shardwise.errors.PeerError` before any data moves, instead of
    torch's ``Torch not compiled with CUDA enabled`` from the allocator
    after the peers started sending.

    Args:
        placements: Placements (None and rankless ones are skipped: no rank
            holds their data).
        group: The tensor's group; on a rank outside it nothing is checked
            (it holds no shard).

    Raises:
        PlacementError: a placement of this rank names a device it cannot
            use (a ``ValueError``; see :func:`~shardwise._vocab.placement.unusable_reason`).
    """
    if group is None or not group.is_member:
        return
    checked: set[torch.device] = set()
    for placement in placements:
        if placement is None or placement.rank() != group.global_rank or placement.device() in checked:
            continue
        placement.check_usable()
        checked.add(placement.device())


def agree_on_local_devices(placements: Sequence[Optional[Placement]], group: Any, op: str) -> None:
    """:func:`check_local_devices` on every rank at once: one agreement, when a ranked placement leaves the CPU.

    For a verb that has nothing else to agree on before it allocates
    (``ShardedTensor(...)`` and the creation functions). Every rank must
    call it with the same placements, so that all of them agree or none
    does; with CPU placements only, it does not communicate (every rank
    has a CPU), as torch's creation functions do not.

    Args:
        placements: Every shard's placement.
        group: The tensor's group (nothing happens on a rank outside it).
        op: The call, named in the peers' :class:`~shardwise.errors.PeerError`.

    Raises:
        PlacementError: a placement of this rank names a device it cannot use.
        PeerError: a placement of another rank does.
    """
    if group is None or not group.is_member or not off_cpu(placements):
        return
    group.agree(lambda: check_local_devices(placements, group), op=op)


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
