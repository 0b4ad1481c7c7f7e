"""The transfer plan's records: :class:`Piece`, :class:`Run` and :class:`TransferPlan`, and their decisions.

A :class:`TransferPlan` is the frozen record of one rank's part of a layout
change: the boxes (:class:`Piece`) it copies locally, sends and receives,
and the decisions about how they move (``send_view``, ``recv_view`` and
``recv_whole``, each a :class:`Run` or a shard index; ``rounds``). The view
decisions depend only on the pieces and the shard shapes, so they are made
in one place, :func:`_decided`, for a whole plan
(:func:`~shardwise._layout.plan.plan`) and for every part it is cut into
(:mod:`~shardwise._layout.plan_rounds`) alike.

Kept apart from the planning (:mod:`~shardwise._layout.plan`) and from the
cutting into rounds (:mod:`~shardwise._layout.plan_rounds`): both build
plans through :func:`_decided`, so the records are the layer below them
both, and the executor (:mod:`~shardwise._layout.redistribute`) reads them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

__all__ = ["Piece", "Run", "TransferPlan", "row_major_start", "run_span"]


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
class Run:
    """A stretch ``[start, end)`` of one shard's row-major memory that a rank's pieces fill back to back.

    Attributes:
        shard: Index of the shard (source or target, as the field holding
            the run says) in its metadata.
        start: Flat index of the first element.
        end: Flat index one past the last element.
    """

    shard: int
    start: int
    end: int


@dataclass(frozen=True)
class TransferPlan:
    """What one rank copies locally, sends and receives in a layout change, and how.

    ``send[r]`` and ``recv[r]`` list pieces in (target index, source index)
    order, which is the order rank r packs and unpacks them in, so sender
    and receiver agree without exchanging anything. ``send[rank]`` and
    ``recv[rank]`` are empty: those pieces are in ``local``.

    The decision fields are made once, by
    :func:`~shardwise._layout.plan.plan` (or
    :func:`~shardwise._layout.plan_rounds.restrict` for a slab), from the
    shard shapes; the executor and the memory bound both read them and
    never work them out again.

    Attributes:
        rank: The rank this plan is for.
        world_size: Number of ranks.
        local: Pieces whose source and target are both on ``rank``.
        send: Per destination rank, the pieces ``rank`` sends there.
        recv: Per source rank, the pieces ``rank`` receives from there.
        needs_wire: Whether any rank (not only this one) sends anything;
            the same on every rank, so all skip the collective together.
        src_owner: The group rank holding each source shard.
        dst_owner: The group rank holding each target shard.
        size: Size of the whole tensor.
        src_shapes: Size of each source shard (for cutting into slabs).
        dst_shapes: Size of each target shard.
        send_view: Where every outgoing piece lies, back to back in wire
            order, in one source shard: sent from a view of it, not packed
            (None: packed into a send buffer).
        recv_view: Where every incoming piece goes, back to back in wire
            order, in one target shard: received into a view of it, not
            unpacked (None: received into a buffer and unpacked).
        recv_whole: The target shard that ``recv_view`` covers exactly,
            when the receive buffer may itself become that shard (it is not
            pinned, and the plan is not a slab of a larger one, whose targets
            exist before the first round); else None.
        rounds: Fewest rounds (1; up to
            :data:`~shardwise._layout.plan_rounds.ROW_MAJOR_ROUNDS`: slabs
            of row-major order; from
            :data:`~shardwise._layout.plan_rounds.STREAM_ROUNDS` to
            :data:`~shardwise._layout.plan_rounds.MAX_ROUNDS`, a power of
            two: cut streams) in which the buffers of any two consecutive
            parts of the ``2 * rounds`` that execution runs
            (:func:`~shardwise._layout.plan_rounds.slab_plans`) hold at most
            as many elements as this rank's larger shard (source or
            target), as far as any cut can (the note on single elements of
            :mod:`~shardwise._layout.plan_rounds`); 1 for a slab. Ranks may
            need different counts: the caller agrees on the largest, which
            keeps each rank within its bound too.
        cut: How this plan was cut out of a larger one, for the log:
            ``""`` (it was not), ``"dim-0 slabs"``, ``"row-major slabs"`` or
            ``"cut streams"``. Not compared: a slab equal to its plan is it.
    """

    rank: int
    world_size: int
    local: tuple[Piece, ...]
    send: tuple[tuple[Piece, ...], ...]
    recv: tuple[tuple[Piece, ...], ...]
    needs_wire: bool
    src_owner: tuple[int, ...]
    dst_owner: tuple[int, ...]
    size: tuple[int, ...]
    src_shapes: tuple[tuple[int, ...], ...]
    dst_shapes: tuple[tuple[int, ...], ...]
    send_view: Optional[Run]
    recv_view: Optional[Run]
    recv_whole: Optional[int]
    rounds: int
    cut: str = field(default="", compare=False)

    @property
    def send_counts(self) -> list[int]:
        """Elements sent to each rank."""
        return [sum(p.numel for p in pieces) for pieces in self.send]

    @property
    def recv_counts(self) -> list[int]:
        """Elements received from each rank."""
        return [sum(p.numel for p in pieces) for pieces in self.recv]

    @property
    def packed_numel(self) -> int:
        """Elements copied into a send buffer (0 when sent from a view)."""
        return 0 if self.send_view is not None else sum(p.numel for per in self.send for p in per)

    @property
    def unpacked_numel(self) -> int:
        """Elements received into a buffer of their own and copied out of it (0 when received into a view)."""
        return 0 if self.recv_view is not None else sum(p.numel for per in self.recv for p in per)

    @property
    def buffer_numel(self) -> int:
        """Elements of the send and receive buffers this plan's all-to-all holds at once, beyond the shards.

        A receive buffer that becomes a whole target shard (``recv_whole``)
        counts as that shard, not as a buffer.
        """
        return self.packed_numel + self.unpacked_numel


# -- the decisions -------------------------------------------------------------


def _decided(
    rank: int,
    world: int,
    local: tuple[Piece, ...],
    send: tuple[tuple[Piece, ...], ...],
    recv: tuple[tuple[Piece, ...], ...],
    needs_wire: bool,
    src_owner: tuple[int, ...],
    dst_owner: tuple[int, ...],
    size: tuple[int, ...],
    src_shapes: tuple[tuple[int, ...], ...],
    dst_shapes: tuple[tuple[int, ...], ...],
    *,
    may_adopt: bool,
    cut: str = "",
) -> TransferPlan:
    """A one-round plan of these pieces with its view decisions made (the one place they are made)."""
    send_view = _run([p for per in send for p in per], src_shapes, True)
    recv_view = _run([p for per in recv for p in per], dst_shapes, False)
    whole = None
    if may_adopt and recv_view is not None and recv_view.start == 0:
        if recv_view.end == math.prod(dst_shapes[recv_view.shard]):
            whole = recv_view.shard
    return TransferPlan(
        rank, world, local, send, recv, needs_wire, src_owner, dst_owner, size, src_shapes, dst_shapes,
        send_view, recv_view, whole, 1, cut,
    )


def _run(pieces: Sequence[Piece], shapes: Sequence[Sequence[int]], at_src: bool) -> Optional[Run]:
    """Where ``pieces`` lie back to back in one shard of ``shapes``, or None (also for no pieces)."""
    if not pieces:
        return None
    index = pieces[0].src if at_src else pieces[0].dst
    if any((p.src if at_src else p.dst) != index for p in pieces):
        return None
    span = run_span(pieces, shapes[index], at_src)
    return None if span is None else Run(index, span[0], span[1])


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


def run_span(pieces: Sequence[Piece], shape: Sequence[int], at_src: bool) -> Optional[tuple[int, int]]:
    """Start and end (flat, row-major) of ``pieces`` if they lie back to back in a tensor of ``shape``.

    Args:
        pieces: The pieces, in wire order, all of one source (``at_src``)
            or one target shard of size ``shape``.
        shape: That shard's size.
        at_src: Read the pieces' positions in their source (else their target).

    Returns:
        ``(first, end)`` flat indices, or None when a piece is not one
        contiguous run or does not start where the previous one ended.
    """
    first = pos = -1
    for p in pieces:
        start = row_major_start(p.src_start if at_src else p.dst_start, p.sizes, shape)
        if start is None or (pos >= 0 and start != pos):
            return None
        if first < 0:
            first = pos = start
        pos += p.numel
    return None if first < 0 else (first, pos)
