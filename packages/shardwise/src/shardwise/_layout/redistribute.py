"""Executing transfer plans: one all-to-all per round, planned from box intersections.

Every layout change (``reshard``, ``shard_tensor``, ``gather``) is the same
problem: source shards and target shards are boxes of one tensor, each
placed on a rank. :func:`~shardwise._layout.plan.plan` works out, from
metadata alone, a :class:`~shardwise._layout.plan_records.TransferPlan`: which
intersection box each rank sends to each other rank, and how (sent from a
view or packed, received into a view or unpacked, how many rounds). This
module executes such plans and makes no decision of its own about them:
:func:`execute` packs the outgoing boxes into one flat send buffer
(``narrow`` + ``copy_``, no per-element Python) unless the plan says they
are sent from a view of their source (``send_view``), runs a single
``all_to_all_single`` on its bytes, and unpacks what arrives into the
targets unless the plan says it arrives into a view of its target
(``recv_view``). The only thing checked here is what a plan cannot know:
that the tensor such a view is taken of is contiguous and of the wire
dtype (else it is packed or unpacked after all). Large buffers come from
:mod:`shardwise._comm.buffers` (huge pages: a fresh 32 MiB buffer otherwise
costs more in page faults than the transfer). Boxes whose source and
target live on the same rank are copied directly and never touch the wire,
so each element crosses the wire at most once, and no rank holds more than
its own shards plus one send and one receive buffer. A target shard that
arrives whole, in order (``recv_whole``), is the receive buffer itself (no
allocation, no copy). :func:`redistribute` can also move the data in parts
(slabs of the tensor's row-major order, or every stream between two ranks
cut alike: :func:`~shardwise._layout.plan_rounds.slab_plans`), one all-to-all per
part (``rounds``; the plan says how many keep the buffers within the shard
size), which is what ``reshard`` does on more than two ranks when the
pieces are scattered; the parts' all-to-alls are asynchronous, so packing
part k+1 overlaps the transfer of part k (twice as many parts, each half
the size, the plan's bound counting every two consecutive ones).

Nothing here checks that ranks agree; the entry points that do
(``reshard``, ``gather``, ``full_tensor``, ``shard_tensor``) live in
:mod:`shardwise._tensor`.

Each plan executed is logged at DEBUG on the ``shardwise.plan`` logger
(:func:`describe`; ``SHARDWISE_LOGS=plan=debug``), once per layout change
whatever its number of rounds; the line is only built when that level is on.

The pieces it is built from live beside it: the copies between shards and
buffers (:func:`box`, packing, unpacking, the views a plan sends from or
receives into) in :mod:`shardwise._layout.packing`, the one-copy path
(:func:`read_direct`) in :mod:`shardwise._layout.direct_read`, and the
debug log's wording (:func:`describe`) in
:mod:`shardwise._layout.plan_description`; they are re-exported here.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any, Collection, Mapping, NoReturn, Optional, Sequence

import torch

from shardwise._comm import buffers
from shardwise._layout.direct_read import read_direct
from shardwise._layout.packing import box, copy_local, pack, receive_view, send_view, unpack
from shardwise._layout.plan import plan
from shardwise._layout.plan_description import describe
from shardwise._layout.plan_records import Piece, TransferPlan, row_major_start
from shardwise._layout.plan_rounds import pairs_fit, slab_plans
from shardwise._vocab.metadata import ShardedTensorMetadata
from shardwise._vocab.shard import Shard

if TYPE_CHECKING:
    from shardwise._comm.group import Group

# Piece, TransferPlan and row_major_start live in shardwise._layout.plan_records, plan in shardwise._layout.plan,
# box, copy_local, pack, receive_view, send_view and unpack in shardwise._layout.packing, read_direct in
# shardwise._layout.direct_read, describe in shardwise._layout.plan_description; re-exported for the callers here.
__all__ = [
    "Piece", "TransferPlan", "box", "describe", "execute", "executed_slabs", "match_sources", "plan", "read_direct",
    "receive_view", "redistribute", "row_major_start", "send_view",
]

_log = logging.getLogger("shardwise.plan")


# -- moving data -------------------------------------------------------------


def execute(
    pl: TransferPlan,
    sources: Mapping[int, torch.Tensor],
    targets: Mapping[int, torch.Tensor],
    group: Group,
    wire_dtype: torch.dtype,
    *,
    trusted: bool = False,
) -> Optional[torch.Tensor]:
    """Run ``pl``: local copies, then one all-to-all of bytes (skipped when no rank sends).

    ``trusted``: every rank derived its plan from metadata the ranks have
    just agreed on, so the collective's own handshake is skipped.

    Returns:
        The flat receive buffer (None when nothing moved on the wire).
    """
    if _log.isEnabledFor(logging.DEBUG):
        _log.debug("%s", describe(pl, wire_dtype))
    return _execute(pl, sources, targets, group, wire_dtype, trusted=trusted)


def _execute(
    pl: TransferPlan,
    sources: Mapping[int, torch.Tensor],
    targets: Mapping[int, torch.Tensor],
    group: Group,
    wire_dtype: torch.dtype,
    *,
    trusted: bool,
) -> Optional[torch.Tensor]:
    """:func:`execute` without the log line (a round of a plan :func:`redistribute` has logged)."""
    with torch.no_grad():
        direct = read_direct(pl, sources, targets, group, wire_dtype) if trusted and pl.needs_wire else None
        if direct is not None:
            return direct
        copy_local(pl, sources, targets, wire_dtype)
        if not pl.needs_wire:
            return None
        send = pack(pl, sources, wire_dtype, group.device)
        into = receive_view(pl, targets, wire_dtype)
        recv: torch.Tensor = _send_bytes(pl, send, into, group, wire_dtype, trusted=trusted, async_op=False)
        del send  # free the send buffer before unpacking
        flat = recv.view(wire_dtype)
        if into is None:
            unpack(pl, flat, targets)
        return flat


def _send_bytes(
    pl: TransferPlan,
    send: torch.Tensor,
    into: Optional[torch.Tensor],
    group: Group,
    wire_dtype: torch.dtype,
    *,
    trusted: bool,
    async_op: bool,
) -> Any:
    """The plan's all-to-all of bytes: ``send`` out, into ``into`` (or a new buffer); its result, or its Work."""
    size = wire_dtype.itemsize
    sizes: dict[str, Any] = {
        "output_split_sizes": [n * size for n in pl.recv_counts],
        "input_split_sizes": [n * size for n in pl.send_counts],
        "out": None if into is None else into.view(torch.uint8),
    }
    with group.unverified() if trusted else contextlib.nullcontext():
        if async_op:
            return group.all_to_all_single(send.view(torch.uint8), **sizes, async_op=True)
        return group.all_to_all_single(send.view(torch.uint8), **sizes)


