"""The two exchanges of a sharded collection's step: ids out to the blocks' owners, pooled vectors back.

Every rank routes, for every table at once, each id of each bag to the rank
holding the id's row in each column block of the table, and sends each rank
one int64 message: ``[batch, weighted]``, then for each table that rank holds
a block of (in plan order) the lengths of every (feature, sample) bag counted
over the ids it gets, then those ids (as local row numbers), then their
weights (float64 bits, only when the sender has weights). One ``all_to_all``
carries all of it, whatever the number of tables. A rank that has run out of
batches while its peers may not have (:class:`SparseDistPipeline`'s end)
sends every rank the header alone, its batch size :data:`NO_BATCH`.

The owner pools each block's bags for every source rank with one
``embedding_bag`` call per block, and sends each source rank its partial bags,
all tables in one flat tensor: the second ``all_to_all`` (autograd-aware, so
the backward retraces it). The source adds the partial bags of each column
block's row blocks and lays the column blocks side by side.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from shardwise_embedding._plan_data import Block, TablePlan
from shardwise_embedding._tables import EmbeddingBagConfig

if TYPE_CHECKING:
    from shardwise_embedding._jagged import KeyedJaggedTensor

__all__ = [
    "HEADER",
    "NO_BATCH",
    "ColumnCut",
    "Dispatched",
    "Inbox",
    "Routes",
    "TableRoute",
    "modified_after_prefetch",
    "no_batch_messages",
    "parse_inbox",
    "ranks_without_batch",
    "route_ids",
    "uneven_batches",
]

#: The int64 header of every input message: the sender's batch size, whether it sends weights.
HEADER = 2
#: The batch size in a header that says the sender has no batch left (no batch has a negative size).
NO_BATCH = -1


@dataclasses.dataclass(frozen=True)
class ColumnCut:
    """One column block of a table and the row blocks cutting it.

    Attributes:
        cols: ``(start, stop)`` of its columns.
        starts: Each row block's first row (sorted), int64.
        owners: The rank holding each row block, int64.
        blocks: The row blocks, in row order.
    """

    cols: tuple[int, int]
    starts: torch.Tensor
    owners: torch.Tensor
    blocks: tuple[Block, ...]


@dataclasses.dataclass(frozen=True)
class TableRoute:
    """Where a sharded table's ids go.

    Attributes:
        config: The table.
        cuts: Its column blocks, in column order.
        cut_of_rank: For each rank holding a block, the index of its column block.
    """

    config: EmbeddingBagConfig
    cuts: tuple[ColumnCut, ...]
    cut_of_rank: dict[int, int]


@dataclasses.dataclass(frozen=True)
class Routes:
    """Everything a step needs to know about the plan, computed once per module.

    Attributes:
        world: The group's size.
        sharded: The tables that are not ``data_parallel``, in plan order.
        tables_of_rank: For each rank, the sharded tables (indices into
            ``sharded``) it holds a block of, in plan order.
    """

    world: int
    sharded: tuple[TableRoute, ...]
    tables_of_rank: tuple[tuple[int, ...], ...]

    @classmethod
    def build(
        cls, tables: Sequence[EmbeddingBagConfig], plans: Sequence[TablePlan], world: int, device: torch.device
    ) -> Routes:
        """The routes of a checked plan (``plans[i]`` is the plan of ``tables[i]``), on the ids' ``device``."""
        sharded = []
        for cfg, plan in zip(tables, plans, strict=True):
            if plan.sharding_type == "data_parallel":
                continue
            cuts, cut_of_rank = [], {}
            for c, cols in enumerate(plan.column_cuts):
                blocks = tuple(sorted((b for b in plan.blocks if b.cols == cols), key=lambda b: b.rows))
                for b in blocks:
                    cut_of_rank[b.rank] = c
                cuts.append(
                    ColumnCut(
                        cols=cols,
                        starts=torch.tensor([b.rows[0] for b in blocks], dtype=torch.int64, device=device),
                        owners=torch.tensor([b.rank for b in blocks], dtype=torch.int64, device=device),
                        blocks=blocks,
                    )
                )
            sharded.append(TableRoute(cfg, tuple(cuts), cut_of_rank))
        per_rank = tuple(tuple(k for k, t in enumerate(sharded) if r in t.cut_of_rank) for r in range(world))
        return cls(world, tuple(sharded), per_rank)


