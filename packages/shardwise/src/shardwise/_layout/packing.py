"""The copies between shards and flat wire buffers that executing a transfer plan is made of.

A :class:`~shardwise._layout.plan_records.TransferPlan` names boxes of
source and target shards; these functions copy them: :func:`box` views one,
:func:`copy_local` copies the pieces that stay on this rank, :func:`pack`
lays the outgoing pieces back to back in one send buffer (or returns the
:func:`send_view` the plan says holds them already), and :func:`unpack`
copies what arrived into the targets (unless it arrived straight into the
:func:`receive_view` the plan names). The only thing checked here is what a
plan cannot know: that the tensor such a view is taken of is contiguous and
of the wire dtype. They move no byte between ranks: the collectives that do
are in :mod:`shardwise._layout.redistribute` (the all-to-all) and
:mod:`shardwise._layout.direct_read` (one copy by cross-memory attach).
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import torch

from shardwise._comm import buffers
from shardwise._layout.plan_records import Run, TransferPlan

__all__ = ["box", "copy_local", "pack", "receive_view", "send_view", "unpack"]


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
