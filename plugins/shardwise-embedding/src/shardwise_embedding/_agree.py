"""The first collective of every sharded lookup: agree on the call, and fail together.

Built on :meth:`shardwise.Group.agree`, the core's one agreement: each rank
contributes its call's signature (op, sharding dim, mode, options) and the
sizes the algorithm needs from every peer, or the error its own arguments
raised. The values are small, so they travel in the agreement's handshake
row: one collective.

From what every rank contributed every rank reaches the same verdict: any
bad argument raises the real error on its rank and
:class:`~shardwise.errors.PeerError` on the others; a rank whose ids are out
of range (not a bad argument but bad data every rank must hear about) makes
every rank raise ``IndexError`` naming the id; ranks that called with
different options all raise :class:`~shardwise.errors.CollectiveMismatchError`.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from shardwise import Group, sdk
from shardwise.errors import CollectiveMismatchError, PeerError
from shardwise_embedding._inputs import BadIds

__all__ = ["agree", "agree_and_gather"]

_SIGNATURE_NAMES = ("op", "sharding dim", "mode", "per_sample_weights given", "padding_idx", "max_norm", "norm_type",
                    "scale_grad_by_freq", "weight (global size or sharding)")


def agree(
    group: Group,
    op: str,
    error: Optional[Exception],
    signature: Sequence[int],
    sizes: Sequence[int],
) -> list[list[int]]:
    """Agree on this rank's status, signature and sizes; raise on every rank if any rank failed.

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

    def check() -> Any:
        if isinstance(error, BadIds):
            return {"bad id": error.value}
        if error is not None:
            raise error
        return [list(signature), list(sizes)]

    try:
        everyone = group.agree(check, op=op, gather=True)
    except PeerError:
        # A rank with bad ids of its own raises them, whatever else failed.
        if error is not None:
            raise error from None
        raise
    bad = [(r, value["bad id"]) for r, value in enumerate(everyone) if isinstance(value, dict)]
    if error is not None:
        raise error
    if bad:
        shown = ", ".join(f"id {value} on rank {r}" for r, value in bad)
        raise IndexError(f"{op}: {shown} out of range for an embedding of the sharded weight; no data was sent")
    first = everyone[0][0]
    for r, (theirs, _) in enumerate(everyone):
        if theirs != first:
            which = next(i for i, (a, b) in enumerate(zip(first, theirs, strict=True)) if a != b)
            name = _SIGNATURE_NAMES[which] if which < len(_SIGNATURE_NAMES) else f"option {which}"
            raise CollectiveMismatchError(
                f"{op}: ranks 0 and {r} called with a different {name}; every rank must pass the same options"
            )
    return [list(row[1]) for row in everyone]


def agree_and_gather(
    group: Group,
    op: str,
    error: Optional[Exception],
    signature: Sequence[int],
    sizes: Sequence[int],
    payload: torch.Tensor,
    narrow: bool = False,
    answers: Optional[tuple[torch.Tensor, list[int]]] = None,
) -> tuple[list[list[int]], list[torch.Tensor], Optional[sdk.RoundTrip]]:
    """:func:`agree`, then all-gather a 1-D int64 ``payload`` (any length) from every rank.

    For algorithms whose first step is an all-gather anyway (column-wise).
    The agreement carries each payload's length, so the all-gather itself
    needs no handshake, and no payload moves unless every rank's call is good.

    Args:
        narrow: Every payload value fits in int32 (ids of a table of fewer
            than 2**31 rows, counts): it travels as int32, half the bytes
            (on gloo, which moves data over TCP even between local ranks, a
            MiB costs milliseconds). Every rank must pass the same value.
        answers: This rank's answer box and the elements it expects from
            each rank, when the caller's last step sends answers back: on
            one host the agreement then also carries what
            :class:`shardwise.sdk.RoundTrip` needs, the payloads are read
            straight from the peers, and the caller answers with the
            returned round trip (two rounds in all, instead of five).

    Returns:
        Every rank's ``sizes``, every rank's payload, in rank order (as
        int64; a narrowed payload may carry one zero of padding at its end,
        so callers slice it by the sizes), and the round trip (None when
        ``answers`` is None); when it is not ``bound`` (the ranks cannot
        take that path) the caller sends its answers by all-to-all, into
        the same box.
    """
    body = payload.to(torch.int64) if error is None else payload.new_empty(0, dtype=torch.int64)
    if narrow:
        small = body.to(torch.int32)
        if small.numel() % 2:
            small = torch.cat([small, small.new_zeros(1)])
        body = small.view(torch.int64)  # two int32 values per int64 word
    trip = None if answers is None else sdk.RoundTrip(group, body, answers[0], answers[1])
    fields = [] if trip is None else trip.fields
    everyone = agree(group, op, error, signature, [*sizes, body.numel(), *fields])
    tails = [row[len(row) - len(fields) :] for row in everyone]
    everyone = [row[: len(row) - len(fields)] for row in everyone]
    lengths = [row.pop() for row in everyone]
    if trip is not None and trip.bind(tails):
        bodies = list(trip.gather(body.new_empty(sum(lengths))).split(lengths))
    else:
        # The collectives' path (ranks on several hosts, CUDA, the switch off). Equal lengths let
        # every rank receive into one buffer with no sizes to agree on; the shorter payloads are
        # padded (a copy the old concatenation with the header made anyway).
        most = max(lengths)
        if body.numel() < most:
            body = torch.cat([body, body.new_zeros(most - body.numel())])
        gathered = body.new_empty(most * group.size)
        if most:
            with group.unverified():
                group.all_gather(body, out=gathered)
        bodies = [gathered[r * most : r * most + n] for r, n in enumerate(lengths)]
    if narrow:
        bodies = [b.view(torch.int32).to(torch.int64) for b in bodies]
    return everyone, bodies, trip
