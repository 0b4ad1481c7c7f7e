"""The group's collectives by one copy between ranks on one host (the mechanism: :mod:`shardwise._comm.local_copy`).

``all_to_all``, ``scatter``, ``gather``, ``all_gather`` and ``broadcast`` of a backend
(``Group._all_to_all``... on gloo's CPU groups and the mpi plugin's, through
the SDK) try these first: each rank publishes the address of what it sends in
the call's first all-gather, and each receiver reads its pieces straight from
the senders' memory into its output (:func:`shardwise._comm.local_copy.transfer`).
Each returns False, on every rank alike, to send the call down the backend's
own path. Collectives whose sizes every rank knows and that move less than
:data:`MIN_BYTES` in all keep that path without trying: two small
all-gathers cost more than the backend's one call there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch

from shardwise._comm import cross_memory, local_copy
from shardwise._comm.local_copy import Copy
from shardwise._vocab.wire import shares_memory

if TYPE_CHECKING:
    from shardwise._comm.group import Group

__all__ = ["MIN_BROADCAST_BYTES", "MIN_BYTES", "all_gather", "all_to_all", "broadcast", "gather", "scatter"]

#: Collectives of known size below this many bytes in all keep the backend's path.
MIN_BYTES = 64 * 1024
#: Broadcasts of fewer bytes keep the backend's path: up to 1 MiB, gloo's and MPICH's broadcasts took
#: less than the two rounds alone at 2 and 4 ranks on a 2-core machine; at 4 MiB the read was as fast or
#: faster, at 16 MiB and more 1.2-2x faster.
MIN_BROADCAST_BYTES = 4 * 1024 * 1024


def _move(
    group: Group,
    name: str,
    ok: bool,
    fields: Sequence[int],
    reads: Callable[[list[list[int]]], list[tuple[int, torch.Tensor]]],
) -> bool:
    """A collective whose receivers read every byte: ``reads`` lists (pid, runs) per peer (``local_copy.transfer``)."""
    # The caller's tensors may require grad (a leaf ``out``): a collective moves data, which autograd does
    # not track, so the local copies into ``out`` run as the backends' writes do, outside the graph.
    with torch.no_grad():
        return local_copy.transfer(
            group, name, ok, fields, lambda rows: [Copy(p, r, False) for p, r in reads(rows)]
        )


def _addr(t: Optional[torch.Tensor]) -> int:
    return t.data_ptr() if t is not None and t.numel() else 0


def _offsets(counts: Sequence[int], item: int) -> list[int]:
    return [sum(counts[:r]) * item for r in range(len(counts))]


def all_to_all(
    group: Group,
    out: torch.Tensor,
    out_counts: Sequence[int],
    inp: torch.Tensor,
    in_counts: Sequence[int],
) -> bool:
    """``Group._all_to_all`` by cross-memory attach; False (on every rank) to take the backend's path.

    The few integers the ranks swap go through ``group._all_gather_ints``; the same for every function here.
    """
    item = inp.element_size()
    ok = local_copy.copyable(out, inp) and out.dtype == inp.dtype and not shares_memory(out, inp)
    send_at = _offsets(in_counts, item)
    recv_at = _offsets(out_counts, item)

    def reads(rows: list[list[int]]) -> list[tuple[int, torch.Tensor]]:
        me = group.rank
        own = out.view(-1)[recv_at[me] // item : recv_at[me] // item + out_counts[me]]
        own.copy_(inp.view(-1)[send_at[me] // item : send_at[me] // item + in_counts[me]])
        base = _addr(out)
        return [
            (rows[s][1], cross_memory.runs([base + recv_at[s]], [rows[s][2] + rows[s][3 + me]], [out_counts[s] * item]))
            for s in range(group.size)
            if s != me and out_counts[s]
        ]

    return _move(group, "all_to_all", ok, [_addr(inp), *send_at], reads)


def scatter(
    group: Group,
    out: torch.Tensor,
    inp: Optional[torch.Tensor],
    counts: Sequence[int],
    src: int,
) -> bool:
    """``Group._scatter`` by cross-memory attach; False (on every rank) to take the backend's path."""
    item = out.element_size()
    if sum(counts) * item < MIN_BYTES:
        return False
    at = _offsets(counts, item)
    ok = local_copy.copyable(out, inp) and (inp is None or (inp.dtype == out.dtype and not shares_memory(out, inp)))

    def reads(rows: list[list[int]]) -> list[tuple[int, torch.Tensor]]:
        me = group.rank
        if me == src:
            assert inp is not None
            out.view(-1).copy_(inp.view(-1)[at[me] // item : at[me] // item + counts[me]])
            return []
        return [(rows[src][1], cross_memory.runs([_addr(out)], [rows[src][2] + at[me]], [counts[me] * item]))]

    return _move(group, "scatter", ok, [_addr(inp)], reads)


def gather(
    group: Group,
    out: Optional[torch.Tensor],
    counts: Sequence[int],
    inp: torch.Tensor,
    dst: int,
) -> bool:
    """``Group._gather`` by cross-memory attach; False (on every rank) to take the backend's path."""
    item = inp.element_size()
    if sum(counts) * item < MIN_BYTES:
        return False
    at = _offsets(counts, item)
    ok = local_copy.copyable(out, inp) and (out is None or (inp.dtype == out.dtype and not shares_memory(out, inp)))

    def reads(rows: list[list[int]]) -> list[tuple[int, torch.Tensor]]:
        if group.rank != dst:
            return []
        assert out is not None
        out.view(-1)[at[dst] // item : at[dst] // item + counts[dst]].copy_(inp.view(-1))
        base = _addr(out)
        return [
            (rows[s][1], cross_memory.runs([base + at[s]], [rows[s][2]], [counts[s] * item]))
            for s in range(group.size)
            if s != dst
        ]

    return _move(group, "gather", ok, [_addr(inp)], reads)


def all_gather(group: Group, out: torch.Tensor, inp: torch.Tensor, counts: Sequence[int]) -> bool:
    """``Group._all_gather`` by cross-memory attach; False (on every rank) to take the backend's path."""
    item = inp.element_size()
    if sum(counts) * item < MIN_BYTES:
        return False
    at = _offsets(counts, item)
    me = group.rank
    # ``inp`` may be this rank's slot of ``out`` already (FSDP-style); any other overlap declines.
    in_slot = inp.numel() > 0 and inp.data_ptr() == _addr(out) + at[me]
    ok = local_copy.copyable(out, inp) and inp.dtype == out.dtype and (in_slot or not shares_memory(out, inp))

    def reads(rows: list[list[int]]) -> list[tuple[int, torch.Tensor]]:
        if not in_slot:
            out.view(-1)[at[me] // item : at[me] // item + counts[me]].copy_(inp.view(-1))
        base = _addr(out)
        return [
            (rows[s][1], cross_memory.runs([base + at[s]], [rows[s][2]], [counts[s] * item]))
            for s in range(group.size)
            if s != me
        ]

    return _move(group, "all_gather", ok, [_addr(inp)], reads)


def broadcast(group: Group, tensor: torch.Tensor, src: int) -> bool:
    """``Group._broadcast`` by cross-memory attach; False (on every rank) to take the backend's path.

    Every rank but ``src`` reads ``src``'s whole tensor into its own: one
    copy per receiver, all at once, where a tree of point-to-point messages
    through shared memory copies each byte twice per hop. ``src`` publishes
    its byte count beside its address; a receiver whose tensor is of another
    size raises ``ValueError`` (and its peers :class:`~shardwise.errors.PeerError`)
    instead of reading past the end of either tensor. Tensors under
    :data:`MIN_BROADCAST_BYTES` keep the backend's path (so ranks whose
    sizes differ on either side of it, which only an unverified call lets
    through, do not meet).
    """
    item = tensor.element_size()
    nbytes = tensor.numel() * item
    if nbytes < MIN_BROADCAST_BYTES:
        return False

    def reads(rows: list[list[int]]) -> list[tuple[int, torch.Tensor]]:
        if group.rank == src:
            return []
        if rows[src][3] != nbytes:
            raise ValueError(
                f"broadcast: rank {group.rank} receives into {nbytes} bytes, but rank {src} sends {rows[src][3]}; "
                "every rank must pass a tensor of the same size and dtype"
            )
        return [(rows[src][1], cross_memory.runs([_addr(tensor)], [rows[src][2]], [nbytes]))]

    return _move(group, "broadcast", local_copy.copyable(tensor), [_addr(tensor), nbytes], reads)
