"""This rank's tables, and the pooling half of a sharded collection's forward.

:class:`CollectionPooling` is the private base class of
:class:`~shardwise_embedding._collection.ShardedEmbeddingBagCollection`:
once a batch's ids have been exchanged, it pools the blocks this rank holds
for every rank's bags, sends each rank its partial bags (the second
exchange) and assembles each feature's pooled vectors from what the owners
sent. :class:`_LocalTable` is the module holding one table's local part,
which the pooling reads its weights from. The collection itself
(construction, input checks, the ids' exchange and ``prefetch``) stays in
:mod:`shardwise_embedding._collection`; the two are apart only to keep each
module short.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

import shardwise.nn.functional as dist_f
from shardwise import Group, ShardedTensor
from shardwise_embedding._blocks import LocalBlock, register_block
from shardwise_embedding._exchange import Dispatched, Routes, parse_inbox
from shardwise_embedding._grad import SumOverRanks
from shardwise_embedding._keyed_tensor import KeyedTensor
from shardwise_embedding._plan_data import EmbeddingShardingPlan
from shardwise_embedding._tables import EmbeddingBagConfig, TableDict

__all__ = ["CollectionPooling"]


class _LocalTable(nn.Module):
    """One table's local part; in the state dict, the whole table (a ShardedTensor unless replicated)."""

    def __init__(self, block: LocalBlock, weight: torch.Tensor) -> None:
        super().__init__()
        self.local_block = block
        self.weight = nn.Parameter(weight)
        register_block(self.weight, block)

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        weight = self.weight if keep_vars else self.weight.detach()
        destination[prefix + "weight"] = self.local_block.present(weight)

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        key = prefix + "weight"
        if key not in state_dict:
            missing_keys.append(key)
            return
        value = state_dict[key]
        block = self.local_block
        with torch.no_grad():
            if isinstance(value, ShardedTensor):
                offsets = [block.rows[0], block.cols[0]]
                found = [s for s in value.local_shards() if list(s.metadata.shard_offsets) == offsets]
                if block.block is None and not block.replicated:
                    return
                if not found or tuple(found[0].tensor.shape) != tuple(self.weight.shape):
                    error_msgs.append(
                        f"{key}: the ShardedTensor given holds no shard matching this rank's block "
                        f"{block.block}; load a checkpoint saved under another plan with "
                        "shardwise.checkpoint.load(sharded.state_dict(), path), which reshards"
                    )
                    return
                self.weight.copy_(found[0].tensor)
                return
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != (
                block.table.num_embeddings,
                block.table.embedding_dim,
            ):
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                error_msgs.append(
                    f"{key}: expected the whole table {block.table.num_embeddings} x {block.table.embedding_dim} "
                    f"(or a ShardedTensor), got {shape}"
                )
                return
            (r0, r1), (c0, c1) = block.rows, block.cols
            self.weight.copy_(value[r0:r1, c0:c1])