def match_sources(shards: Sequence[Shard], md: ShardedTensorMetadata, rank: int) -> dict[int, torch.Tensor]:
    """Map this rank's shards to their index in ``md``.

    ``rank`` is this rank's global rank (``Group.global_rank``): placements
    name global ranks.

    Raises:
        ValueError: a shard is not in ``md`` for this rank, its tensor is not
            of its size, or a non-empty entry of ``md`` on this rank has no shard.
    """
    free: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = {}
    for i, entry in enumerate(md.shards_metadata):
        if entry.placement is not None and entry.placement.rank() == rank:
            free.setdefault((tuple(entry.shard_offsets), tuple(entry.shard_sizes)), []).append(i)
    out: dict[int, torch.Tensor] = {}
    for shard in shards:
        key = (tuple(shard.metadata.shard_offsets), tuple(shard.metadata.shard_sizes))
        if not free.get(key):
            raise ValueError(f"local shard ({shard.metadata.describe()}) on rank {rank} is not in the metadata")
        if tuple(shard.tensor.shape) != key[1]:
            # A tensor replaced or resized after construction: caught here, agreed, before any byte moves.
            raise ValueError(
                f"local shard ({shard.metadata.describe()}) on rank {rank} holds a tensor of shape "
                f"{list(shard.tensor.shape)}, not the shard's size {list(key[1])}; keep local shard tensors at "
                "their metadata's size"
            )
        # A conjugate or negative view keeps its flag beside memory that holds the plain values; every
        # path here moves memory (one copy, bytes on the wire), so the values are materialised first.
        out[free[key].pop(0)] = shard.tensor.resolve_conj().resolve_neg()
    for (_, sizes), left in free.items():
        for i in left:
            if 0 not in sizes:
                raise ValueError(f"rank {rank} has no local shard for {md.shards_metadata[i].describe()}")
    return out


