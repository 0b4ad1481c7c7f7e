"""Executing a transfer plan with one copy per remote piece: :func:`read_direct`.

When every rank of the group is on one host and the backend offers
cross-memory attach (:mod:`shardwise._comm.box_moves`), the pieces of a
:class:`~shardwise._layout.plan_records.TransferPlan` that change rank are
copied once, straight from the source shards into the target shards: no
packing, no send or receive buffer, no unpacking. It is the other way to
run a plan than :mod:`shardwise._layout.redistribute`'s all-to-all, which
tries it first when the plans are trusted and falls back when the ranks
decline; it is kept apart because it shares nothing with the all-to-all
path but the local copies (:func:`~shardwise._layout.packing.copy_local`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Optional

import torch

from shardwise._comm import box_moves, buffers, local_copy
from shardwise._layout.packing import copy_local
from shardwise._layout.plan_records import TransferPlan

if TYPE_CHECKING:
    from shardwise._comm.group import Group

__all__ = ["read_direct"]


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
