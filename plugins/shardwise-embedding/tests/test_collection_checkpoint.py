"""Checkpoints across plans: save a sharded collection under one plan and world size, load under another.

The tables go through ``shardwise.checkpoint`` (DCP's format): the state
dict holds each table as a ShardedTensor laid out by the plan (or a plain
tensor when replicated), and loading into another plan's state dict
reshards. Each rank checks its blocks against the dense tables every rank
can rebuild from the seed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from collection_helpers import dense_collection, every_type_plan, every_type_tables
from emb_helpers import run
from shardwise_embedding import EmbeddingShardingPlan, TablePlan, make_blocks, shard_collection

import shardwise
import shardwise.checkpoint

SAVED_SEED = 3


def uniform_plan(tables: Any, world: int, kind: str) -> EmbeddingShardingPlan:
    """Every table sharded ``kind`` (table-wise: table i on rank i mod world)."""
    plans = []
    for i, t in enumerate(tables):
        ranks = [i % world] if kind == "table_wise" else list(range(world))
        blocks = make_blocks(kind, t.num_embeddings, t.embedding_dim, ranks)
        used = tuple(sorted({b.rank for b in blocks})) if blocks else tuple(ranks)
        plans.append(TablePlan(t.name, kind, used, t.num_embeddings, t.embedding_dim, blocks))
    return EmbeddingShardingPlan(world, tuple(plans))


def _plan(kind: str, tables: Any, world: int) -> EmbeddingShardingPlan:
    return every_type_plan(tables, world) if kind == "every_type" else uniform_plan(tables, world, kind)


def _assert_blocks_hold(sharded: Any, dense: Any) -> None:
    """Each of this rank's blocks equals its rows and columns of the dense collection's table, exactly."""
    for t in dense.embedding_bag_configs():
        local = sharded.embedding_bags[t.name]
        (r0, r1), (c0, c1) = local.local_block.rows, local.local_block.cols
        expected = dense.embedding_bags[t.name].weight.detach()[r0:r1, c0:c1]
        torch.testing.assert_close(local.weight.detach(), expected, rtol=0, atol=0)


def _save(path: str, kind: str) -> None:
    tables = every_type_tables("sum")
    world = shardwise.get_default_group().size
    sharded = shard_collection(dense_collection(tables, seed=SAVED_SEED), _plan(kind, tables, world))
    shardwise.checkpoint.save({"model": sharded.state_dict(), "step": 7}, path)


def _load(path: str, kind: str) -> None:
    tables = every_type_tables("sum")
    world = shardwise.get_default_group().size
    sharded = shard_collection(dense_collection(tables, seed=11), _plan(kind, tables, world))
    state = {"model": sharded.state_dict(), "step": 0}
    shardwise.checkpoint.load(state, path)
    sharded.load_state_dict(state["model"])
    assert state["step"] == 7
    saved = dense_collection(tables, seed=SAVED_SEED)
    _assert_blocks_hold(sharded, saved)


def _load_dense(path: str) -> None:
    tables = every_type_tables("sum")
    ebc = dense_collection(tables, seed=11)
    state = {"model": ebc.state_dict(), "step": 0}
    shardwise.checkpoint.load(state, path)
    ebc.load_state_dict(state["model"])
    saved = dense_collection(tables, seed=SAVED_SEED)
    for t in tables:
        torch.testing.assert_close(ebc.embedding_bags[t.name].weight, saved.embedding_bags[t.name].weight)


def _dense_into_sharded() -> None:
    tables = every_type_tables("sum")
    world = shardwise.get_default_group().size
    sharded = shard_collection(dense_collection(tables, seed=11), every_type_plan(tables, world))
    saved = dense_collection(tables, seed=SAVED_SEED)
    sharded.load_state_dict(saved.state_dict())
    _assert_blocks_hold(sharded, saved)


def test_save_under_one_plan_load_under_another(tmp_path: Path) -> None:
    every = str(tmp_path / "every-type-2")
    run(_save, 2, every, "every_type")
    for world, kind in ((3, "row_wise"), (4, "every_type")):
        run(_load, world, every, kind)
    run(_load_dense, 1, every)


def test_a_dense_state_dict_loads_into_a_sharded_collection() -> None:
    run(_dense_into_sharded, 3)