def _allocate(
    md: ShardedTensorMetadata, owners: Sequence[int], rank: int, dtype: torch.dtype, skip: Collection[int]
) -> dict[int, torch.Tensor]:
    """Empty target shards for the entries of ``md`` that ``owners`` (group ranks, from the plan) give ``rank``.

    Entries in ``skip`` are left out: a receive buffer becomes them.
    """
    pin = md.tensor_properties.pin_memory and torch.cuda.is_available()
    out = {}
    for j, entry in enumerate(md.shards_metadata):
        if owners[j] == rank and j not in skip:
            assert entry.placement is not None
            device = entry.placement.device()
            if pin and device.type == "cpu":
                out[j] = torch.empty(entry.shard_sizes, dtype=dtype, device=device, pin_memory=True)
            else:
                out[j] = buffers.empty(entry.shard_sizes, dtype, device)
    return out


def redistribute(
    src_shards: list[Shard],
    src_md: ShardedTensorMetadata,
    dst_md: ShardedTensorMetadata,
    group: Group,
    *,
    dtype: Optional[torch.dtype] = None,
    trusted: bool = False,
    rounds: int = 1,
    planned: Optional[TransferPlan] = None,
) -> list[Shard]:
    """Move this rank's ``src_shards`` (laid out by ``src_md``) into the layout ``dst_md``.

    Every rank of ``group`` calls it with the same metadata. New target
    shards are allocated on their placement's device and filled by one
    all-to-all; they are leaves that require grad when
    ``dst_md.tensor_properties.requires_grad`` says so.

    Args:
        src_shards: This rank's shards of the source layout.
        src_md: The source layout (the same on every rank).
        dst_md: The target layout (the same on every rank).
        group: The group the shards live in (placements name its members' global ranks).
        dtype: Dtype of the targets (default: the source's); data is cast
            before it is sent.
        trusted: The ranks have just agreed on both layouts (skip the
            all-to-all's handshake).
        rounds: Keep the send and receive buffers that many times smaller
            than one all-to-all's (the same on every rank: the largest
            :attr:`~shardwise._layout.plan_records.TransferPlan.rounds` of the
            ranks' plans). Above 1 the data moves in twice that many
            parts (:func:`executed_slabs`), one asynchronous all-to-all
            each, the next part packed while the previous one travels.
        planned: This rank's plan from ``src_md`` to ``dst_md`` in
            ``group``, when the caller has already made it (to agree on
            ``rounds``); None: planned here.

    Returns:
        This rank's target shards, in ``dst_md`` order.

    Raises:
        ValueError: the layouts do not fit together, or ``src_shards`` do
            not match ``src_md`` on this rank (then the peers raise
            :class:`~shardwise.errors.PeerError`).
    """
    wire_dtype = dtype if dtype is not None else src_md.tensor_properties.dtype
    pl = planned if planned is not None else plan(src_md, dst_md, group.rank, group.size, group.global_to_group())
    try:
        sources = match_sources(src_shards, src_md, group.global_rank)
    except ValueError as exc:
        _fail(group, exc, pl.needs_wire)
    parts = executed_slabs(pl, rounds)
    if _log.isEnabledFor(logging.DEBUG):
        _log.debug("%s", describe(pl, wire_dtype, parts))
    # The plan says which target a receive buffer becomes (slabs never do: their targets exist up front).
    adopted = {part.recv_whole for part in parts if part.recv_whole is not None}
    targets = _allocate(dst_md, pl.dst_owner, group.rank, wire_dtype, skip=adopted)
    if trusted and len(parts) > 1 and pl.needs_wire:
        # Slabs only bound the buffers; the one-copy path has none, so it moves the whole plan at once.
        with torch.no_grad():
            if read_direct(pl, sources, targets, group, wire_dtype) is not None:
                return _leaves(targets, dst_md)
    if len(parts) > 1:
        _execute_overlapped(pl, parts, sources, targets, group, wire_dtype, trusted=trusted)
        return _leaves(targets, dst_md)
    for part in parts:
        flat = _execute(part, sources, targets, group, wire_dtype, trusted=trusted)
        if part.recv_whole is not None:
            entry = dst_md.shards_metadata[part.recv_whole]
            assert flat is not None and entry.placement is not None
            targets[part.recv_whole] = flat.view(entry.shard_sizes).to(entry.placement.device())
    return _leaves(targets, dst_md)


