"""Entry points of the two sharded ops: parse, check, agree across ranks, then run the algorithm.

Arguments are parsed with the dense ops' signatures, so positional and
keyword calls (and ``nn.Embedding``/``nn.EmbeddingBag``'s calls) behave as
they do on a dense weight. Checks that can only fail on some ranks are
reported to the peers in the first collective (``_agree``), so every rank
raises; checks of the weight itself are the same on every rank and raise
at once. After that agreement every size is known on every rank, so the
op's own collectives run without the group's handshake (``unverified``).

A rank that is the whole job (world size 1) and holds the whole weight in
one tensor has no peer to route ids to or agree with: after the same
argument checks it runs the dense computation on that tensor, so sharding
costs nothing there (``_alone``).
"""

from __future__ import annotations

import zlib
from typing import Any, Optional

import torch
import torch.nn.functional as F

from shardwise import Group
from shardwise_embedding import _colwise, _rowwise
from shardwise_embedding._agree import agree, agree_and_gather
from shardwise_embedding._inputs import (
    Bags,
    Options,
    Table,
    bags_of,
    check_ids,
    options_of,
    table_of,
    zeros_in_graph,
)
from shardwise_embedding._take import take_rows

__all__ = ["sharded_embedding", "sharded_embedding_bag"]

_EMBEDDING, _EMBEDDING_BAG = 0, 1


def _layout(table: Table) -> int:
    """A code for the weight's global size and sharding, part of the signature every rank must agree on.

    Ranks whose weights differ (another size, another cut) would each route
    ids to the owner *they* believe in, and an owner that disagrees answers
    with rows that are not the ones asked for: a wrong result, no error.
    """
    return zlib.crc32(repr((table.dim, table.rows, table.cols, table.shards)).encode())


def _embedding_args(
    input: Any, weight: Any, padding_idx: Any = None, max_norm: Any = None, norm_type: Any = 2.0,
    scale_grad_by_freq: Any = False, sparse: Any = False,
) -> dict[str, Any]:
    return locals()


def _embedding_bag_args(
    input: Any, weight: Any, offsets: Any = None, max_norm: Any = None, norm_type: Any = 2,
    scale_grad_by_freq: Any = False, mode: Any = "mean", sparse: Any = False, per_sample_weights: Any = None,
    include_last_offset: Any = False, padding_idx: Any = None,
) -> dict[str, Any]:
    return locals()


def _group_of(weight: Any, process_group: Any) -> Group:
    group = process_group if isinstance(process_group, Group) else getattr(weight, "process_group", None)
    if not isinstance(group, Group):
        raise TypeError("the sharded weight has no shardwise Group")
    return group


def _weights_flag(weights: Optional[torch.Tensor]) -> int:
    if weights is None:
        return 0
    return 2 if weights.requires_grad and torch.is_grad_enabled() else 1


def _alone(group: Group, table: Table) -> bool:
    """Whether this rank is the whole job and holds the whole weight as one local tensor."""
    # At world size 1 every shard is local; the shards cover the weight, so one shard is all of it.
    return group.size == 1 and len(table.local) == 1


def _narrow(table: Table) -> bool:
    """Whether the column-wise all-gather may send ids and counts as int32 (the same on every rank)."""
    # Ids are below the row count; counts and bag lengths are below a rank's number of ids,
    # which no rank can hold 2**31 of (16 GiB of int64 ids).
    return table.rows < 2**31


