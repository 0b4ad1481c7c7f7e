"""Moving shard data between layouts: one all-to-all planned from box intersections.

Every layout change (``reshard``, ``shard_tensor``, ``gather``) is the same
problem: source shards and target shards are boxes of one tensor, each
placed on a rank. :func:`plan` works out, from metadata alone, which
intersection box each rank sends to each other rank; :func:`redistribute`
then packs those boxes into one flat send buffer (``narrow`` + ``copy_``,
no per-element Python), runs a single ``all_to_all_single`` on its bytes
and unpacks what arrives into the targets; pieces that lie back to back in
one source or target (rows of dim-0 chunks) are sent from, or received
into, a view of it instead, with no copy. Large buffers come from
:mod:`shardwise._memory` (huge pages: a fresh 32 MiB buffer otherwise costs
more in page faults than the transfer). Boxes whose source and target
live on the same rank are copied directly and never touch the wire, so each
element crosses the wire at most once, and no rank holds more than its own
shards plus one send and one receive buffer. A target shard that arrives
whole, in order, is the receive buffer itself (no copy).

Nothing here checks that ranks agree; the entry points that do
(``reshard``, ``gather``, ``full_tensor``, ``shard_tensor``) live in
:mod:`shardwise._scatter`.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, NoReturn, Optional, Sequence

import torch

from shardwise import _memory
from shardwise._metadata import ShardMetadata, ShardedTensorMetadata
from shardwise.sharded_tensor._shard import Shard

if TYPE_CHECKING:
    from shardwise._group import Group

__all__ = ["Piece", "Plan", "plan", "receive_view", "redistribute", "row_major_start", "run_of"]


@dataclass(frozen=True)
class Piece:
    """One box of the tensor that moves from a source shard to a target shard.

    Attributes:
        src: Index of the source shard in the source metadata.
        dst: Index of the target shard in the target metadata.
        offsets: Start of the box in the whole tensor.
        sizes: Size of the box.
        src_start: Start of the box inside the source shard.
        dst_start: Start of the box inside the target shard.
        numel: Number of elements in the box.
    """

    src: int
    dst: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    src_start: tuple[int, ...]
    dst_start: tuple[int, ...]
    numel: int


@dataclass(frozen=True)
class Plan:
    """What one rank copies locally, sends and receives in a redistribution.

    ``send[r]`` and ``recv[r]`` list pieces in (target index, source index)
    order, which is the order rank r packs and unpacks them in, so sender
    and receiver agree without exchanging anything. ``send[rank]`` and
    ``recv[rank]`` are empty: those pieces are in ``local``.

    Attributes:
        rank: The rank this plan is for.
        world_size: Number of ranks.
        local: Pieces whose source and target are both on ``rank``.
        send: Per destination rank, the pieces ``rank`` sends there.
        recv: Per source rank, the pieces ``rank`` receives from there.
        needs_wire: Whether any rank (not only this one) sends anything;
            the same on every rank, so all skip the collective together.
    """

    rank: int
    world_size: int
    local: tuple[Piece, ...]
    send: tuple[tuple[Piece, ...], ...]
    recv: tuple[tuple[Piece, ...], ...]
    needs_wire: bool

    @property
    def send_counts(self) -> list[int]:
        """Elements sent to each rank."""
        return [sum(p.numel for p in pieces) for pieces in self.send]

    @property
    def recv_counts(self) -> list[int]:
        """Elements received from each rank."""
        return [sum(p.numel for p in pieces) for pieces in self.recv]


def _piece(a: ShardMetadata, i: int, b: ShardMetadata, j: int) -> Optional[Piece]:
    """The box shared by source shard ``a`` (index i) and target shard ``b`` (index j)."""
    offsets, sizes, a_start, b_start = [], [], [], []
    numel = 1
    for ao, asz, bo, bsz in zip(a.shard_offsets, a.shard_sizes, b.shard_offsets, b.shard_sizes, strict=True):
        lo = ao if ao > bo else bo
        hi = min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        offsets.append(lo)
        sizes.append(hi - lo)
        a_start.append(lo - ao)
        b_start.append(lo - bo)
        numel *= hi - lo
    return Piece(i, j, tuple(offsets), tuple(sizes), tuple(a_start), tuple(b_start), numel)


def _ranks(shards: Sequence[ShardMetadata], ndim: int, what: str) -> list[int]:
    ranks = []
    for i, shard in enumerate(shards):
        if shard.placement is None:
            raise ValueError(f"{what} shard {i} ({shard.describe()}) has no placement")
        if len(shard.shard_offsets) != ndim:
            raise ValueError(f"{what} shard {i} ({shard.describe()}) has {len(shard.shard_offsets)} dims, not {ndim}")
        ranks.append(shard.placement.rank())
    return ranks


def plan(
    src_md: ShardedTensorMetadata, dst_md: ShardedTensorMetadata, rank: int, world_size: Optional[int] = None
) -> Plan:
    """Work out, from metadata only, what ``rank`` copies, sends and receives.

    Both metadata must describe valid layouts (non-overlapping shards that
    cover the tensor) of the same tensor size; empty shards are skipped.

    Args:
        src_md: The layout the data is in.
        dst_md: The layout the data must end up in.
        rank: The rank to plan for.
        world_size: Number of ranks (default: one more than the highest
            placement rank).

    Returns:
        The :class:`Plan`.

    Raises:
        ValueError: the sizes differ, a shard has no placement or the wrong
            number of dims, or a placement is outside ``world_size``.
    """
    if list(src_md.size) != list(dst_md.size):
        raise ValueError(f"source size {list(src_md.size)} and target size {list(dst_md.size)} differ")
    src, dst = src_md.shards_metadata, dst_md.shards_metadata
    ndim = len(src_md.size)
    src_rank, dst_rank = _ranks(src, ndim, "source"), _ranks(dst, ndim, "target")
    highest = max(src_rank + dst_rank, default=0)
    world = highest + 1 if world_size is None else world_size
    if highest >= world:
        raise ValueError(f"a shard is placed on rank {highest}, outside a group of {world} rank(s)")
    src_live = [i for i, s in enumerate(src) if s.numel() > 0]
    src_mine = [i for i in src_live if src_rank[i] == rank]
    local: list[Piece] = []
    send: list[list[Piece]] = [[] for _ in range(world)]
    recv: list[list[Piece]] = [[] for _ in range(world)]
    for j, target in enumerate(dst):
        if target.numel() == 0:
            continue
        to = dst_rank[j]
        # Only intersections with this rank at one end concern it.
        for i in src_live if to == rank else src_mine:
            piece = _piece(src[i], i, target, j)
            if piece is None:
                continue
            frm = src_rank[i]
            if frm == to:
                local.append(piece)
            elif to == rank:
                recv[frm].append(piece)
            else:
                send[to].append(piece)
    needs_wire = any(send) or any(recv)
    if not needs_wire:
        needs_wire = _any_remote(src, src_rank, src_live, dst, dst_rank)
    return Plan(rank, world, tuple(local), tuple(map(tuple, send)), tuple(map(tuple, recv)), needs_wire)


def _any_remote(
    src: Sequence[ShardMetadata],
    src_rank: list[int],
    src_live: list[int],
    dst: Sequence[ShardMetadata],
    dst_rank: list[int],
) -> bool:
    """Whether any pair of ranks exchanges data (this rank's own pairs have none)."""
    for j, target in enumerate(dst):
        if target.numel() == 0:
            continue
        for i in src_live:
            if src_rank[i] != dst_rank[j] and _piece(src[i], i, target, j) is not None:
                return True
    return False


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
    first = pos = -1
    for p in pieces:
        start = row_major_start(p.src_start if at_src else p.dst_start, p.sizes, tuple(tensor.shape))
        if start is None or (pos >= 0 and start != pos):
            return None
        if first < 0:
            first = pos = start
        pos += p.numel
    return tensor.detach().reshape(-1)[first:pos]


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
    sizes = md.shards_metadata[j].shard_sizes
    pos = 0
    for p in pieces:
        if p.dst != j or row_major_start(p.dst_start, p.sizes, sizes) != pos:
            return None
        pos += p.numel
    return j if pos == math.prod(sizes) else None


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


def _allocate(md: ShardedTensorMetadata, rank: int, dtype: torch.dtype, skip: Optional[int]) -> dict[int, torch.Tensor]:
    pin = md.tensor_properties.pin_memory and torch.cuda.is_available()
    out = {}
    for j, entry in enumerate(md.shards_metadata):
        if entry.placement is not None and entry.placement.rank() == rank and j != skip:
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
        group: The group the shards' placements refer to.
        dtype: Dtype of the targets (default: the source's); data is cast
            before it is sent.
        trusted: The ranks have just agreed on both layouts (skip the
            all-to-all's handshake).

    Returns:
        This rank's target shards, in ``dst_md`` order.

    Raises:
        ValueError: the layouts do not fit together, or ``src_shards`` do
            not match ``src_md`` on this rank (then the peers raise
            :class:`~shardwise.errors.PeerError`).
    """
    wire_dtype = dtype if dtype is not None else src_md.tensor_properties.dtype
    pl = plan(src_md, dst_md, group.rank, group.size)
    try:
        sources = match_sources(src_shards, src_md, group.rank)
    except ValueError as exc:
        _fail(group, exc, pl.needs_wire)
    whole = arrives_whole(pl, dst_md)
    targets = _allocate(dst_md, group.rank, wire_dtype, skip=whole)
    flat = execute(pl, sources, targets, group, wire_dtype, trusted=trusted)
    if whole is not None:
        entry = dst_md.shards_metadata[whole]
        assert flat is not None and entry.placement is not None
        targets[whole] = flat.view(entry.shard_sizes).to(entry.placement.device())
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


def row_major_start(offsets: Sequence[int], sizes: Sequence[int], full: Sequence[int]) -> Optional[int]:
    """Flat index where box ``(offsets, sizes)`` starts in a row-major tensor of size ``full``.

    Returns None unless the box is one contiguous run of that tensor's
    memory: leading dims of size 1, then one dim of any extent, then dims
    spanned whole. An empty box starts where its offsets point, so empty
    trailing chunks line up with the end of the tensor.
    """
    start = 0
    for o, n in zip(offsets, full, strict=True):
        start = start * n + o
    if math.prod(sizes) == 0:
        return start
    ndim = len(full)
    # From the last dim backwards, dims spanned whole; then one free dim; then size-1 dims.
    d = ndim - 1
    while d >= 0 and offsets[d] == 0 and sizes[d] == full[d]:
        d -= 1
    d -= 1
    while d >= 0:
        if sizes[d] != 1:
            return None
        d -= 1
    return start
