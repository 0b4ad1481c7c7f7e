"""The first collective of every sharded lookup: agree on the call, and fail together.

Each rank all-gathers one int64 row: its status (0, or the kind of error
its own arguments raised), the offending id if that error was an id out of
range, the call's signature (op, sharding dim, mode, options) and the sizes
the algorithm needs from every peer. One small all-gather of rows of equal
width, so without the group's handshake it is a single MPI/gloo call.

From the rows every rank reaches the same verdict: a rank whose ids are out
of range makes every rank raise ``IndexError``; any other bad argument
raises the real error on its rank and :class:`~shardwise.errors.PeerError`
on the others; ranks that called with different options all raise
:class:`~shardwise.errors.CollectiveMismatchError`.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from shardwise import Group
from shardwise.errors import CollectiveMismatchError, PeerError
from shardwise_embedding._inputs import BadIds

__all__ = ["agree"]

_KINDS: tuple[type[Exception], ...] = (BadIds, TypeError, ValueError, NotImplementedError, IndexError)
_SIGNATURE_NAMES = ("op", "sharding dim", "mode", "per_sample_weights given", "padding_idx", "max_norm", "norm_type",
                    "scale_grad_by_freq")


def agree(
    group: Group,
    op: str,
    error: Optional[Exception],
    signature: Sequence[int],
    sizes: Sequence[int],
) -> list[list[int]]:
    """All-gather this rank's status, signature and sizes; raise on every rank if any rank failed.

    Args:
        group: The weight's group.
        op: Name for messages.
        error: This rank's argument error, or None.
        signature: Integers that must be equal on every rank (same length on all).
        sizes: Per-call sizes (same length on all ranks).

    Returns:
        Every rank's ``sizes``, in rank order.

    Raises:
        The rank's own ``error``; IndexError when a peer's ids are out of
        range; PeerError when a peer had another bad argument;
        CollectiveMismatchError when signatures differ.
    """
    width = 2 + len(signature) + len(sizes)
    status, bad = 0, 0
    if error is not None:
        status = 1 + next((i for i, kind in enumerate(_KINDS) if isinstance(error, kind)), len(_KINDS))
        bad = error.value if isinstance(error, BadIds) else 0
    mine = torch.tensor([status, bad, *signature, *sizes], dtype=torch.int64)
    if error is not None:
        mine[2:] = 0  # a failed rank's sizes are meaningless; keep the row's width only
    table = torch.empty(width * group.size, dtype=torch.int64)
    group.all_gather(mine, out=table)
    rows = table.view(group.size, width).tolist()
    if error is not None:
        raise error
    failed = [r for r, row in enumerate(rows) if row[0]]
    if failed:
        ids = [(r, rows[r][1]) for r in failed if rows[r][0] == 1]
        if ids:
            shown = ", ".join(f"id {value} on rank {r}" for r, value in ids)
            raise IndexError(f"{op}: {shown} out of range for an embedding of the sharded weight; no data was sent")
        kinds = ", ".join(
            f"rank {r} ({_KINDS[rows[r][0] - 1].__name__ if rows[r][0] <= len(_KINDS) else 'error'})"
            for r in failed
        )
        raise PeerError(f"{op}: {kinds} rejected its arguments, so no data was sent; see that rank's traceback")
    first = rows[0][2 : 2 + len(signature)]
    for r, row in enumerate(rows):
        theirs = row[2 : 2 + len(signature)]
        if theirs != first:
            which = next(i for i, (a, b) in enumerate(zip(first, theirs, strict=True)) if a != b)
            name = _SIGNATURE_NAMES[which] if which < len(_SIGNATURE_NAMES) else f"option {which}"
            raise CollectiveMismatchError(
                f"{op}: ranks 0 and {r} called with a different {name}; every rank must pass the same options"
            )
    return [row[2 + len(signature) :] for row in rows]
