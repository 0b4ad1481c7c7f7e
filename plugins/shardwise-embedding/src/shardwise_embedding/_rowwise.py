"""Row-wise sharded lookups: each id travels to the rank that owns its row.

``embedding`` (and ``embedding_bag`` in max mode): every rank deduplicates
its ids, sends each distinct id once to its row's owner (``all_to_all``),
the owner looks the rows up in its shard, and the rows come back along the
same route (an autograd ``all_to_all``, so gradients retrace it into the
owner's shard). Only distinct ids and their rows cross the wire — not, as
in torch 2.13, every rank's ids to every rank and a reduce-scatter of the
whole output.

``embedding_bag`` in sum/mean mode: ids travel with their bag number; the
owner pools the rows it owns into partial bags for every rank, and one
``reduce_scatter`` adds the partial bags up on the rank they belong to.
Only ids and one row per bag and owner cross the wire.
"""

from __future__ import annotations

from typing import Optional

import torch

import shardwise.nn.functional as dist_f
from shardwise import Group, sdk
from shardwise_embedding._grad import pool_by_frequency, scale_grad
from shardwise_embedding._inputs import Bags, Options, Table, zeros_in_graph
from shardwise_embedding._take import pool_rows, take_rows

__all__ = ["BagRoute", "RowRoute", "bag_rowwise_pooled", "destinations", "distinct", "lookup_rowwise", "route_rows"]


def _owner_of_each(table: Table, ids: torch.Tensor) -> torch.Tensor:
    """The rank owning the row of each id."""
    filled = [s for s in table.shards if s[1] > 0]
    chunk = filled[0][1] if filled else 0
    owners = torch.tensor([s[2] for s in filled] or [0], dtype=torch.int64, device=ids.device)
    if chunk and all(offset == i * chunk for i, (offset, _, _) in enumerate(filled)):
        # ChunkShardingSpec's usual layout (equal chunks, the last one shorter): a division finds the chunk.
        return owners[torch.div(ids, chunk, rounding_mode="floor")]
    starts = torch.tensor([s[0] for s in filled] or [0], dtype=torch.int64, device=ids.device)
    return owners[torch.searchsorted(starts, ids, right=True) - 1]


def destinations(table: Table, ids: torch.Tensor, world: int) -> tuple[Optional[torch.Tensor], list[int], torch.Tensor]:
    """How to group ``ids`` by the rank owning their row, and how many go to each rank.

    Returns:
        A stable permutation that groups the ids by destination rank (None
        when they already are), the number of ids for each rank, and the
        destination rank of each id (in the original order).
    """
    dest = _owner_of_each(table, ids)
    counts = torch.bincount(dest, minlength=world).tolist()
    if dest.numel() < 2 or bool((dest[1:] >= dest[:-1]).all()):
        return None, counts, dest  # sorted ids and placements in rank order: nothing to permute
    if world <= 8:
        # A few passes of a mask beat a general (radix) sort of the whole batch.
        order = torch.cat([(dest == r).nonzero().squeeze(1) for r in range(world) if counts[r]])
    else:
        order = torch.argsort(dest, stable=True)
    return order, counts, dest