class CollectionPooling(nn.Module):
    """The pooling half of ``ShardedEmbeddingBagCollection.forward``, and its access to this rank's tables.

    The subclass sets every attribute declared here in its ``__init__``.
    """

    group: Group
    plan: EmbeddingShardingPlan
    sparse_grad: bool
    last_exchange_bytes: tuple[int, int]
    embedding_bags: TableDict
    _tables: list[EmbeddingBagConfig]
    _order: list[tuple[str, EmbeddingBagConfig]]
    _routes: Routes
    _dtype: torch.dtype

    def _weight(self, name: str) -> torch.Tensor:
        module = self.embedding_bags[name]
        assert isinstance(module, _LocalTable)
        return module.weight

    def _pool(self, dispatched: Dispatched) -> KeyedTensor:
        """The pooled vectors of a dispatched batch: look up the owned blocks, exchange the partial bags."""
        group, routes = self.group, self._routes
        batch, per_table = dispatched.batch, dispatched.per_table
        replicated = [t for t in self._tables if self.plan[t.name].sharding_type == "data_parallel"]
        # The replicated tables' gradient sum is created before the exchange so that, in backward,
        # autograd runs it after the exchange's backward on every rank (a later node runs first).
        synced = dict(
            zip(
                [t.name for t in replicated],
                SumOverRanks.apply(group, *[self._weight(t.name) for t in replicated]) if replicated else (),
                strict=True,
            )
        )
        received = dispatched.received()
        recv_bytes = sum(m.numel() * 8 for m in received)
        # Raises when peers ran out of batches (SparseDistPipeline's end) where this rank had one.
        inboxes = parse_inbox(routes, group.rank, received)
        pooled_out = self._pool_owned(inboxes)
        pieces = self._exchange_pooled(pooled_out, batch)
        sent_bytes = dispatched.sent_bytes + sum(p.numel() * p.element_size() for p in pooled_out)
        recv_bytes += sum(p.numel() * p.element_size() for p in pieces)
        self.last_exchange_bytes = (sent_bytes, recv_bytes)
        columns = self._assemble(pieces, batch, per_table, synced)
        values = torch.cat(columns, dim=1) if columns else torch.empty(batch, 0, dtype=self._dtype)
        return KeyedTensor([f for f, _ in self._order], [t.embedding_dim for _, t in self._order], values)

    def _pool_owned(self, inboxes: Sequence[Any]) -> list[torch.Tensor]:
        """Pool every block this rank holds for every rank's bags; one flat tensor per destination rank."""
        group, routes = self.group, self._routes
        per_dest: list[list[torch.Tensor]] = [[] for _ in range(group.size)]
        for k, inbox in zip(routes.tables_of_rank[group.rank], inboxes, strict=True):
            weight = self._weight(routes.sharded[k].config.name)
            pooled = F.embedding_bag(
                inbox.ids,
                weight,
                inbox.offsets,
                mode="sum",
                per_sample_weights=inbox.weights,
                include_last_offset=True,
                sparse=self.sparse_grad,
            ).to(self._dtype)
            for r, rows in enumerate(pooled.split(inbox.rows_from)):
                per_dest[r].append(rows.reshape(-1))
        device = self._device()
        return [torch.cat(p) if p else torch.empty(0, dtype=self._dtype, device=device) for p in per_dest]

    def _device(self) -> torch.device:
        for p in self.parameters():
            return p.device
        return torch.device("cpu")

    def _exchange_pooled(self, pooled_out: list[torch.Tensor], batch: int) -> list[torch.Tensor]:
        """Send each rank its partial bags; return, per owner rank, what it sent here (autograd-aware)."""
        group, routes = self.group, self._routes
        device = self._device()
        outputs = []
        for owner in range(group.size):
            n = 0
            for k in routes.tables_of_rank[owner]:
                route = routes.sharded[k]
                c0, c1 = route.cuts[route.cut_of_rank[owner]].cols
                n += len(route.config.feature_names) * batch * (c1 - c0)
            outputs.append(torch.empty(n, dtype=self._dtype, device=device))
        if torch.is_grad_enabled():
            # The backward of this exchange is a collective too: a rank holding no block (nothing it sends
            # requires grad) must still take part in it, or the ranks that do would wait for it forever.
            pooled_out = [p if p.requires_grad else p.detach().requires_grad_() for p in pooled_out]
        return list(dist_f.all_to_all(outputs, pooled_out, group=group))

    def _assemble(
        self,
        pieces: list[torch.Tensor],
        batch: int,
        per_table: dict[str, tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]],
        synced: dict[str, torch.Tensor],
    ) -> list[torch.Tensor]:
        """Each feature's ``[batch, dim]`` pooled vectors, in output order."""
        routes = self._routes
        # Each owner's message holds its tables in plan order: walk them to find each block's partial bags.
        partial: dict[tuple[int, int], list[torch.Tensor]] = {}
        for owner, flat in enumerate(pieces):
            pos = 0
            for k in routes.tables_of_rank[owner]:
                route = routes.sharded[k]
                c = route.cut_of_rank[owner]
                c0, c1 = route.cuts[c].cols
                n_feat = len(route.config.feature_names)
                size = n_feat * batch * (c1 - c0)
                partial.setdefault((k, c), []).append(flat[pos : pos + size].view(n_feat, batch, c1 - c0))
                pos += size
        by_name = {r.config.name: k for k, r in enumerate(routes.sharded)}
        columns = []
        for t in self._tables:
            ids, lengths, weights = per_table[t.name]
            n_feat = len(t.feature_names)
            if t.name in synced:
                offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
                torch.cumsum(lengths, 0, out=offsets[1:])
                pooled = F.embedding_bag(
                    ids,
                    synced[t.name],
                    offsets,
                    mode=t.pooling,
                    per_sample_weights=None if weights is None else weights.to(t.dtype),
                    include_last_offset=True,
                )
                columns += list(pooled.to(self._dtype).view(n_feat, batch, t.embedding_dim).unbind(0))
                continue
            k = by_name[t.name]
            cuts = []
            for c in range(len(routes.sharded[k].cuts)):
                parts = partial[(k, c)]
                total = parts[0]
                for p in parts[1:]:
                    total = total + p
                cuts.append(total)
            table = torch.cat(cuts, dim=2) if len(cuts) > 1 else cuts[0]
            if t.pooling == "mean":
                count = lengths.view(n_feat, batch, 1).clamp(min=1).to(table.dtype)
                table = table / count
            columns += list(table.unbind(0))
        return [c.to(t.dtype) if c.dtype != t.dtype else c for c, (_, t) in zip(columns, self._order, strict=True)]