def _bag_of_each_id(lengths: torch.Tensor) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)


def route_ids(
    routes: Routes,
    ids_of: Sequence[torch.Tensor],
    lengths_of: Sequence[torch.Tensor],
    weights_of: Sequence[Optional[torch.Tensor]],
    batch: int,
) -> list[torch.Tensor]:
    """Build the input message for every rank.

    Args:
        routes: The plan's routes.
        ids_of: For each sharded table (as in ``routes.sharded``), the ids of
            its features' bags, feature by feature (key-major).
        lengths_of: For each sharded table, its ``features x batch`` bag sizes.
        weights_of: For each sharded table, the ids' weights or None (None
            for every table, or for none).
        batch: This rank's batch size.

    Returns:
        One int64 message per rank.
    """
    world = routes.world
    weighted = any(w is not None for w in weights_of)
    device = ids_of[0].device if ids_of else torch.device("cpu")
    lengths_to: list[list[torch.Tensor]] = [[] for _ in range(world)]
    ids_to: list[list[torch.Tensor]] = [[] for _ in range(world)]
    weights_to: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for route, ids, lengths, weights in zip(routes.sharded, ids_of, lengths_of, weights_of, strict=True):
        bags = lengths.numel()
        bag = _bag_of_each_id(lengths)
        for cut in route.cuts:
            starts, owners = cut.starts, cut.owners
            which = torch.searchsorted(starts, ids, right=True) - 1
            dest = owners[which]
            local = ids - starts[which]
            counts = torch.bincount(dest * bags + bag, minlength=world * bags).view(world, bags)
            order = torch.argsort(dest, stable=True)
            per_dest = counts.sum(1).tolist()
            local_sorted = local[order].split(per_dest)
            w_sorted = weights[order].split(per_dest) if weights is not None else None
            for b in cut.blocks:
                lengths_to[b.rank].append(counts[b.rank])
                ids_to[b.rank].append(local_sorted[b.rank])
                if weighted:
                    w = w_sorted[b.rank] if w_sorted is not None else torch.ones(per_dest[b.rank], device=device)
                    # float64 bits in the int64 message: exact for every float table dtype.
                    weights_to[b.rank].append(w.to(torch.float64).view(torch.int64))
    header = torch.tensor([batch, int(weighted)], dtype=torch.int64, device=device)
    return [torch.cat([header, *lengths_to[r], *ids_to[r], *weights_to[r]]) for r in range(world)]


@dataclasses.dataclass
class Inbox:
    """What one owner received for one of its blocks, from every rank, end to end in rank order.

    Attributes:
        ids: Local row numbers.
        offsets: Bag starts, plus the end (``include_last_offset`` form).
        weights: Per-id weights (None when no rank sent weights).
        rows_from: For each source rank, how many bags (pooled rows) are its.
    """

    ids: torch.Tensor
    offsets: torch.Tensor
    weights: Optional[torch.Tensor]
    rows_from: list[int]


