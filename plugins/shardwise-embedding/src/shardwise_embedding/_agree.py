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

__all__ = ["agree", "agree_and_gather"]

_KINDS: tuple[type[Exception], ...] = (BadIds, TypeError, ValueError, NotImplementedError, IndexError)
_SIGNATURE_NAMES = ("op", "sharding dim", "mode", "per_sample_weights given", "padding_idx", "max_norm", "norm_type",
                    "scale_grad_by_freq", "weight (global size or sharding)")


def _header(error: Optional[Exception], signature: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    # On the CPU whatever device the lookup runs on: the group stages it if it must, and every
    # rank reads the rows back as Python ints anyway.
    status, bad = 0, 0
    if error is not None:
        status = 1 + next((i for i, kind in enumerate(_KINDS) if isinstance(error, kind)), len(_KINDS))
        bad = error.value if isinstance(error, BadIds) else 0
        # A failed rank's signature and sizes are meaningless; only the row's width matters.
        return torch.tensor([status, bad] + [0] * (len(signature) + len(sizes)), dtype=torch.int64, device="cpu")
    return torch.tensor([status, bad, *signature, *sizes], dtype=torch.int64, device="cpu")


def _verdict(rows: list[list[int]], op: str, error: Optional[Exception], width: int) -> list[list[int]]:
    """Raise on every rank if any rank failed or the signatures differ; else every rank's sizes."""
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
    first = rows[0][2 : 2 + width]
    for r, row in enumerate(rows):
        theirs = row[2 : 2 + width]
        if theirs != first:
            which = next(i for i, (a, b) in enumerate(zip(first, theirs, strict=True)) if a != b)
            name = _SIGNATURE_NAMES[which] if which < len(_SIGNATURE_NAMES) else f"option {which}"
            raise CollectiveMismatchError(
                f"{op}: ranks 0 and {r} called with a different {name}; every rank must pass the same options"
            )
    return [row[2 + width :] for row in rows]


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
    mine = _header(error, signature, sizes)
    table = mine.new_empty(mine.numel() * group.size)
    group.all_gather(mine, out=table)
    return _verdict(table.view(group.size, -1).tolist(), op, error, len(signature))


def agree_and_gather(
    group: Group,
    op: str,
    error: Optional[Exception],
    signature: Sequence[int],
    sizes: Sequence[int],
    payload: torch.Tensor,
    narrow: bool = False,
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """:func:`agree`, and all-gather a 1-D int64 ``payload`` (any length) in the same collective.

    For algorithms whose first step is an all-gather anyway (column-wise):
    one collective both agrees on the call and moves the data.

    Args:
        narrow: Every payload value fits in int32 (ids of a table of fewer
            than 2**31 rows, counts): it travels as int32, half the bytes
            (on gloo, which moves data over TCP even between local ranks, a
            MiB costs milliseconds). Every rank must pass the same value.

    Returns:
        Every rank's ``sizes`` and every rank's payload, in rank order (as
        int64; a narrowed payload may carry one zero of padding at its end,
        so callers slice it by the sizes).
    """
    head = _header(error, signature, sizes)
    body = payload.to(torch.int64) if error is None else payload.new_empty(0, dtype=torch.int64)
    if narrow:
        small = body.to(torch.int32)
        if small.numel() % 2:
            small = torch.cat([small, small.new_zeros(1)])
        body = small.view(torch.int64)  # two int32 values per int64 word
    # The payload's device (the ids', a GPU's for a CUDA lookup) carries the header too.
    pieces = group.all_gather(torch.cat([head.to(body.device), body]))
    rows = [piece[: head.numel()].tolist() for piece in pieces]
    sizes_of_all = _verdict(rows, op, error, len(signature))
    bodies = [piece[head.numel() :] for piece in pieces]
    if narrow:
        bodies = [b.view(torch.int32).to(torch.int64) for b in bodies]
    return sizes_of_all, bodies
