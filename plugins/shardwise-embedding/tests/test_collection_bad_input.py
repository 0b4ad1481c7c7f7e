"""Bad input to a sharded collection: a clear error on every rank, no hang, and the group still works after.

One rank at a time gets the bad input (or every rank, where the input is
shared, such as a plan); the rank at fault raises the real error, the others
:class:`~shardwise.errors.PeerError` naming it. After each case the ranks
run a good step together, which proves nobody was left inside a collective.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import pytest
import torch
from collection_helpers import batch, dense_collection, every_type_plan, every_type_tables
from emb_helpers import battery, battery_results
from shardwise_embedding import (
    EmbeddingBagCollection,
    EmbeddingShardingPlan,
    KeyedJaggedTensor,
    PlanError,
    shard_collection,
)

import shardwise

WORLD = 3


def _expect(fn: Callable[[], Any], at_fault: bool, error: type, match: str) -> None:
    """``fn`` raises ``error`` (matching ``match``) on the rank at fault and PeerError on the others."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - checked below
        name = type(exc).__name__
        if at_fault:
            assert isinstance(exc, error), f"{name}: {exc}"
            assert match in str(exc), str(exc)
        else:
            assert name in ("PeerError", error.__name__), f"{name}: {exc}"
        return
    raise AssertionError("no error raised")


def _good_step(sharded: Any, tables: Any) -> None:
    group = shardwise.get_default_group()
    out = sharded(batch(tables, 2, "good", group.rank))
    out.values().sum().backward()


def _one_rank_input(kind: str) -> None:
    group = shardwise.get_default_group()
    tables = every_type_tables("sum")
    sharded = shard_collection(dense_collection(tables), every_type_plan(tables, group.size))
    kjt = batch(tables, 3, "bad", group.rank)
    fault = group.rank == 1
    if fault:
        if kind == "unknown_feature":
            extra = KeyedJaggedTensor.from_lengths_sync(["nobody"], torch.tensor([1]), torch.tensor([1, 0, 0]))
            kjt = KeyedJaggedTensor.concat([kjt, extra])
        elif kind == "missing_feature":
            kjt = kjt.select(kjt.keys()[1:])
        elif kind == "id_out_of_range":
            values = kjt.values().clone()
            values[-1] = 10_000
            kjt = KeyedJaggedTensor.from_lengths_sync(kjt.keys(), values, kjt.lengths())
        elif kind == "negative_id":
            values = kjt.values().clone()
            values[0] = -1
            kjt = KeyedJaggedTensor.from_lengths_sync(kjt.keys(), values, kjt.lengths())
        elif kind == "lengths_not_summing":
            # The constructor does not validate (from_lengths_sync does): the forward must still catch it.
            kjt = KeyedJaggedTensor(kjt.keys(), kjt.values()[:-1], lengths=kjt.lengths())
    errors = {
        "unknown_feature": (KeyError, "have no table"),
        "missing_feature": (KeyError, "lacks features"),
        "id_out_of_range": (IndexError, "10000 is out of table"),
        "negative_id": (IndexError, "-1 is out of table"),
        "lengths_not_summing": (ValueError, "lengths add up to"),
    }
    error, match = errors[kind]
    _expect(lambda: sharded(kjt), fault, error, match)
    _good_step(sharded, tables)


def _plan_case(kind: str) -> None:
    group = shardwise.get_default_group()
    tables = every_type_tables("sum")
    plan = every_type_plan(tables, group.size)
    fault = True
    if kind == "other_world_size":
        plan = every_type_plan(tables, group.size + 1)
        match = f"for a world of {group.size + 1} ranks"
    elif kind == "other_tables":
        plan = EmbeddingShardingPlan(plan.world_size, plan.tables[:-1])
        match = "tables without a place in it ['tiny']"
    elif kind == "other_table_size":
        wrong = dataclasses.replace(tables[0], num_embeddings=tables[0].num_embeddings + 1)
        tables = [wrong, *tables[1:]]
        match = "but the plan is for"
    elif kind == "over_budget":
        plan = dataclasses.replace(plan, memory_budget_bytes=64)
        match = "does not fit its memory budget of 64 bytes"
    elif kind == "meta_tables":
        match = ""
    elif kind == "different_plans":
        if group.rank == 2:
            swapped = dataclasses.replace(
                plan["tw"], ranks=(0,), blocks=(dataclasses.replace(plan["tw"].blocks[0], rank=0),)
            )
            plan = EmbeddingShardingPlan(plan.world_size, tuple(swapped if t.name == "tw" else t for t in plan.tables))
        match = "ranks passed different plans"
    ebc = dense_collection(tables)
    error: type = PlanError
    if kind == "meta_tables":
        ebc = EmbeddingBagCollection(tables, device="meta")
        error, match = ValueError, "are on the meta device"
    _expect(lambda: shard_collection(ebc, plan), fault, error, match)
    good = every_type_tables("sum")
    _good_step(shard_collection(dense_collection(good), every_type_plan(good, group.size)), good)


def _not_a_plan() -> None:
    group = shardwise.get_default_group()
    tables = every_type_tables("sum")
    plan: Any = (
        every_type_plan(tables, group.size).to_json() if group.rank == 0 else every_type_plan(tables, group.size)
    )
    _expect(
        lambda: shard_collection(dense_collection(tables), plan), group.rank == 0, TypeError, "EmbeddingShardingPlan"
    )


INPUT_KINDS = ("unknown_feature", "missing_feature", "id_out_of_range", "negative_id", "lengths_not_summing")
PLAN_KINDS = ("other_world_size", "other_tables", "other_table_size", "over_budget", "different_plans", "meta_tables")
CASES = INPUT_KINDS + PLAN_KINDS + ("not_a_plan",)


def _cases() -> dict[str, Callable[[], None]]:
    cases: dict[str, Callable[[], None]] = {k: (lambda k=k: _one_rank_input(k)) for k in INPUT_KINDS}
    cases.update({k: (lambda k=k: _plan_case(k)) for k in PLAN_KINDS})
    cases["not_a_plan"] = _not_a_plan
    return cases


def _battery_rank(results_dir: str, only: tuple[str, ...]) -> dict[str, str]:
    return battery(_cases(), results_dir, only)


@pytest.mark.parametrize("case", CASES)
def test_bad_input_fails_on_every_rank_and_leaves_the_group_usable(case: str) -> None:
    results = battery_results(_battery_rank, WORLD, CASES)
    for rank, seen in enumerate(results):
        assert seen.get(case) == "ok", f"rank {rank}: {seen.get(case)}"


def test_a_plan_that_is_not_json() -> None:
    with pytest.raises(PlanError, match="not JSON"):
        EmbeddingShardingPlan.from_json("{nope")


def test_an_edited_plan_whose_blocks_overlap() -> None:
    tables = every_type_tables("sum")
    data = every_type_plan(tables, 2).to_dict()
    rw = next(t for t in data["tables"] if t["name"] == "rw")
    rw["blocks"][1]["rows"][0] -= 1
    with pytest.raises(PlanError, match="overlap"):
        EmbeddingShardingPlan.from_dict(data)
