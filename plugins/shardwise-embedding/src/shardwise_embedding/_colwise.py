"""Column-wise sharded lookups: every owner serves its columns of every rank's ids.

Every rank deduplicates its ids and all-gathers them; each owner looks up its
columns of all of them (or pools all ranks' bags over its columns) and an
autograd ``all_to_all`` sends each rank its block; the rank lays the blocks
side by side in column (placement) order. ``max_norm`` needs whole-row norms:
owners add up (or max) their columns' partial norms with one ``all_reduce``.

On one host the all-gather and the all-to-all are one
:class:`shardwise.sdk.RoundTrip`: the call's agreement carries the addresses
of every rank's ids and answer box (:func:`answer_box`, allocated before the
agreement), owners read the ids and write their blocks straight into the
boxes, and one closing round ends the forward: two rounds of the backend in
all. The backward is the all-to-all's.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

import shardwise.nn.functional as dist_f
from shardwise import Group, sdk
from shardwise_embedding._grad import pool_by_frequency, scale_grad
from shardwise_embedding._inputs import Options, Table, zeros_in_graph
from shardwise_embedding._take import place_columns, pool_rows, take_rows

__all__ = [
    "answer_box",
    "answering",
    "assemble_columns",
    "bag_colwise",
    "gather_uneven",
    "lookup_colwise",
    "renorm_columns",
    "serve_columns",
]


@contextlib.contextmanager
def answering(trip: Optional[sdk.RoundTrip]) -> Iterator[None]:
    """Run this rank's own work up to its answer; if it raises, close ``trip`` first so no peer waits for it.

    Enter it after the call's last collective before the answer: the peers
    then meet the closing round that :meth:`~shardwise.sdk.RoundTrip.abandon`
    runs in their own :meth:`~shardwise.sdk.RoundTrip.answer`, and raise
    :class:`~shardwise.errors.PeerError` there.
    """
    try:
        yield
    except Exception:
        # Not BaseException: on an interrupt the peers may never reach their closing round.
        if trip is not None:
            trip.abandon()
        raise


def gather_uneven(group: Group, tensor: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (``counts[r]`` rows from rank r; sizes known to all) in rank order.

    Pads to the largest count so one all-gather into a preallocated buffer
    does it (no size handshake needed).
    """
    most = max(counts) if counts else 0
    padded = tensor.new_zeros((most, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    out = tensor.new_empty((most * group.size, *tensor.shape[1:]))
    group.all_gather(padded, out=out)
    return [out[r * most : r * most + n] for r, n in enumerate(counts)]


def renorm_columns(group: Group, table: Table, opts: Options, ids: torch.Tensor) -> None:
    """Renorm the rows ``ids`` (every rank passes the same) in place, by their whole-row norms.

    The dense op's ``embedding_renorm_``: a row whose ``norm_type``-norm
    exceeds ``max_norm`` is scaled by ``max_norm / (norm + 1e-7)``.
    """
    assert opts.max_norm is not None
    rows = torch.unique(ids)
    p = opts.norm_type
    with torch.no_grad():
        partial = torch.zeros(rows.numel(), dtype=torch.float64, device=rows.device)
        for _, size, shard in table.local:
            if size == 0:
                continue  # an empty column shard adds nothing to any norm (and amax of nothing is undefined)
            part = shard[rows].abs().to(torch.float64)
            partial = torch.maximum(partial, part.amax(1)) if math.isinf(p) else partial + part.pow(p).sum(1)
        group.all_reduce(partial, op="max" if math.isinf(p) else "sum")
        norms = partial if math.isinf(p) else partial.pow(1.0 / p)
        over = norms > opts.max_norm
        if bool(over.any()):
            scale = (opts.max_norm / (norms[over] + 1e-7)).unsqueeze(1)
            for _, _, shard in table.local:
                shard[rows[over]] = (shard[rows[over]].to(torch.float64) * scale).to(shard.dtype)


def serve_columns(table: Table, local_rows: list[torch.Tensor], counts: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Flatten this rank's blocks for the all-to-all: for rank r, its rows of each local shard in turn.

    Args:
        local_rows: Per local shard (by column offset), ``[sum(counts), cols]`` rows.
        counts: Rows that belong to each rank.

    Returns:
        The flat send buffer and the number of elements for each rank.
    """
    if len(local_rows) == 1:
        # Rank r's block is rows counts[r-1]..counts[r]: the blocks in rank order are the rows as they are.
        rows = local_rows[0]
        return rows.reshape(-1), [n * rows.shape[1] for n in counts]
    pieces, sizes = [], []
    splits = [rows.split(counts) for rows in local_rows]
    for r in range(len(counts)):
        blocks = [s[r].reshape(-1) for s in splits]
        pieces.extend(blocks)
        sizes.append(sum(b.numel() for b in blocks))
    if not pieces:
        return zeros_in_graph(table, 0, 1).reshape(-1), [0] * len(counts)
    return torch.cat(pieces), sizes


def _owned(table: Table) -> dict[int, list[tuple[int, int]]]:
    """Every owner's column shards, ``(offset, size)`` in placement order."""
    owned: dict[int, list[tuple[int, int]]] = {}
    for offset, size, owner in table.shards:
        owned.setdefault(owner, []).append((offset, size))
    return owned


def answer_box(group: Group, table: Table, rows: int, device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """The buffer this rank receives its ``rows`` rows' column blocks in, and the elements from each owner."""
    owned = _owned(table)
    recv = [rows * sum(size for _, size in owned.get(r, [])) for r in range(group.size)]
    return sdk.empty((sum(recv),), table.weight.dtype, device), recv


def assemble_columns(
    group: Group, table: Table, flat: torch.Tensor, sent: list[int], rows: int, trip: Optional[sdk.RoundTrip] = None
) -> torch.Tensor:
    """Send every rank its blocks and lay the blocks this rank receives out as ``[rows, D]`` columns.

    With ``trip`` bound by the call's agreement the blocks are written
    straight into the receivers' boxes; else they go by all-to-all (into the
    trip's box, if there is one).
    """
    owned = _owned(table)
    if trip is not None and trip.bound:
        got = trip.answer(flat, sent)
    else:
        box, recv = answer_box(group, table, rows, flat.device) if trip is None else (trip.box, trip.recv)
        got = dist_f.all_to_all_single(box, flat, recv, sent, group=group)
    blocks = []
    cursor = 0
    for r in range(group.size):
        for offset, size in owned.get(r, []):
            blocks.append((cursor, offset, size))
            cursor += rows * size
    return place_columns(got, blocks, rows, table.cols)


def lookup_colwise(
    group: Group, table: Table, opts: Options, all_ids: torch.Tensor, all_freq: Optional[torch.Tensor],
    counts: list[int], trip: Optional[sdk.RoundTrip] = None,
) -> torch.Tensor:
    """Rows (all columns) of this rank's distinct ids.

    Args:
        all_ids: Every rank's distinct ids, in rank order (the all-gather's result).
        all_freq: Their occurrence counts (only for ``scale_grad_by_freq``).
        counts: Number of distinct ids of every rank.
        trip: The call's round trip, to answer through if bound (or None).
    """
    if opts.max_norm is not None:
        renorm_columns(group, table, opts, all_ids)
    with answering(trip):
        scale: Optional[torch.Tensor] = None
        if opts.scale_grad_by_freq and all_freq is not None and all_ids.numel():
            seen, where = torch.unique(all_ids, return_inverse=True)
            total = torch.zeros(seen.numel(), dtype=torch.int64, device=seen.device).index_add_(0, where, all_freq)
            scale = 1.0 / total[where].to(table.weight.dtype)
        local_rows = []
        for _, _, shard in table.local:
            rows = take_rows(shard, all_ids, opts.padding_idx)
            local_rows.append(rows if scale is None else scale_grad(rows, scale))
        flat, sent = serve_columns(table, local_rows, counts)
        return assemble_columns(group, table, flat, sent, counts[group.rank], trip)


def bag_colwise(
    group: Group, table: Table, opts: Options, all_ids: torch.Tensor, all_lengths: torch.Tensor,
    weights: Optional[torch.Tensor], sizes: list[tuple[int, int]], trip: Optional[sdk.RoundTrip] = None,
) -> torch.Tensor:
    """``F.embedding_bag`` over column shards: owners pool every rank's bags over their columns.

    Args:
        all_ids, all_lengths: Every rank's bags (ids, and ids per bag), in rank order.
        weights: This rank's ``per_sample_weights`` (or None).
        sizes: ``(number of ids, number of bags)`` of every rank.
        trip: The call's round trip, to answer through if bound (or None).
    """
    all_weights: Optional[torch.Tensor] = None
    if weights is not None:
        if weights.requires_grad and torch.is_grad_enabled():
            all_weights = torch.cat(dist_f.all_gather(weights, group=group))
        else:
            all_weights = torch.cat(gather_uneven(group, weights, [n for n, _ in sizes]))
    if opts.max_norm is not None:
        renorm_columns(group, table, opts, all_ids)
    with answering(trip):
        bag_counts = [b for _, b in sizes]
        nbags = all_lengths.numel()
        divisor: Optional[torch.Tensor] = None
        if opts.mode == "mean":
            divisor = all_lengths
            if opts.padding_idx is not None:
                bag = torch.repeat_interleave(torch.arange(nbags, device=all_lengths.device), all_lengths)
                divisor = torch.bincount(bag[all_ids != opts.padding_idx], minlength=nbags)
            divisor = divisor.clamp(min=1).unsqueeze(1)
        local_rows = []
        for _, _, shard in table.local:
            if opts.mode == "max":
                starts = all_lengths.cumsum(0) - all_lengths
                pooled = F.embedding_bag(all_ids, shard, starts, mode="max", padding_idx=opts.padding_idx)
            elif opts.scale_grad_by_freq:
                bag = torch.repeat_interleave(torch.arange(nbags, device=all_lengths.device), all_lengths)
                pooled = pool_by_frequency(
                    all_ids, shard, bag, nbags, all_weights, opts.padding_idx, None, opts.norm_type
                )
            else:
                pooled = pool_rows(shard, all_ids, all_lengths, all_weights, opts.padding_idx)
            if divisor is not None:
                pooled = pooled / divisor.to(pooled.dtype)
            local_rows.append(pooled)
        flat, sent = serve_columns(table, local_rows, bag_counts)
        if all_weights is not None and all_weights.requires_grad and not table.local:
            # Tie the gathered weights into this rank's graph (with zero gradient) so
            # that it joins their backward collective, which its peers will enter.
            flat = flat + all_weights.sum() * 0
        return assemble_columns(group, table, flat, sent, bag_counts[group.rank], trip)