def executed_slabs(pl: TransferPlan, rounds: int) -> tuple[TransferPlan, ...]:
    """The part plans :func:`redistribute` runs for ``pl`` with ``rounds``: ``(pl,)``, or twice ``rounds`` parts.

    Two parts are in flight at once (:func:`_execute_overlapped`), so each is
    half the size that ``rounds`` parts would be; the plan's ``rounds``
    decision counted the buffers of every two consecutive ones of these
    (:func:`~shardwise._layout.plan_rounds.slab_plans` says how they are cut).
    """
    return (pl,) if rounds <= 1 else slab_plans(pl, rounds, 2 * rounds)


def _execute_overlapped(
    pl: TransferPlan,
    parts: Sequence[TransferPlan],
    sources: Mapping[int, torch.Tensor],
    targets: Mapping[int, torch.Tensor],
    group: Group,
    wire_dtype: torch.dtype,
    *,
    trusted: bool,
) -> None:
    """Run the part plans of ``pl`` so that packing part k+1 overlaps the transfer of part k.

    Each part's all-to-all is issued asynchronously (``async_op=True``);
    while it moves, the next part is packed, and only then is the previous
    one waited for and unpacked. Two parts' buffers are then alive at once,
    which is what the rounds decision bounds; where two consecutive parts
    do not fit the budget together (:func:`~shardwise._layout.plan_rounds.pairs_fit`:
    a round count passed in below what the plan asked for, or streams too
    short to cut), each part is finished before the next is packed. Parts
    never receive into a whole target (their targets exist up front).
    """
    overlap = pairs_fit(pl, parts)
    inflight: Optional[tuple[TransferPlan, Any, Optional[torch.Tensor]]] = None

    def finish(part: TransferPlan, work: Any, into: Optional[torch.Tensor]) -> None:
        recv = work.wait()
        if into is None:
            unpack(part, recv.view(wire_dtype), targets)

    with torch.no_grad():
        for part in parts:
            copy_local(part, sources, targets, wire_dtype)
            if not part.needs_wire:
                continue
            if inflight is not None and not overlap:
                finish(*inflight)
                inflight = None
            send = pack(part, sources, wire_dtype, group.device)  # overlaps the part in flight
            if inflight is not None:
                finish(*inflight)
                inflight = None
            into = receive_view(part, targets, wire_dtype)
            work = _send_bytes(part, send, into, group, wire_dtype, trusted=trusted, async_op=True)
            del send  # the collective holds it until done
            inflight = (part, work, into)
        if inflight is not None:
            finish(*inflight)


def _leaves(targets: Mapping[int, torch.Tensor], dst_md: ShardedTensorMetadata) -> list[Shard]:
    """The filled targets as shards in ``dst_md`` order, requiring grad as ``dst_md`` says."""
    requires_grad = dst_md.tensor_properties.requires_grad
    return [
        Shard(targets[j].requires_grad_() if requires_grad else targets[j], dst_md.shards_metadata[j])
        for j in sorted(targets)
    ]


def _fail(group: Group, exc: Exception, peers_waiting: bool) -> NoReturn:
    # Peers only wait for this rank when a collective follows.
    if peers_waiting:
        group.reject(exc)
    raise exc
