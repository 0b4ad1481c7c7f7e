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
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any, Collection, Mapping, NoReturn, Optional, Sequence

import torch

from shardwise._comm import box_moves, buffers, local_copy
from shardwise._layout.plan import plan
from shardwise._layout.plan_records import Piece, Run, TransferPlan, row_major_start
from shardwise._layout.plan_rounds import pairs_fit, slab_plans
from shardwise._vocab.metadata import ShardedTensorMetadata
from shardwise._vocab.shard import Shard

if TYPE_CHECKING:
    from shardwise._comm.group import Group

# Piece, TransferPlan and row_major_start live in shardwise._layout.plan_records, plan in shardwise._layout.plan;
# re-exported for the callers here.
__all__ = [
    "Piece", "TransferPlan", "box", "describe", "execute", "executed_slabs", "match_sources", "plan", "read_direct",
    "receive_view", "redistribute", "row_major_start", "send_view",
]

_log = logging.getLogger("shardwise.plan")


# -- the debug log -------------------------------------------------------------


def _bytes(n: int) -> str:
    """``n`` bytes for people: ``"64 B"``, ``"1.5 KiB"``, ``"3.0 MiB"``, ``"2.0 GiB"``."""
    if n < 1024:
        return f"{n} B"
    value = n / 1024
    for unit in ("KiB", "MiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def _per_peer(counts: Sequence[int], itemsize: int) -> str:
    """``" {peer: bytes, ...}"`` for the peers with a non-zero count, or ``""``."""
    shown = ", ".join(f"{r}: {_bytes(n * itemsize)}" for r, n in enumerate(counts) if n)
    return f" {{{shown}}}" if shown else ""


def _pieces(n: int, nbytes: int = 0) -> str:
    """``"nothing"``, ``"1 piece"``, ``"3 pieces (96 B)"`` (bytes shown when ``nbytes`` is not 0)."""
    if n == 0:
        return "nothing"
    return (f"{n} piece" if n == 1 else f"{n} pieces") + (f" ({_bytes(nbytes)})" if nbytes else "")


def _how(pl: TransferPlan) -> tuple[str, str]:
    """How a one-round plan sends and receives: from/into a view, or through a buffer."""
    if pl.send_view is not None:
        sends = f"from a view of source shard {pl.send_view.shard}"
    else:
        sends = "packed into a send buffer"
    if pl.recv_whole is not None:
        receives = f"into a buffer that becomes target shard {pl.recv_whole}"
    elif pl.recv_view is not None:
        receives = f"into a view of target shard {pl.recv_view.shard}"
    else:
        receives = "into a receive buffer, then unpacked"
    return sends, receives


def describe(pl: TransferPlan, wire_dtype: torch.dtype, parts: Sequence[TransferPlan] = ()) -> str:
    """One line saying what ``pl`` moves and how: the ``shardwise.plan`` debug log's record of it.

    Args:
        pl: This rank's plan.
        wire_dtype: The dtype the data moves in (bytes are counted in it).
        parts: The plans of its rounds when it moves in parts
            (:func:`~shardwise._layout.plan_rounds.slab_plans`); empty: one round.

    Returns:
        For example ``rank 0 of 2, [8, 8] float32: keeps 1 piece (64 B); sends 1 piece {1: 64 B}
        packed into a send buffer; receives 1 piece {1: 64 B} into a view of target shard 0; 1 round,
        64 B of buffers``.
    """
    size = wire_dtype.itemsize
    rounds = tuple(parts) or (pl,)
    dtype = str(wire_dtype).replace("torch.", "")
    local = _pieces(len(pl.local), sum(p.numel for p in pl.local) * size)
    head = f"rank {pl.rank} of {pl.world_size}, {list(pl.size)} {dtype}: keeps {local}"
    if not pl.needs_wire:
        return f"{head}; no rank sends anything, so no collective"
    sent, received = sum(map(len, pl.send)), sum(map(len, pl.recv))
    sends = f"sends {_pieces(sent)}{_per_peer(pl.send_counts, size)}"
    receives = f"receives {_pieces(received)}{_per_peer(pl.recv_counts, size)}"
    peak = _bytes(max(part.buffer_numel for part in rounds) * size)
    if len(rounds) == 1:
        how_sent, how_received = _how(pl)
        sends += f" {how_sent}" if sent else ""
        receives += f" {how_received}" if received else ""
        return f"{head}; {sends}; {receives}; 1 round, {peak} of buffers"
    from_view = sum(part.send_view is not None for part in rounds)
    into_view = sum(part.recv_view is not None for part in rounds)
    cut = rounds[0].cut or "slabs"
    return (
        f"{head}; {sends}; {receives}; {len(rounds)} rounds ({cut}), at most {peak} of buffers in each; "
        f"sent from a view in {from_view} and received into one in {into_view} of them"
    )


# -- moving data -------------------------------------------------------------


def box(tensor: torch.Tensor, start: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    """View of ``tensor[start : start + sizes]`` (narrowing only the dims that need it)."""
    for d, (s, n) in enumerate(zip(start, sizes, strict=True)):
        if s or n != tensor.shape[d]:
            tensor = tensor.narrow(d, s, n)
    return tensor


def copy_local(
    pl: TransferPlan, sources: Mapping[int, torch.Tensor], targets: Mapping[int, torch.Tensor], wire_dtype: torch.dtype
) -> None:
    """Copy the pieces whose source and target are both on this rank, without the wire."""
    for p in pl.local:
        piece = box(sources[p.src], p.src_start, p.sizes)
        target = targets[p.dst]
        if piece.dtype != wire_dtype and target.dtype != wire_dtype:
            # Round through the wire dtype as the remote pieces are.
            piece = piece.to(wire_dtype)
        box(target, p.dst_start, p.sizes).copy_(piece)


def _view_of_run(tensor: torch.Tensor, run: Run, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """The flat view ``run`` of ``tensor``, if its memory is laid out as the plan assumed.

    The plan found the pieces back to back in the shard's row-major
    order; that is its memory only when the tensor is contiguous and of
    the wire ``dtype`` (the bytes sent are the wire dtype's).
    """
    if tensor.dtype != dtype or not tensor.is_contiguous():
        return None
    return tensor.detach().reshape(-1)[run.start : run.end]


def send_view(pl: TransferPlan, sources: Mapping[int, torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """The view of a source shard that holds every outgoing piece in wire order, when the plan says one does.

    Sending from it needs no send buffer and no packing copy (a whole
    shard, or consecutive rows of one).
    """
    run = pl.send_view
    return None if run is None else _view_of_run(sources[run.shard], run, dtype)


def pack(
    pl: TransferPlan, sources: Mapping[int, torch.Tensor], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """One flat ``dtype`` buffer with the pieces for rank 0, then rank 1, ...: :func:`send_view`, else a copy."""
    view = send_view(pl, sources, dtype)
    if view is not None:
        return view
    pieces = [p for per_rank in pl.send for p in per_rank]
    buf = buffers.empty((sum(p.numel for p in pieces),), dtype, device)
    pos = 0
    for p in pieces:
        buf[pos : pos + p.numel].view(p.sizes).copy_(box(sources[p.src], p.src_start, p.sizes))
        pos += p.numel
    return buf


def receive_view(pl: TransferPlan, targets: Mapping[int, torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """The view of a target shard that the received pieces fill back to back, when the plan says one does.

    The all-to-all then writes straight into the target (gather's ``out``,
    a reshard target whose incoming rows are consecutive): no receive
    buffer, no unpacking copy. None also when that target is not in
    ``targets`` (the caller adopts the receive buffer as it, see
    :attr:`~shardwise._layout.plan_records.TransferPlan.recv_whole`).
    """
    run = pl.recv_view
    if run is None or run.shard not in targets:
        return None
    return _view_of_run(targets[run.shard], run, dtype)


def unpack(pl: TransferPlan, flat: torch.Tensor, targets: Mapping[int, torch.Tensor]) -> None:
    """Copy what arrived (rank 0's pieces, then rank 1's, ...) into the targets.

    Pieces of a target missing from ``targets`` stay in ``flat`` (the caller
    adopts ``flat`` as that target, see
    :attr:`~shardwise._layout.plan_records.TransferPlan.recv_whole`).
    """
    pos = 0
    for per_rank in pl.recv:
        for p in per_rank:
            if p.dst in targets:
                box(targets[p.dst], p.dst_start, p.sizes).copy_(flat[pos : pos + p.numel].view(p.sizes))
            pos += p.numel


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


def _fits_direct(t: Optional[torch.Tensor], dtype: torch.dtype) -> bool:
    """Whether a peer may read (or write) ``t``'s memory as the plan's row-major boxes of ``dtype``."""
    return t is not None and t.dtype == dtype and t.dim() > 0 and local_copy.copyable(t)


def read_direct(
    pl: TransferPlan,
    sources: Mapping[int, torch.Tensor],
    targets: Mapping[int, torch.Tensor],
    group: Group,
    wire_dtype: torch.dtype,
) -> Optional[torch.Tensor]:
    """Run ``pl`` with one copy per remote piece, straight from the source shards into the target shards.

    When every rank of ``group`` is on this host and the backend offers it
    (:mod:`shardwise._comm.box_moves`), each piece that changes rank is
    copied once by cross-memory attach, read by its receiver or written by
    its sender (cut between them so the ranks' work is even): no packing,
    no send or receive buffer, no unpacking, whatever the plan's views say.
    Collective; every rank takes this path or none. The caller guarantees
    that the ranks' plans fit together (``trusted``).

    The local pieces are copied too, once the ranks have agreed and while
    the peers copy: a scatter's root copies its own piece in the time the
    others get theirs, instead of before they may start.

    Returns:
        The adopted target's flat memory when ``pl.recv_whole`` is not in
        ``targets`` (allocated here), else an empty tensor; None when the
        ranks declined (nothing moved, not even the local pieces: take the
        all-to-all).
    """
    if not local_copy.usable(group):
        return None
    item = wire_dtype.itemsize
    sending = {p.src for per in pl.send for p in per}
    receiving = {p.dst for per in pl.recv for p in per}
    ok = all(_fits_direct(sources.get(j), wire_dtype) for j in sending)
    ok = ok and all(j in targets or j == pl.recv_whole for j in receiving)
    ok = ok and all(_fits_direct(targets[j], wire_dtype) for j in receiving if j in targets)
    boxes: list[box_moves.BoxMove] = []
    nbytes = runs = 0
    for peer_pieces, incoming in ((pl.recv, True), (pl.send, False)):
        for peer, per in enumerate(peer_pieces):
            for p in per:
                ok = ok and len(p.sizes) > 0
                run = box_moves.run_bytes(pl.src_shapes[p.src], pl.dst_shapes[p.dst], p.sizes, item)
                nbytes, runs = nbytes + p.numel * item, runs + (p.numel * item // run if run else 0)
                src_rank, dst_rank = (peer, pl.rank) if incoming else (pl.rank, peer)
                boxes.append(
                    box_moves.BoxMove(
                        src_rank, dst_rank, p.src, pl.src_shapes[p.src], p.src_start,
                        p.dst, pl.dst_shapes[p.dst], p.dst_start, p.sizes,
                    )
                )  # fmt: skip
    # Many tiny runs (a narrow column box) cost an iovec each: the all-to-all packs them faster.
    ok = ok and (runs == 0 or nbytes // runs >= box_moves.MIN_RUN_BYTES)
    # Peers write into this rank's targets, so they exist before the ranks agree (freed if they decline).
    adopted: dict[int, torch.Tensor] = {}
    if ok and pl.recv_whole is not None and pl.recv_whole in receiving and pl.recv_whole not in targets:
        adopted[pl.recv_whole] = buffers.empty(pl.dst_shapes[pl.recv_whole], wire_dtype, torch.device("cpu"))
    published = {j: sources[j] for j in sending} if ok else {}
    written = {j: targets[j] if j in targets else adopted[j] for j in receiving} if ok else {}
    local_bytes = sum(p.numel for p in pl.local) * item
    local_runs = sum(
        p.numel * item // box_moves.run_bytes(pl.src_shapes[p.src], pl.dst_shapes[p.dst], p.sizes, item)
        for p in pl.local
        if p.numel
    )
    if not box_moves.move_boxes(
        group,
        ok,
        published,
        written,
        (len(pl.src_owner), len(pl.dst_owner)),
        boxes,
        item,
        (local_bytes, local_runs),
        lambda: copy_local(pl, sources, targets, wire_dtype),
    ):
        return None
    if pl.recv_whole is not None and pl.recv_whole in adopted:
        return adopted[pl.recv_whole].view(-1)
    return torch.empty(0, dtype=wire_dtype, device="cpu")


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
