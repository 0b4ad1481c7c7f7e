"""Helpers of the embedding-collection tests, in the test process and inside the ranks.

Every input comes from a seed keyed by what it is for (case, rank, step), so
each rank can rebuild every rank's batch and compute the dense reference of
the whole job itself: the dense collection on every rank's batch, the losses
added up, one backward.
"""

from __future__ import annotations

import zlib
from typing import Optional, Sequence

import torch
from shardwise_embedding._jagged import KeyedJaggedTensor
from shardwise_embedding._plan_data import EmbeddingShardingPlan, TablePlan, make_blocks
from shardwise_embedding._tables import EmbeddingBagCollection, EmbeddingBagConfig

DT = torch.float64


def seed_of(*parts: object) -> int:
    """A stable seed for ``parts``."""
    return zlib.crc32(repr(parts).encode())


def every_type_tables(pooling: str = "sum", dtype: torch.dtype = DT) -> list[EmbeddingBagConfig]:
    """One table per sharding type, uneven sizes, a table shared by two features, a tiny table."""

    def cfg(name: str, rows: int, dim: int, features: Sequence[str], pool: str = "sum") -> EmbeddingBagConfig:
        return EmbeddingBagConfig(
            name=name, embedding_dim=dim, num_embeddings=rows, feature_names=list(features), pooling=pool, dtype=dtype
        )

    return [
        cfg("dp", 7, 4, ["f_dp"], pooling),
        cfg("tw", 20, 6, ["f_tw_a", "f_tw_b"]),
        cfg("rw", 50, 5, ["f_rw"], pooling),
        cfg("cw", 30, 8, ["f_cw"]),
        cfg("twrw", 41, 3, ["f_twrw"], pooling),
        cfg("grid", 33, 6, ["f_grid"]),
        cfg("tiny", 2, 3, ["f_tiny"]),
    ]


def every_type_plan(tables: Sequence[EmbeddingBagConfig], world: int) -> EmbeddingShardingPlan:
    """A hand-made plan putting each table of :func:`every_type_tables` on its own sharding type."""
    ranks = list(range(world))
    half = ranks[: max(1, world // 2)]
    grid_ranks = ranks[: 2 * (world // 2)] or [0]
    choice = {
        "dp": ("data_parallel", ranks, 1),
        "tw": ("table_wise", [world - 1], 1),
        "rw": ("row_wise", ranks, 1),
        "cw": ("column_wise", list(reversed(ranks)), 1),
        "twrw": ("table_row_wise", list(reversed(half)), 1),
        "grid": ("grid", grid_ranks, 2 if world > 1 else 1),
        "tiny": ("row_wise", ranks, 1),
    }
    plans = []
    for t in tables:
        kind, rs, cols = choice[t.name]
        blocks = make_blocks(kind, t.num_embeddings, t.embedding_dim, rs, cols)
        used = tuple(sorted({b.rank for b in blocks})) if blocks else tuple(ranks)
        plans.append(TablePlan(t.name, kind, used, t.num_embeddings, t.embedding_dim, blocks))
    return EmbeddingShardingPlan(world_size=world, tables=tuple(plans))


def dense_collection(tables: Sequence[EmbeddingBagConfig], seed: int = 0) -> EmbeddingBagCollection:
    """The dense collection every rank builds the same way."""
    torch.manual_seed(seed)
    return EmbeddingBagCollection(tables)


def batch(
    tables: Sequence[EmbeddingBagConfig],
    size: int,
    *seed: object,
    weighted: bool = False,
    max_bag: int = 4,
    keys_order: Optional[Sequence[str]] = None,
) -> KeyedJaggedTensor:
    """A random batch of ``size`` samples for every feature (empty bags included)."""
    g = torch.Generator().manual_seed(seed_of(*seed))
    keys, values, lengths = [], [], []
    for t in tables:
        for f in t.feature_names:
            n = torch.randint(0, max_bag + 1, (size,), generator=g)
            keys.append(f)
            lengths.append(n)
            values.append(torch.randint(0, t.num_embeddings, (int(n.sum()),), generator=g))
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys,
        torch.cat(values) if values else torch.empty(0, dtype=torch.int64),
        torch.cat(lengths) if lengths else torch.empty(0, dtype=torch.int64),
        weights=None,
    )
    if weighted:
        w = torch.rand(kjt.values().numel(), generator=g, dtype=DT) + 0.5
        kjt = KeyedJaggedTensor.from_lengths_sync(kjt.keys(), kjt.values(), kjt.lengths(), weights=w)
    if keys_order is not None:
        kjt = kjt.select(list(keys_order))
    return kjt


def probe(width: int, size: int, *seed: object) -> torch.Tensor:
    """Fixed random weights the loss multiplies the output by (so every column gets its own gradient)."""
    g = torch.Generator().manual_seed(seed_of("probe", *seed))
    return torch.randn(size, width, generator=g, dtype=DT)