def distinct(ids: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.unique(ids, return_inverse=True, return_counts=True)`` for ids in ``[0, rows)``.

    When the table is not much larger than the batch, marking ids in a
    table-sized mask is several times faster than sorting them.
    """
    if rows > 4 * ids.numel() + 1024:
        uniq, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
        return uniq, inverse, counts
    present = torch.zeros(rows, dtype=torch.bool, device=ids.device)
    present[ids] = True
    uniq = present.nonzero().squeeze(1)
    inverse = (present.cumsum(0) - 1)[ids]
    return uniq, inverse, torch.bincount(inverse, minlength=uniq.numel())


class RowRoute:
    """Where each distinct id of this rank goes, and where its row comes back.

    Attributes:
        send: This rank's distinct ids, grouped by the rank owning their row.
        freq: Occurrences of each id of ``send`` on this rank.
        send_counts: Ids sent to each rank.
        index: For each original id, the position of its row among the rows
            that come back (which arrive in ``send`` order).
    """

    def __init__(self, table: Table, ids: torch.Tensor, world: int) -> None:
        uniq, inverse, counts = distinct(ids, table.rows)
        order, self.send_counts, _ = destinations(table, uniq, world)
        if order is None:
            self.send, self.freq, self.index = uniq, counts, inverse
        else:
            self.send, self.freq = uniq[order], counts[order]
            back = torch.empty_like(order)
            back[order] = torch.arange(order.numel(), device=order.device)
            self.index = back[inverse]


def _local_padding(opts: Options, offset: int, size: int) -> Optional[int]:
    """``padding_idx`` within the shard of rows ``[offset, offset + size)``, or None if it lies elsewhere."""
    if opts.padding_idx is not None and 0 <= opts.padding_idx - offset < size:
        return opts.padding_idx - offset
    return None


def _lookup_local(table: Table, opts: Options, ids: torch.Tensor) -> torch.Tensor:
    """Rows of (global) ``ids``, all owned by this rank, from its local shard(s); autograd into the shards."""
    rows = None
    for offset, size, shard in table.local:
        local = ids - offset
        inside = (local >= 0) & (local < size)
        pad = _local_padding(opts, offset, size)
        if bool(inside.all()):
            return take_rows(shard, local, pad, opts.max_norm, opts.norm_type)
        if rows is None:
            rows = zeros_in_graph(table, ids.numel())
        if bool(inside.any()):
            rows = rows.index_put((inside.nonzero().squeeze(1),),
                                  take_rows(shard, local[inside], pad, opts.max_norm, opts.norm_type))
    return zeros_in_graph(table, ids.numel()) if rows is None else rows


def route_rows(group: Group, table: Table, opts: Options, route: RowRoute, recv_counts: list[int]) -> torch.Tensor:
    """Exchange ids, look up owned rows, send them back: the rows of ``route.send``, in that order."""
    if opts.scale_grad_by_freq:
        received = group.all_to_all_single(torch.stack([route.send, route.freq], dim=1), recv_counts, route.send_counts)
        ids, freq = received[:, 0], received[:, 1]
    else:
        ids = group.all_to_all_single(route.send, recv_counts, route.send_counts)
    rows = _lookup_local(table, opts, ids)
    if opts.scale_grad_by_freq and ids.numel():
        # The owner sees every rank's count of its ids: scale by the global frequency, as one dense batch would.
        seen, where = torch.unique(ids, return_inverse=True)
        total = torch.zeros(seen.numel(), dtype=torch.int64, device=ids.device).index_add_(0, where, freq)
        rows = scale_grad(rows, 1.0 / total[where].to(rows.dtype))
    out = sdk.empty((len(route.send), table.cols), rows.dtype, rows.device)
    return dist_f.all_to_all_single(out, rows, route.send_counts, recv_counts, group=group)


def lookup_rowwise(
    group: Group, table: Table, opts: Options, route: RowRoute, recv_counts: list[int], shape: tuple[int, ...]
) -> torch.Tensor:
    """``F.embedding`` of the ids ``route`` was built from, shaped ``shape + (D,)``."""
    rows = route_rows(group, table, opts, route, recv_counts)
    return take_rows(rows, route.index).view(*shape, table.cols)


class BagRoute:
    """Where each id of this rank's bags goes, for pooled (sum/mean) bags.

    Attributes:
        order: Permutation grouping the ids by destination rank (stable, so
            each rank's ids stay in bag order), or None when they already are.
        send_counts: Ids sent to each rank.
        lengths: ``[world, bags]``: how many ids of each bag go to each rank.
    """

    def __init__(self, table: Table, bags: Bags, world: int) -> None:
        self.order, self.send_counts, dest = destinations(table, bags.ids, world)
        slot = dest * bags.count + bags.bag_of_each_id()
        self.lengths = torch.bincount(slot, minlength=world * bags.count).view(world, bags.count)


def bag_rowwise_pooled(
    group: Group, table: Table, opts: Options, bags: Bags, divisor: torch.Tensor, bag_counts: list[int],
    recv_counts: list[int], route: BagRoute,
) -> torch.Tensor:
    """``F.embedding_bag`` in sum/mean mode: owners pool partial bags, a reduce-scatter adds them up.

    Each rank sends every owner the lengths of its bags counted over that
    owner's ids, then those ids (in bag order); the owner lays the ranks'
    bags end to end, which numbers them globally (rank r's bags after those
    of ranks < r) with no per-id bag numbers on the wire.

    Args:
        bags: This rank's bags to route (padding ids removed unless
            ``max_norm`` must renorm their row; owners skip them).
        divisor: Non-padding ids in each bag (what a mean divides by).
        bag_counts: Number of bags on every rank.
        recv_counts: Ids each rank sends here.
        route: Where this rank's ids go.
    """
    me, world = group.rank, group.size
    ids = bags.ids if route.order is None else bags.ids.index_select(0, route.order)
    pieces, cursor = [], 0
    for r in range(world):
        pieces += [route.lengths[r], ids[cursor : cursor + route.send_counts[r]]]
        cursor += route.send_counts[r]
    send = [bags.count + n for n in route.send_counts]
    recv = [bag_counts[r] + recv_counts[r] for r in range(world)]
    parts = group.all_to_all_single(torch.cat(pieces), recv, send).split(recv)
    lengths = torch.cat([part[: bag_counts[r]] for r, part in enumerate(parts)])
    got = torch.cat([part[bag_counts[r] :] for r, part in enumerate(parts)])
    weights: Optional[torch.Tensor] = None
    if bags.weights is not None:
        w = bags.weights if route.order is None else bags.weights[route.order]
        box = w.new_empty(sum(recv_counts))
        weights = dist_f.all_to_all_single(box, w, recv_counts, route.send_counts, group=group)
    total_bags = sum(bag_counts)
    partial: Optional[torch.Tensor] = None
    global_bag: Optional[torch.Tensor] = None
    for offset, size, shard in table.local:
        pad = _local_padding(opts, offset, size)
        local, w_in, kept_lengths = got - offset, weights, lengths
        chosen: Optional[torch.Tensor] = None
        if len(table.local) > 1 or opts.scale_grad_by_freq:
            # Per-id bag numbers: to keep this shard's ids only, or to pool by frequency.
            if global_bag is None:
                global_bag = torch.repeat_interleave(torch.arange(total_bags, device=lengths.device), lengths)
            chosen = global_bag
            inside = (local >= 0) & (local < size)
            if not bool(inside.all()):
                local, chosen = local[inside], global_bag[inside]
                w_in = None if weights is None else weights[inside]
                kept_lengths = torch.bincount(chosen, minlength=total_bags)
        if opts.scale_grad_by_freq:
            assert chosen is not None
            pooled = pool_by_frequency(local, shard, chosen, total_bags, w_in, pad, opts.max_norm, opts.norm_type)
        else:
            pooled = pool_rows(shard, local, kept_lengths, w_in, pad, opts.max_norm, opts.norm_type)
        partial = pooled if partial is None else partial + pooled
    if partial is None:
        partial = zeros_in_graph(table, total_bags)
        if weights is not None and weights.requires_grad:
            # Join the weights' backward all-to-all, which the peers will enter.
            partial = partial + weights.sum() * 0
    out = partial.new_empty((bag_counts[me], table.cols))
    summed = dist_f.reduce_scatter(out, list(partial.split(bag_counts)), group=group)
    if opts.mode == "mean":
        summed = summed / divisor.clamp(min=1).unsqueeze(1).to(summed.dtype)
    return summed
