"""Moving shard data between layouts: one all-to-all planned from box intersections.

Every layout change (``reshard``, ``shard_tensor``, ``gather``) is the same
problem: source shards and target shards are boxes of one tensor, each
placed on a rank. :func:`~shardwise._layout.plan.plan` works out, from metadata alone, which
intersection box each rank sends to each other rank; :func:`redistribute`
then packs those boxes into one flat send buffer (``narrow`` + ``copy_``,
no per-element Python), runs a single ``all_to_all_single`` on its bytes
and unpacks what arrives into the targets; pieces that lie back to back in
one source or target (rows of dim-0 chunks) are sent from, or received
into, a view of it instead, with no copy. Large buffers come from
:mod:`shardwise._comm.buffers` (huge pages: a fresh 32 MiB buffer otherwise costs
more in page faults than the transfer). Boxes whose source and target
live on the same rank are copied directly and never touch the wire, so each
element crosses the wire at most once, and no rank holds more than its own
shards plus one send and one receive buffer. A target shard that arrives
whole, in order, is the receive buffer itself (no copy). ``redistribute``
can also move the data in slabs of dim 0, one all-to-all per slab
(``rounds``; :mod:`shardwise._layout.plan` says how many keep the buffers within
the shard size), which is what ``reshard`` does on more than two ranks when
the pieces are scattered.

Nothing here checks that ranks agree; the entry points that do
(``reshard``, ``gather``, ``full_tensor``, ``shard_tensor``) live in
:mod:`shardwise._tensor.scatter`.
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING, Mapping, NoReturn, Optional, Sequence

import torch

from shardwise._comm import buffers as _memory
from shardwise._vocab.metadata import ShardedTensorMetadata
from shardwise._layout.plan import Piece, Plan, plan, restrict, row_major_start, run_span, slabs
from shardwise._vocab.shard import Shard

if TYPE_CHECKING:
    from shardwise._comm.group import Group

# Piece, Plan, plan and row_major_start live in shardwise._layout.plan; re-exported for the callers here.
__all__ = ["Piece", "Plan", "plan", "receive_view", "redistribute", "row_major_start", "run_of"]


# -- moving data -------------------------------------------------------------


def box(tensor: torch.Tensor, start: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    """View of ``tensor[start : start + sizes]`` (narrowing only the dims that need it)."""
    for d, (s, n) in enumerate(zip(start, sizes, strict=True)):
        if s or n != tensor.shape[d]:
            tensor = tensor.narrow(d, s, n)
    return tensor


def copy_local(
    pl: Plan, sources: Mapping[int, torch.Tensor], targets: Mapping[int, torch.Tensor], wire_dtype: torch.dtype
) -> None:
    """Copy the pieces whose source and target are both on this rank, without the wire."""
    for p in pl.local:
        piece = box(sources[p.src], p.src_start, p.sizes)
        target = targets[p.dst]
        if piece.dtype != wire_dtype and target.dtype != wire_dtype:
            # Round through the wire dtype as the remote pieces are.
            piece = piece.to(wire_dtype)
        box(target, p.dst_start, p.sizes).copy_(piece)


def run_of(tensor: torch.Tensor, pieces: Sequence[Piece], at_src: bool, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """A flat view of ``tensor`` holding ``pieces`` back to back, when they lie that way in its memory.

    True when every piece is one row-major run of the contiguous ``tensor``
    (of ``dtype``) and each starts where the previous one ends, as the rows
    of dim-0 chunks do. Sending from, or receiving into, such a view needs
    no packing copy.

    Args:
        tensor: The source shard (``at_src``) or target shard the pieces belong to.
        pieces: The pieces, in wire order.
        at_src: Read the pieces' positions in their source (else their target).
        dtype: The wire dtype.
    """
    if not pieces or tensor.dtype != dtype or not tensor.is_contiguous():
        return None
    span = run_span(pieces, tuple(tensor.shape), at_src)
    return None if span is None else tensor.detach().reshape(-1)[span[0] : span[1]]


def pack(pl: Plan, sources: Mapping[int, torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One flat ``dtype`` buffer with the pieces for rank 0, then rank 1, ...

    Pieces that already lie back to back in one contiguous source shard of
    that dtype (a whole shard, or consecutive rows of one) are sent from a
    view of it, without a copy.
    """
    pieces = [p for per_rank in pl.send for p in per_rank]
    if pieces and all(p.src == pieces[0].src for p in pieces):
        view = run_of(sources[pieces[0].src], pieces, True, dtype)
        if view is not None:
            return view
    buf = _memory.empty((sum(p.numel for p in pieces),), dtype, device)
    pos = 0
    for p in pieces:
        buf[pos : pos + p.numel].view(p.sizes).copy_(box(sources[p.src], p.src_start, p.sizes))
        pos += p.numel
    return buf