def parse_inbox(routes: Routes, rank: int, messages: Sequence[torch.Tensor]) -> list[Inbox]:
    """Split the messages this rank received into one :class:`Inbox` per block it holds.

    Args:
        routes: The plan's routes.
        rank: This rank.
        messages: What each rank sent here.

    Returns:
        One inbox per table in ``routes.tables_of_rank[rank]``, in that order.

    Raises:
        ValueError: some ranks sent :data:`NO_BATCH` (they ran out of
            batches where this rank had one; they raise the same error).
    """
    headers = [(int(msg[0]), bool(msg[1])) for msg in messages]
    without = [r for r, (batch, _) in enumerate(headers) if batch == NO_BATCH]
    if without:
        raise uneven_batches(without, len(messages))
    mine = routes.tables_of_rank[rank]
    n_feat = [len(routes.sharded[k].config.feature_names) for k in mine]
    lengths: list[list[torch.Tensor]] = [[] for _ in mine]
    ids: list[list[torch.Tensor]] = [[] for _ in mine]
    weights: list[list[Optional[torch.Tensor]]] = [[] for _ in mine]
    rows_from: list[list[int]] = [[] for _ in mine]
    for msg, (batch, weighted) in zip(messages, headers, strict=True):
        pos = HEADER
        counts = []
        for j, f in enumerate(n_feat):
            piece = msg[pos : pos + f * batch]
            pos += f * batch
            lengths[j].append(piece)
            rows_from[j].append(f * batch)
            counts.append(int(piece.sum()) if piece.numel() else 0)
        for j, n in enumerate(counts):
            ids[j].append(msg[pos : pos + n])
            pos += n
        for j, n in enumerate(counts):
            if weighted:
                weights[j].append(msg[pos : pos + n].view(torch.float64))
                pos += n
            else:
                weights[j].append(None)
    out = []
    for j in range(len(mine)):
        all_lengths = torch.cat(lengths[j])
        offsets = torch.zeros(all_lengths.numel() + 1, dtype=torch.int64, device=all_lengths.device)
        torch.cumsum(all_lengths, 0, out=offsets[1:])
        w = None
        if any(x is not None for x in weights[j]):
            filled = [
                x if x is not None else torch.ones(i.numel(), dtype=torch.float64, device=i.device)
                for x, i in zip(weights[j], ids[j], strict=True)
            ]
            w = torch.cat(filled).to(routes.sharded[mine[j]].config.dtype)  # embedding_bag wants the table's
        out.append(Inbox(torch.cat(ids[j]), offsets, w, rows_from[j]))
    return out


def no_batch_messages(world: int, device: torch.device) -> list[torch.Tensor]:
    """The input messages of a rank that has no batch left: the header alone, batch size :data:`NO_BATCH`."""
    return [torch.tensor([NO_BATCH, 0], dtype=torch.int64, device=device) for _ in range(world)]


def ranks_without_batch(messages: Sequence[torch.Tensor]) -> list[int]:
    """The ranks whose input message (``messages[r]`` from rank r) says they had no batch left."""
    return [r for r, msg in enumerate(messages) if int(msg[0]) == NO_BATCH]


def uneven_batches(without: Sequence[int], world: int) -> ValueError:
    """The error every rank raises when some ranks ran out of batches while others had one (the same text on each)."""
    others = [r for r in range(world) if r not in without]
    return ValueError(
        f"SparseDistPipeline: the ranks ran out of batches at different steps: rank(s) {list(without)} had no "
        f"next batch while rank(s) {others} had one. Each step's input exchange is collective, so every rank "
        "must iterate over the same number of batches: give each rank as many (split the data evenly and drop "
        "the uneven rest, as DataLoader(drop_last=True) over a DistributedSampler(drop_last=True) does, or pad "
        "the last batch)"
    )


def modified_after_prefetch() -> ValueError:
    """The error ``forward`` raises for a prefetched batch whose ids, lengths or weights changed since."""
    return ValueError(
        "forward: the batch was modified in place after prefetch() had started its exchange (its ids, lengths "
        "or weights changed), so its ids travelled as they were before: change a batch before it is prefetched "
        "(with SparseDistPipeline, in the loader, not in the loop body), and give each batch tensors of its own "
        "(a loader that refills one buffer in place needs a copy per batch, or load_ahead=False)"
    )


@dataclasses.dataclass(frozen=True)
class Dispatched:
    """A batch checked, routed and with its ids' exchange started (or done), waiting to be pooled."""

    # What the caller passed (forward recognises it by identity); None: this rank had no batch left.
    features: Optional[KeyedJaggedTensor]
    batch: int
    per_table: dict[str, tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]
    sent_bytes: int
    exchange: Any  # the ids each rank sent here, or a Work that gives them
    # The features' in-place version counters when the exchange started (prefetched batches only).
    versions: tuple[int, ...] = ()

    def received(self) -> list[torch.Tensor]:
        """The ids each rank sent here (waiting for the exchange if it is still running)."""
        if isinstance(self.exchange, list):
            return self.exchange
        return list(self.exchange.wait())