def sharded_embedding(args: Any, kwargs: dict[str, Any], process_group: Any) -> torch.Tensor:
    """``F.embedding(input, weight, ...)`` with ``weight`` a row- or column-sharded ShardedTensor."""
    a = _embedding_args(*args, **kwargs)
    table = table_of(a["weight"], "embedding")
    group = _group_of(a["weight"], process_group)
    if _alone(group, table):
        return _embedding_alone(a, table)
    error: Optional[Exception] = None
    sizes: list[int] = [0] * group.size if table.dim == 0 else [0]
    signature = [_EMBEDDING, table.dim] + [0] * 7
    payload = torch.empty(0, dtype=torch.int64, device="cpu")
    try:
        opts = options_of(table, "embedding", a["padding_idx"], a["max_norm"], a["norm_type"],
                          a["scale_grad_by_freq"], a["sparse"])
        signature = [*opts.signature(_EMBEDDING, table.dim, 0), _layout(table)]
        ids = check_ids(a["input"], table, "embedding")
        table = table.on(ids.device)
        shape = tuple(a["input"].shape)
        if table.dim == 0:
            route = _rowwise.RowRoute(table, ids, group.size)
            sizes = route.send_counts
        else:
            uniq, inverse, freq = _rowwise.distinct(ids, table.rows)
            sizes = [uniq.numel()]
            payload = torch.cat([uniq, freq]) if opts.scale_grad_by_freq else uniq
    except Exception as exc:  # noqa: BLE001 - any local failure is reported to the peers, then re-raised here
        error = exc
    if table.dim == 0:
        everyone = agree(group, "embedding", error, signature, sizes)
        with group.unverified():
            return _rowwise.lookup_rowwise(group, table, opts, route, [row[group.rank] for row in everyone], shape)
    answers = _colwise.answer_box(group, table, sizes[0] if error is None else 0, payload.device)
    everyone, pieces, trip = agree_and_gather(
        group, "embedding", error, signature, sizes, payload, _narrow(table), answers
    )
    counts = [row[0] for row in everyone]
    all_ids = torch.cat([piece[:n] for piece, n in zip(pieces, counts, strict=True)])
    all_freq = None
    if opts.scale_grad_by_freq:
        all_freq = torch.cat([piece[n : 2 * n] for piece, n in zip(pieces, counts, strict=True)])
    with group.unverified():
        rows = _colwise.lookup_colwise(group, table, opts, all_ids, all_freq, counts, trip)
    return take_rows(rows, inverse).view(*shape, table.cols)


def _embedding_alone(a: dict[str, Any], table: Table) -> torch.Tensor:
    """``F.embedding`` at world size 1: the sharded op's checks, then the lookup in the one local tensor."""
    opts = options_of(table, "embedding", a["padding_idx"], a["max_norm"], a["norm_type"],
                      a["scale_grad_by_freq"], a["sparse"])
    ids = check_ids(a["input"], table, "embedding")
    whole = table.local[0][2]
    if opts.scale_grad_by_freq:
        rows = F.embedding(ids, whole, opts.padding_idx, opts.max_norm, opts.norm_type, True)
    else:
        rows = take_rows(whole, ids, opts.padding_idx, opts.max_norm, opts.norm_type)
    return rows.view(*a["input"].shape, table.cols)


def _embedding_bag_alone(table: Table, opts: Options, bags: Bags) -> torch.Tensor:
    """``F.embedding_bag`` at world size 1 on the bags :func:`bags_of` made (arguments already checked).

    The dense op gets the bags' own ids and starts, never the caller's raw
    input: that way ids outside every bag are dropped and no-bag input gives
    ``(0, D)`` exactly as on the general path (torch's kernel segfaults on
    ids with empty ``offsets``, and pools past the last offset with
    ``include_last_offset``).
    """
    whole = table.local[0][2]
    if bags.count == 0:
        return zeros_in_graph(table.on(whole.device), 0)
    ids = bags.ids.to(whole.device)
    starts = (torch.cumsum(bags.lengths, 0) - bags.lengths).to(whole.device)
    weights = None if bags.weights is None else bags.weights.to(whole.device)
    return F.embedding_bag(
        ids, whole, starts, opts.max_norm, opts.norm_type, False, opts.mode, False, weights, False, opts.padding_idx
    )