def receive_view(pl: Plan, targets: Mapping[int, torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """A view of one target shard that the received pieces fill back to back, if there is one.

    The all-to-all then writes straight into the target (gather's ``out``,
    a reshard target whose incoming rows are consecutive): no receive
    buffer, no unpacking copy.
    """
    pieces = [p for per_rank in pl.recv for p in per_rank]
    if not pieces or any(p.dst != pieces[0].dst for p in pieces) or pieces[0].dst not in targets:
        return None
    return run_of(targets[pieces[0].dst], pieces, False, dtype)


def unpack(pl: Plan, flat: torch.Tensor, targets: Mapping[int, torch.Tensor]) -> None:
    """Copy what arrived (rank 0's pieces, then rank 1's, ...) into the targets.

    Pieces of a target missing from ``targets`` stay in ``flat`` (the caller
    adopts ``flat`` as that target, see :func:`arrives_whole`).
    """
    pos = 0
    for per_rank in pl.recv:
        for p in per_rank:
            if p.dst in targets:
                box(targets[p.dst], p.dst_start, p.sizes).copy_(flat[pos : pos + p.numel].view(p.sizes))
            pos += p.numel


def arrives_whole(pl: Plan, md: ShardedTensorMetadata) -> Optional[int]:
    """The target shard that the receive buffer holds exactly, in row-major order, if one does.

    That target need not be allocated or copied into: the buffer is it
    (shard_tensor's receivers, a shard moving whole to another rank).
    """
    pieces = [p for per_rank in pl.recv for p in per_rank]
    if not pieces or md.tensor_properties.pin_memory:
        return None
    j = pieces[0].dst
    if any(p.dst != j for p in pieces):
        return None
    sizes = md.shards_metadata[j].shard_sizes
    return j if run_span(pieces, sizes, False) == (0, math.prod(sizes)) else None


def execute(
    pl: Plan,
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
    with torch.no_grad():
        copy_local(pl, sources, targets, wire_dtype)
        if not pl.needs_wire:
            return None
        send = pack(pl, sources, wire_dtype, group.device)
        into = receive_view(pl, targets, wire_dtype)
        size = wire_dtype.itemsize
        with group.unverified() if trusted else contextlib.nullcontext():
            recv = group.all_to_all_single(
                send.view(torch.uint8),
                output_split_sizes=[n * size for n in pl.recv_counts],
                input_split_sizes=[n * size for n in pl.send_counts],
                out=None if into is None else into.view(torch.uint8),
            )
        del send  # free the send buffer before unpacking
        flat = recv.view(wire_dtype)
        if into is None:
            unpack(pl, flat, targets)
        return flat


def match_sources(shards: Sequence[Shard], md: ShardedTensorMetadata, rank: int) -> dict[int, torch.Tensor]:
    """Map this rank's shards to their index in ``md``.

    ``rank`` is this rank's global rank (``Group.global_rank``): placements
    name global ranks.

    Raises:
        ValueError: a shard is not in ``md`` for this rank, or a non-empty
            entry of ``md`` on this rank has no shard.
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
        out[free[key].pop(0)] = shard.tensor
    for (_, sizes), left in free.items():
        for i in left:
            if 0 not in sizes:
                raise ValueError(f"rank {rank} has no local shard for {md.shards_metadata[i].describe()}")
    return out


def _allocate(
    md: ShardedTensorMetadata, owners: Sequence[int], rank: int, dtype: torch.dtype, skip: Optional[int]
) -> dict[int, torch.Tensor]:
    """Empty target shards for the entries of ``md`` that ``owners`` (group ranks, from the plan) give ``rank``."""
    pin = md.tensor_properties.pin_memory and torch.cuda.is_available()
    out = {}
    for j, entry in enumerate(md.shards_metadata):
        if owners[j] == rank and j != skip:
            assert entry.placement is not None
            device = entry.placement.device()
            if pin and device.type == "cpu":
                out[j] = torch.empty(entry.shard_sizes, dtype=dtype, device=device, pin_memory=True)
            else:
                out[j] = _memory.empty(entry.shard_sizes, dtype, device)
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
        rounds: Move the data in this many slabs of dim 0, one all-to-all
            each, so that the send and receive buffers are that much
            smaller (the same on every rank; see
            :func:`shardwise._layout.plan.rounds_needed`).

    Returns:
        This rank's target shards, in ``dst_md`` order.

    Raises:
        ValueError: the layouts do not fit together, or ``src_shards`` do
            not match ``src_md`` on this rank (then the peers raise
            :class:`~shardwise.errors.PeerError`).
    """
    wire_dtype = dtype if dtype is not None else src_md.tensor_properties.dtype
    pl = plan(src_md, dst_md, group.rank, group.size, group.global_to_group())
    try:
        sources = match_sources(src_shards, src_md, group.global_rank)
    except ValueError as exc:
        _fail(group, exc, pl.needs_wire)
    rows = dst_md.size[0] if len(dst_md.size) else 0
    if rounds > 1 and rows > 1:
        targets = _allocate(dst_md, pl.dst_owner, group.rank, wire_dtype, skip=None)
        for lo, hi in slabs(rows, min(rounds, rows)):
            execute(restrict(pl, lo, hi), sources, targets, group, wire_dtype, trusted=trusted)
        return _leaves(targets, dst_md)
    whole = arrives_whole(pl, dst_md)
    targets = _allocate(dst_md, pl.dst_owner, group.rank, wire_dtype, skip=whole)
    flat = execute(pl, sources, targets, group, wire_dtype, trusted=trusted)
    if whole is not None:
        entry = dst_md.shards_metadata[whole]
        assert flat is not None and entry.placement is not None
        targets[whole] = flat.view(entry.shard_sizes).to(entry.placement.device())
    return _leaves(targets, dst_md)


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
