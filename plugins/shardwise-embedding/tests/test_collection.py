"""The sharded embedding-bag collection against the dense one: forward, backward, every sharding type.

Each rank runs a battery of cases (one launch per world size); in each case
every rank shards the same dense collection by a plan, looks up its own batch,
and backpropagates a loss of its own. Each rank then rebuilds every rank's
batch and checks its output against the dense collection on its batch, and
its blocks' gradients against the dense gradient of all ranks' losses.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import pytest
import torch
from collection_helpers import DT, batch, dense_collection, every_type_plan, every_type_tables, probe
from emb_helpers import battery, battery_results, run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shardwise_embedding import (
    SHARDING_TYPES,
    EmbeddingBagConfig,
    EmbeddingShardingPlan,
    TablePlan,
    make_blocks,
)
from shardwise_embedding._collection import shard_collection

import shardwise
from shardwise import ShardedTensor

WORLD_SIZES = (1, 2, 3, 4)


def _grad_of(param: torch.Tensor) -> torch.Tensor:
    g = param.grad
    assert g is not None, "no gradient"
    return g.to_dense() if g.is_sparse else g


def _check_against_dense(
    tables: Any,
    plan: Any,
    *,
    weighted: bool,
    sizes: list[int],
    seed: str,
    steps: int = 1,
    sparse: bool = True,
    tol: float = 1e-9,
    prefetch: bool = False,
) -> None:
    group = shardwise.get_default_group()
    world, rank = group.size, group.rank
    ebc = dense_collection(tables)
    sharded = shard_collection(ebc, plan, sparse_grad=sparse)
    width = sum(t.embedding_dim * len(t.feature_names) for t in tables)
    for step in range(steps):
        order = list(reversed([f for t in tables for f in t.feature_names]))  # any key order is accepted
        kjt = batch(tables, sizes[rank], seed, rank, step, weighted=weighted, keys_order=order)
        if prefetch:  # the ids travel ahead (SparseDistPipeline's path); forward takes them
            sharded.prefetch(kjt)
        out = sharded(kjt)
        (out.values() * probe(width, sizes[rank], seed, rank, step)).sum().backward()
        ebc.zero_grad()
        total = None
        for r in range(world):
            dense_out = ebc(batch(tables, sizes[r], seed, r, step, weighted=weighted, keys_order=order))
            loss = (dense_out.values() * probe(width, sizes[r], seed, r, step)).sum()
            total = loss if total is None else total + loss
            if r == rank:
                assert out.keys() == dense_out.keys()
                torch.testing.assert_close(out.values(), dense_out.values().detach(), rtol=tol, atol=tol)
        assert total is not None
        total.backward()
        for t in tables:
            local = sharded.embedding_bags[t.name]
            block = local.local_block
            (r0, r1), (c0, c1) = block.rows, block.cols
            dense_grad = ebc.embedding_bags[t.name].weight.grad[r0:r1, c0:c1]
            if local.weight.numel():
                torch.testing.assert_close(_grad_of(local.weight), dense_grad, rtol=tol, atol=tol)
            local.weight.grad = None


def _cases() -> dict[str, Callable[[], None]]:
    world = shardwise.get_default_group().size
    sum_tables = every_type_tables("sum")
    mean_tables = every_type_tables("mean")
    sizes = [3 + r for r in range(world)]
    # Every other table float32 (the replicated one too), the rest float64: outputs travel in the widest.
    mixed = [dataclasses.replace(t, dtype=torch.float32) if i % 2 == 0 else t for i, t in enumerate(sum_tables)]
    return {
        "every_type_sum_weighted": lambda: _check_against_dense(
            sum_tables, every_type_plan(sum_tables, world), weighted=True, sizes=sizes, seed="w", steps=2
        ),
        "every_type_mean": lambda: _check_against_dense(
            mean_tables, every_type_plan(mean_tables, world), weighted=False, sizes=sizes, seed="m"
        ),
        "a_rank_with_no_samples": lambda: _check_against_dense(
            sum_tables, every_type_plan(sum_tables, world), weighted=False, sizes=[0] + sizes[1:], seed="e"
        ),
        "dense_gradients": lambda: _check_against_dense(
            sum_tables, every_type_plan(sum_tables, world), weighted=False, sizes=sizes, seed="d", sparse=False
        ),
        "float32_and_float64_tables": lambda: _check_against_dense(
            mixed, every_type_plan(mixed, world), weighted=True, sizes=sizes, seed="x", tol=1e-5
        ),
        "exactly_two_exchanges_per_forward": _count_exchanges,
        "state_dict_holds_sharded_tensors": _state_dict_case,
    }


def _count_exchanges() -> None:
    group = shardwise.get_default_group()
    tables = every_type_tables("sum")
    sharded = shard_collection(dense_collection(tables), every_type_plan(tables, group.size))
    calls: list[str] = []
    names = ("all_to_all", "all_to_all_single", "all_reduce", "all_gather", "reduce_scatter", "broadcast", "agree")
    originals = {n: getattr(group, n) for n in names}

    def counting(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return originals[name](*args, **kwargs)

        return call

    for n in names:
        setattr(group, n, counting(n))
    try:
        out = sharded(batch(tables, 5, "count", group.rank))
        forward_calls = list(calls)
        out.values().sum().backward()
    finally:
        for n in names:
            delattr(group, n)
    # ids and lengths of every table out in one all-to-all, pooled vectors of every table back in another
    assert len(forward_calls) == 2 and all(c.startswith("all_to_all") for c in forward_calls), forward_calls
    # backward: the pooled vectors' gradients retrace the second exchange, then one sum of the replicated tables'
    backward_calls = calls[2:]
    assert len(backward_calls) == 2, backward_calls
    assert backward_calls[0].startswith("all_to_all") and backward_calls[1] == "all_reduce", backward_calls


def _state_dict_case() -> None:
    group = shardwise.get_default_group()
    tables = every_type_tables("sum")
    ebc = dense_collection(tables)
    sharded = shard_collection(ebc, every_type_plan(tables, group.size))
    state = sharded.state_dict()
    assert sorted(state) == sorted(f"embedding_bags.{t.name}.weight" for t in tables)
    for t in tables:
        value = state[f"embedding_bags.{t.name}.weight"]
        if t.name == "dp":
            assert isinstance(value, torch.Tensor) and not isinstance(value, ShardedTensor)
            continue
        assert isinstance(value, ShardedTensor)
        assert tuple(value.size()) == (t.num_embeddings, t.embedding_dim)
        dense = ebc.embedding_bags[t.name].weight.detach()
        for shard in value.local_shards():
            (r0, c0), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            torch.testing.assert_close(shard.tensor, dense[r0 : r0 + nr, c0 : c0 + nc])
    # A fresh sharding loads the state dict back (same plan): values equal.
    other = shard_collection(dense_collection(tables, seed=7), every_type_plan(tables, group.size))
    other.load_state_dict(state)
    for t in tables:
        torch.testing.assert_close(other.embedding_bags[t.name].weight, sharded.embedding_bags[t.name].weight)


def _battery_rank(results_dir: str, only: tuple[str, ...]) -> dict[str, str]:
    return battery(_cases(), results_dir, only)


CASES = (
    "every_type_sum_weighted",
    "every_type_mean",
    "a_rank_with_no_samples",
    "dense_gradients",
    "float32_and_float64_tables",
    "exactly_two_exchanges_per_forward",
    "state_dict_holds_sharded_tensors",
)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("case", CASES)
def test_collection_equals_dense(world_size: int, case: str) -> None:
    results = battery_results(_battery_rank, world_size, CASES)
    for rank, seen in enumerate(results):
        assert seen.get(case) == "ok", f"rank {rank}: {seen.get(case)}"


def test_make_blocks_tile_every_type() -> None:
    for kind, ranks, cols in (
        ("table_wise", [2], 1),
        ("row_wise", [0, 1, 2], 1),
        ("column_wise", [1, 0], 1),
        ("table_row_wise", [3, 2], 1),
        ("grid", [0, 1, 2, 3], 2),
    ):
        blocks = make_blocks(kind, 11, 7, ranks, cols)
        cells = torch.zeros(11, 7, dtype=torch.int64)
        for b in blocks:
            cells[b.rows[0] : b.rows[1], b.cols[0] : b.cols[1]] += 1
        assert bool((cells == 1).all()), kind


# -- hypothesis: random tables, random plans, random batches -------------------------------------------------


@st.composite
def _case_specs(draw: Any, world: int) -> dict[str, Any]:
    n_tables = draw(st.integers(1, 4))
    tables, plans = [], []
    for i in range(n_tables):
        rows, dim = draw(st.integers(1, 40)), draw(st.integers(1, 9))
        n_feat = draw(st.integers(1, 2))
        pooling = draw(st.sampled_from(["sum", "mean"]))
        kind = draw(st.sampled_from(SHARDING_TYPES))
        order = draw(st.permutations(list(range(world))))
        cols = 1
        if kind == "table_wise":
            ranks = order[:1]
        elif kind == "row_wise":
            ranks = order
        elif kind in ("column_wise", "table_row_wise"):
            ranks = order[: draw(st.integers(1, world))]
        elif kind == "grid":
            cols = draw(st.sampled_from([c for c in (1, 2) if c <= world]))
            ranks = order[: cols * draw(st.integers(1, world // cols))]
        else:
            ranks = order
        tables.append([f"t{i}", rows, dim, [f"t{i}f{j}" for j in range(n_feat)], pooling])
        plans.append([kind, ranks, cols])
    sizes = [draw(st.integers(0, 4)) for _ in range(world)]
    weighted = draw(st.booleans())
    return {"tables": tables, "plans": plans, "sizes": sizes, "weighted": weighted}


def _build(spec: dict[str, Any], world: int) -> tuple[list[EmbeddingBagConfig], EmbeddingShardingPlan]:
    weighted = spec["weighted"]
    tables = [
        EmbeddingBagConfig(
            name=n, num_embeddings=r, embedding_dim=d, feature_names=f, pooling="sum" if weighted else p, dtype=DT
        )
        for n, r, d, f, p in spec["tables"]
    ]
    plans = []
    for t, (kind, ranks, cols) in zip(tables, spec["plans"], strict=True):
        blocks = make_blocks(kind, t.num_embeddings, t.embedding_dim, ranks, cols)
        used = tuple(sorted({b.rank for b in blocks})) if blocks else tuple(range(world))
        plans.append(TablePlan(t.name, kind, used, t.num_embeddings, t.embedding_dim, blocks))
    return tables, EmbeddingShardingPlan(world, tuple(plans))


def _random_cases(specs: list[dict[str, Any]]) -> list[str]:
    world = shardwise.get_default_group().size
    cases = {}
    for i, spec in enumerate(specs):
        tables, plan = _build(spec, world)
        cases[f"case{i}"] = lambda tables=tables, plan=plan, spec=spec, i=i: _check_against_dense(
            tables, plan, weighted=spec["weighted"], sizes=spec["sizes"], seed=f"h{i}", prefetch=i % 2 == 1
        )
    results = battery(cases)
    return [f"{name}: {spec} -> {results.get(name, 'not run')}" for name, spec in zip(cases, specs, strict=True)
            if results.get(name) != "ok"]


@pytest.mark.parametrize("world_size", (2, 3, 4))
@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_random_tables_and_plans_equal_dense(world_size: int, data: Any) -> None:
    specs = data.draw(st.lists(_case_specs(world_size), min_size=8, max_size=8))
    failures = run(_random_cases, world_size, specs)
    assert all(not f for f in failures), "\n".join(x for f in failures for x in f)