def sharded_embedding_bag(args: Any, kwargs: dict[str, Any], process_group: Any) -> torch.Tensor:
    """``F.embedding_bag(input, weight, ...)`` with ``weight`` a row- or column-sharded ShardedTensor."""
    a = _embedding_bag_args(*args, **kwargs)
    table = table_of(a["weight"], "embedding_bag")
    group = _group_of(a["weight"], process_group)
    if _alone(group, table):
        opts = options_of(table, "embedding_bag", a["padding_idx"], a["max_norm"], a["norm_type"],
                          a["scale_grad_by_freq"], a["sparse"], a["mode"])
        bags = bags_of(table, a["input"], a["offsets"], a["per_sample_weights"], bool(a["include_last_offset"]),
                       opts.mode)
        if not opts.scale_grad_by_freq:
            return _embedding_bag_alone(table, opts, bags)
        # The dense op scales gradients by wrong counts (see _grad.pool_by_frequency): take the general path.
    error: Optional[Exception] = None
    pooled = table.dim == 0 and a["mode"] in ("sum", "mean")
    sizes: list[int] = [0] * (group.size + 1) if table.dim == 0 else [0, 0]
    signature = [_EMBEDDING_BAG, table.dim] + [0] * 7
    try:
        opts = options_of(table, "embedding_bag", a["padding_idx"], a["max_norm"], a["norm_type"],
                          a["scale_grad_by_freq"], a["sparse"], a["mode"])
        signature = [*opts.signature(_EMBEDDING_BAG, table.dim, _weights_flag(a["per_sample_weights"])), _layout(table)]
        bags = bags_of(table, a["input"], a["offsets"], a["per_sample_weights"], bool(a["include_last_offset"]),
                       opts.mode)
        table = table.on(bags.ids.device)
        if pooled:
            bags, divisor = _drop_padding(bags, opts)
            bag_route = _rowwise.BagRoute(table, bags, group.size)
            sizes = [*bag_route.send_counts, bags.count]
        elif table.dim == 0:
            route = _rowwise.RowRoute(table, bags.ids, group.size)
            sizes = [*route.send_counts, bags.count]
        else:
            sizes = [bags.ids.numel(), bags.count]
    except Exception as exc:  # noqa: BLE001 - any local failure is reported to the peers, then re-raised here
        error = exc
    if table.dim == 1:
        if error is None:
            payload = torch.cat([bags.ids, bags.lengths])
        else:
            payload = torch.empty(0, dtype=torch.int64, device="cpu")
        answers = _colwise.answer_box(group, table, sizes[1] if error is None else 0, payload.device)
        everyone, pieces, trip = agree_and_gather(
            group, "embedding_bag", error, signature, sizes, payload, _narrow(table), answers
        )
        shapes = [(row[0], row[1]) for row in everyone]
        all_ids = torch.cat([piece[:n] for piece, (n, _) in zip(pieces, shapes, strict=True)])
        all_lengths = torch.cat([piece[n : n + b] for piece, (n, b) in zip(pieces, shapes, strict=True)])
        with group.unverified():
            return _colwise.bag_colwise(group, table, opts, all_ids, all_lengths, bags.weights, shapes, trip)
    everyone = agree(group, "embedding_bag", error, signature, sizes)
    recv = [row[group.rank] for row in everyone]
    bag_counts = [row[-1] for row in everyone]
    with group.unverified():
        if pooled:
            return _rowwise.bag_rowwise_pooled(group, table, opts, bags, divisor, bag_counts, recv, bag_route)
        # max mode: fetch each distinct row once, then pool locally with the dense op (its tie-breaking included).
        rows = _rowwise.route_rows(group, table, opts, route, recv)
    starts = bags.lengths.cumsum(0) - bags.lengths
    pad = None
    if opts.padding_idx is not None:
        # Padding ids were fetched too (max_norm renorms their row, as the dense op does); skip them in the pool.
        where = (route.send == opts.padding_idx).nonzero()
        pad = int(where[0, 0]) if where.numel() else None
    return F.embedding_bag(route.index, rows, starts, mode="max", padding_idx=pad)


def _drop_padding(bags: Bags, opts: Options) -> tuple[Bags, torch.Tensor]:
    """The bags to route for a sum/mean, and how many ids of each bag a mean divides by.

    Padding ids neither add to a bag nor count for its mean, so they stay
    home, unless ``max_norm`` must renorm their row (the dense op renorms
    every id of the input); then they travel and the owner skips them.
    """
    if opts.padding_idx is None:
        return bags, bags.lengths
    keep = bags.ids != opts.padding_idx
    if bool(keep.all()):
        return bags, bags.lengths
    kept = torch.bincount(bags.bag_of_each_id()[keep], minlength=bags.count)
    if opts.max_norm is not None:
        return bags, kept
    return Bags(bags.ids[keep], kept, None if bags.weights is None else bags.weights[keep]), kept
