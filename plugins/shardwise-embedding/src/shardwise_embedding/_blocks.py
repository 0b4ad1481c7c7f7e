"""A rank's piece of a planned table at run time, and the ShardedTensors that present it.

The sharded collection keeps each table's local block as a plain parameter
(what lookups and optimizers touch); a :class:`LocalBlock` remembers where
that block sits in the table and in the group, so the state dict can show the
table (and any per-element or per-row state of the same layout, such as an
optimizer's) as one ShardedTensor.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch
from torch.utils.weak import WeakIdKeyDictionary

from shardwise import Group, Shard, ShardMetadata, ShardedTensor, ShardedTensorMetadata, TensorProperties
from shardwise_embedding._plan_data import Block, TablePlan

__all__ = ["LocalBlock", "block_of", "register_block"]


@dataclasses.dataclass(frozen=True)
class LocalBlock:
    """This rank's part of one table.

    Attributes:
        table: The table's plan.
        group: The collection's group.
        block: This rank's block; None for a ``data_parallel`` table (the
            whole table is local) and on a rank holding no block of the table.
    """

    table: TablePlan
    group: Group
    block: Optional[Block]

    @property
    def replicated(self) -> bool:
        """Whether every rank holds the whole table (``data_parallel``)."""
        return self.table.sharding_type == "data_parallel"

    @property
    def rows(self) -> tuple[int, int]:
        """``(start, stop)`` of the local rows (``(0, 0)`` on a rank without a block)."""
        if self.replicated:
            return (0, self.table.num_embeddings)
        return (0, 0) if self.block is None else self.block.rows

    @property
    def cols(self) -> tuple[int, int]:
        """``(start, stop)`` of the local columns (``(0, 0)`` on a rank without a block)."""
        if self.replicated:
            return (0, self.table.embedding_dim)
        return (0, 0) if self.block is None else self.block.cols

    @property
    def shape(self) -> tuple[int, int]:
        """The local block's ``(rows, columns)``."""
        return (self.rows[1] - self.rows[0], self.cols[1] - self.cols[0])

    def column_peers(self) -> tuple[int, ...]:
        """Group ranks holding the same rows in the table's other column blocks (in column order)."""
        if self.block is None:
            return ()
        return tuple(
            b.rank
            for b in sorted(self.table.blocks, key=lambda b: b.cols)
            if b.rows == self.block.rows and b.rank != self.block.rank
        )

    def holds_first_columns(self) -> bool:
        """Whether this rank's block starts at column 0 (it speaks for its rows in per-row state)."""
        return self.block is not None and self.block.cols[0] == 0

    def _placement(self, rank: int, device: torch.device) -> str:
        return f"rank:{self.group.ranks[rank]}/{device}"

    def present(self, local: torch.Tensor) -> Union[ShardedTensor, torch.Tensor]:
        """``local`` (this block's shape) as the whole table's ShardedTensor, built without communication.

        For a ``data_parallel`` table ``local`` is the whole table and is
        returned as it is. On a rank without a block ``local`` only gives the
        dtype and device (the ShardedTensor has no local shard there).
        """
        if self.replicated:
            return local
        shards = [
            ShardMetadata([b.rows[0], b.cols[0]], list(b.shape), self._placement(b.rank, local.device))
            for b in self.table.blocks
        ]
        size = torch.Size([self.table.num_embeddings, self.table.embedding_dim])
        held = local if self.block is not None else None
        return self._sharded(held, shards, size, [self.rows[0], self.cols[0]], dtype=local.dtype)

    def present_rows(
        self, local: Optional[torch.Tensor], dtype: torch.dtype = torch.float32
    ) -> Union[ShardedTensor, torch.Tensor]:
        """Per-row state (``[local rows]``) as one ShardedTensor ``[num_embeddings]``.

        Ranks of a table's first column block hold the shards; the other
        column blocks' ranks hold the same values (kept equal by whoever
        updates them) and contribute none, so ``local`` may be None there.
        ``dtype`` is the state's dtype (the same on every rank).
        """
        if self.replicated:
            assert local is not None
            return local
        first = [b for b in self.table.blocks if b.cols[0] == 0]
        device = local.device if local is not None else torch.device("cpu")
        shards = [ShardMetadata([b.rows[0]], [b.shape[0]], self._placement(b.rank, device)) for b in first]
        size = torch.Size([self.table.num_embeddings])
        if not self.holds_first_columns():
            local = None
        return self._sharded(local, shards, size, [self.rows[0]], dtype=dtype)

    def _sharded(
        self,
        local: Optional[torch.Tensor],
        shards: list[ShardMetadata],
        size: torch.Size,
        offsets: list[int],
        dtype: Optional[torch.dtype] = None,
    ) -> ShardedTensor:
        dtype = dtype or (local.dtype if local is not None else torch.float32)
        props = TensorProperties(dtype=dtype, requires_grad=False)
        metadata = ShardedTensorMetadata(shards, size, props)
        mine = [md for md in shards if md.rank == self.group.global_rank and list(md.shard_offsets) == offsets]
        local_shards = [Shard(local.detach(), mine[0])] if (local is not None and mine) else []
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            local_shards, metadata, process_group=self.group
        )


# Which parameter is which table's block: the row-sparse optimizers look it up to name their state after
# the table and lay it out as the table. Weak keys: a dropped module leaves nothing behind. Keyed by
# identity (torch's WeakIdKeyDictionary): weakref.WeakKeyDictionary compares tensor keys with ``==``, which
# is elementwise, so its lookups raise "Boolean value of Tensor ... is ambiguous".
_BLOCKS = WeakIdKeyDictionary()


def register_block(param: torch.Tensor, block: LocalBlock) -> None:
    """Remember that ``param`` holds ``block`` (called by the sharded collection for each table)."""
    _BLOCKS[param] = block


def block_of(param: torch.Tensor) -> Optional[LocalBlock]:
    """The :class:`LocalBlock` ``param`` holds, or None for a parameter of no sharded collection."""
    found = _BLOCKS.get(param)
    return found if isinstance(found, LocalBlock) else None
