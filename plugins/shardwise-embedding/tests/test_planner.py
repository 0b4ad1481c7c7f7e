"""The embedding sharding planner: valid plans, budgets, constraints, its choices and their reasons, speed."""

from __future__ import annotations

import random
import time
from typing import Optional

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shardwise_embedding._plan_data import SHARDING_TYPES, EmbeddingShardingPlan, PlanError
from shardwise_embedding._planner import EmbeddingShardingPlanner, ParameterConstraints
from shardwise_embedding._tables import EmbeddingBagCollection, EmbeddingBagConfig

#: The 26 sparse features of the Criteo 1TB click logs (rows per table), as DLRM uses them.
CRITEO_ROWS = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
               5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]  # fmt: skip
MiB, GiB = 1 << 20, 1 << 30
SPLIT = ("row_wise", "table_row_wise", "column_wise", "grid")


def _t(name: str, rows: int, dim: int, features: int = 1, dtype: torch.dtype = torch.float32) -> EmbeddingBagConfig:
    return EmbeddingBagConfig(name, dim, rows, [f"{name}_f{i}" for i in range(features)], dtype=dtype)


def _criteo() -> list[EmbeddingBagConfig]:
    return [_t(f"t{i}", rows, (16, 32, 64, 128)[i % 4]) for i, rows in enumerate(CRITEO_ROWS)]


def _memory(plan: EmbeddingShardingPlan, tables: list[EmbeddingBagConfig], state: float = 1.0) -> list[int]:
    """Each rank's bytes, worked out from the plan's blocks alone (adagrad: one state value per weight)."""
    held = [0] * plan.world_size
    by_name = {t.name: t for t in tables}
    for tp in plan.tables:
        size = by_name[tp.name].dtype.itemsize
        if tp.sharding_type == "data_parallel":
            for r in range(plan.world_size):
                held[r] += int(tp.num_embeddings * tp.embedding_dim * size * (1 + state))
        for b in tp.blocks:
            held[b.rank] += int(b.shape[0] * b.shape[1] * size * (1 + state))
    return held


def _check(plan: EmbeddingShardingPlan, tables: list[EmbeddingBagConfig], world: int, budget: Optional[int]) -> None:
    """What every plan promises: valid, every table in order, loads per rank that add up, within the budget."""
    plan.check(tables, world)
    assert [t.name for t in plan.tables] == [t.name for t in tables]
    assert [x.rank for x in plan.loads] == list(range(world))
    assert [x.memory_bytes for x in plan.loads] == _memory(plan, tables)
    if budget is not None:
        assert max(x.memory_bytes for x in plan.loads) <= budget
    assert all(t.reason for t in plan.tables)
    assert all(t.ranks == tuple(b.rank for b in t.blocks) for t in plan.tables if t.sharding_type != "data_parallel")


tables_st = st.lists(
    st.builds(
        lambda rows, dim, features, half: (rows, dim, features, half),
        st.integers(1, 10**7),
        st.integers(1, 256),
        st.integers(1, 3),
        st.booleans(),
    ),
    min_size=1,
    max_size=8,
).map(
    lambda shapes: [
        _t(f"t{i}", rows, dim, features, torch.float16 if half else torch.float32)
        for i, (rows, dim, features, half) in enumerate(shapes)
    ]
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tables=tables_st, world=st.integers(1, 16), data=st.data())
def test_every_plan_is_valid_and_within_its_budget(
    tables: list[EmbeddingBagConfig], world: int, data: st.DataObject
) -> None:
    per_host = data.draw(st.one_of(st.none(), st.integers(1, world)), label="ranks_per_host")
    total = sum(2 * t.bytes for t in tables)  # adagrad: the weights twice
    budget = data.draw(st.one_of(st.none(), st.integers(max(1, total // (4 * world)), 2 * total)), label="budget")
    planner = EmbeddingShardingPlanner(world, per_host, budget)
    try:
        plan = planner.plan(tables)
    except PlanError as exc:
        # Only a budget can make plain tables fail, and never one that holds all of them on one rank.
        assert budget is not None and budget < total, str(exc)
        message = str(exc)
        assert "the tables need" in message or any(f"table {t.name!r}" in message for t in tables)
        return
    _check(plan, tables, world, budget)
    assert EmbeddingShardingPlan.from_json(plan.to_json()) == plan
    text = plan.explain()
    assert all(t.name in text for t in tables)
    rank_lines = text.split("Per rank", 1)[1].split("Tables:", 1)[0].splitlines()[2:]
    assert [line.split()[0] for line in rank_lines] == [str(r) for r in range(world)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tables=tables_st, world=st.integers(1, 12), data=st.data())
def test_constraints_are_respected(tables: list[EmbeddingBagConfig], world: int, data: st.DataObject) -> None:
    constraints = {}
    for t in tables:
        if not data.draw(st.booleans(), label=f"constrain {t.name}"):
            continue
        types = data.draw(st.one_of(st.none(), st.lists(st.sampled_from(SHARDING_TYPES), min_size=1, unique=True)))
        ranks = data.draw(st.one_of(st.none(), st.lists(st.integers(0, world - 1), min_size=1, unique=True)))
        cap = data.draw(st.one_of(st.none(), st.integers(1, 4 * t.bytes)))
        constraints[t.name] = ParameterConstraints(sharding_types=types, ranks=ranks, max_bytes_per_rank=cap)
    per_host = data.draw(st.one_of(st.none(), st.integers(1, world)), label="ranks_per_host")
    try:
        plan = EmbeddingShardingPlanner(world, per_host, None, constraints).plan(tables)
    except PlanError as exc:
        assert any(f"table {name!r}" in str(exc) for name in constraints), str(exc)
        return
    _check(plan, tables, world, None)
    by_name = {t.name: t for t in tables}
    for tp in plan.tables:
        c = constraints.get(tp.name)
        if c is None:
            continue
        assert c.sharding_types is None or tp.sharding_type in c.sharding_types
        assert c.ranks is None or set(tp.ranks) <= set(c.ranks)
        if c.max_bytes_per_rank is not None:
            shares = [b.shape[0] * b.shape[1] for b in tp.blocks] or [tp.num_embeddings * tp.embedding_dim]
            assert max(shares) * by_name[tp.name].dtype.itemsize * 2 <= c.max_bytes_per_rank


def test_tiny_tables_are_replicated_or_whole_and_world_one_keeps_everything_on_rank_0() -> None:
    tables = [_t("tiny", 4, 16), _t("small", 1000, 16), _t("big", 10**6, 64)]
    plan = EmbeddingShardingPlanner(8).plan(tables)
    assert plan["tiny"].sharding_type == "data_parallel"
    assert "replicated" in plan["tiny"].reason and "4" in plan["tiny"].reason
    assert plan["small"].sharding_type in ("data_parallel", "table_wise")
    solo = EmbeddingShardingPlanner(1).plan(tables)
    _check(solo, tables, 1, None)
    assert all(t.sharding_type in ("data_parallel", "table_wise") and t.ranks == (0,) for t in solo.tables)


def test_medium_tables_are_whole_and_spread_over_the_ranks() -> None:
    tables = [_t(f"m{i}", 50_000, 32) for i in range(8)]
    plan = EmbeddingShardingPlanner(8).plan(tables)
    assert [t.sharding_type for t in plan.tables] == ["table_wise"] * 8
    assert sorted(t.ranks[0] for t in plan.tables) == list(range(8))  # one per rank: balanced


def test_a_table_too_big_for_one_rank_is_split_within_the_budget() -> None:
    huge = _t("huge", 8_000_000, 64)  # 1.9 GiB, 3.8 GiB with adagrad's state
    plan = EmbeddingShardingPlanner(8, memory_budget_bytes=GiB).plan([huge, _t("small", 100, 16)])
    _check(plan, [huge, _t("small", 100, 16)], 8, GiB)
    assert plan["huge"].sharding_type == "row_wise"  # 64 columns: too narrow for column blocks of 128
    assert "too big for one rank's budget of 1.0 GiB" in plan["huge"].reason
    wide = _t("wide", 1_000_000, 512)  # 3.8 GiB with its state
    plan = EmbeddingShardingPlanner(4, memory_budget_bytes=(3 * GiB) // 2).plan([wide])
    assert plan["wide"].sharding_type in SPLIT and max(x.memory_bytes for x in plan.loads) <= (3 * GiB) // 2


def test_a_wide_table_goes_by_columns() -> None:
    # Column blocks send each rank a slice of every vector, where row blocks send whole partial vectors.
    plan = EmbeddingShardingPlanner(4, memory_budget_bytes=(3 * GiB) // 2).plan([_t("wide", 1_000_000, 512)])
    assert plan["wide"].sharding_type in ("column_wise", "grid")
    assert len(plan["wide"].column_cuts) > 1


def test_with_several_hosts_a_large_table_stays_within_a_host() -> None:
    big = _t("big", 4_000_000, 64)  # 1.9 GiB with its state: 8 ranks of one host hold it under 512 MiB each
    plan = EmbeddingShardingPlanner(16, ranks_per_host=8, memory_budget_bytes=512 * MiB).plan([big])
    tp = plan["big"]
    assert tp.sharding_type == "table_row_wise"
    assert tp.ranks in (tuple(range(8)), tuple(range(8, 16)))
    assert "fewer partial vectors per bag" in tp.reason
    one_host = EmbeddingShardingPlanner(16, memory_budget_bytes=512 * MiB).plan([big])
    assert one_host["big"].sharding_type == "row_wise"


def test_hosts_that_do_not_divide_the_world() -> None:
    tables = [_t("big", 3_000_000, 64), *(_t(f"s{i}", 10_000, 16) for i in range(12))]
    plan = EmbeddingShardingPlanner(10, ranks_per_host=4, memory_budget_bytes=400 * MiB).plan(tables)
    _check(plan, tables, 10, 400 * MiB)
    for tp in plan.tables:
        if tp.sharding_type == "table_row_wise":
            assert len({r // 4 for r in tp.ranks}) == 1
    assert plan.ranks_per_host == 4


def test_fewer_rows_than_ranks() -> None:
    tables = [_t("three", 3, 8), _t("one", 1, 4)]
    only_rows = {t.name: ParameterConstraints(sharding_types=["row_wise"]) for t in tables}
    plan = EmbeddingShardingPlanner(8, constraints={"three": only_rows["three"]}).plan(tables)
    _check(plan, tables, 8, None)
    assert plan["three"].sharding_type == "row_wise" and len(plan["three"].ranks) == 3
    with pytest.raises(PlanError, match="table 'one'.*constraints leave no layout"):
        EmbeddingShardingPlanner(8, constraints=only_rows).plan(tables)  # one row cannot be split


def test_narrow_column_cuts_when_only_columns_are_allowed() -> None:
    t = _t("narrow", 1000, 16)
    plan = EmbeddingShardingPlanner(4, constraints={"narrow": ParameterConstraints(["column_wise"])}).plan([t])
    assert plan["narrow"].sharding_type == "column_wise" and len(plan["narrow"].column_cuts) > 1
    assert "constraints allow column_wise" in plan["narrow"].reason


def test_pinned_ranks_and_caps() -> None:
    tables = [_t("a", 200_000, 64), _t("b", 200_000, 64), _t("c", 10, 8)]
    constraints = {
        "a": ParameterConstraints(ranks=[2, 3]),
        "b": ParameterConstraints(max_bytes_per_rank=30 * MiB),  # 97.7 MiB with state: at least 4 blocks
        "c": ParameterConstraints(ranks=[1], pooling_factor=7),
    }
    plan = EmbeddingShardingPlanner(6, constraints=constraints).plan(tables)
    _check(plan, tables, 6, None)
    assert set(plan["a"].ranks) <= {2, 3}
    assert plan["b"].sharding_type in SPLIT and len(plan["b"].blocks) >= 4
    assert plan["c"].ranks == (1,) and plan["c"].sharding_type == "table_wise"
    assert any("c 7" in n for n in plan.notes)


def test_nothing_fits_names_the_table_the_share_and_the_budget() -> None:
    huge = _t("huge", 10_000_000, 128)
    with pytest.raises(PlanError) as info:
        EmbeddingShardingPlanner(4, memory_budget_bytes=MiB).plan([huge, _t("ok", 10, 4)])
    message = str(info.value)
    assert "table 'huge'" in message and "'ok'" not in message
    assert "the smallest share of it on one rank is 2.4 GiB (row_wise over 4 ranks)" in message
    assert "the budget of 1.0 MiB per rank" in message and "raise memory_budget_bytes" in message
    only_whole = {"huge": ParameterConstraints(sharding_types=["table_wise", "data_parallel"])}
    with pytest.raises(
        PlanError, match=r"table 'huge' .*fits no allowed layout: .*\(whole\), over .*allow row_wise for it"
    ):
        EmbeddingShardingPlanner(4, memory_budget_bytes=GiB, constraints=only_whole).plan([huge])
    capped = {"huge": ParameterConstraints(max_bytes_per_rank=MiB)}
    with pytest.raises(PlanError, match="its max_bytes_per_rank of 1.0 MiB"):
        EmbeddingShardingPlanner(4, constraints=capped).plan([huge])
    many = [_t(f"m{i}", 1_000_000, 64) for i in range(8)]  # each fits, all together do not
    with pytest.raises(PlanError, match=r"the tables need 3.8 GiB .* 2 rank\(s\) x 1.0 GiB hold 2.0 GiB"):
        EmbeddingShardingPlanner(2, memory_budget_bytes=GiB).plan(many)
    pinned_dp = {"ok": ParameterConstraints(sharding_types=["data_parallel"], ranks=[0])}
    with pytest.raises(PlanError, match="table 'ok'.*constraints leave no layout"):
        EmbeddingShardingPlanner(2, constraints=pinned_dp).plan([_t("ok", 10, 4)])


def test_bad_arguments_say_what_is_valid() -> None:
    for bad in (0, -1, True, "2", 1.5):
        with pytest.raises(PlanError, match="world_size must be an int >= 1"):
            EmbeddingShardingPlanner(bad)  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="ranks_per_host must be an int >= 1 or None"):
        EmbeddingShardingPlanner(4, ranks_per_host=0)
    with pytest.raises(PlanError, match="memory_budget_bytes must be an int >= 1 or None"):
        EmbeddingShardingPlanner(4, memory_budget_bytes=-5)
    with pytest.raises(PlanError, match="unknown optimizer_state 'lamb'; valid: sgd, adagrad, rowwise_adagrad, adam"):
        EmbeddingShardingPlanner(4, optimizer_state="lamb")
    with pytest.raises(PlanError, match="unknown sharding types \\['rowwise'\\]; valid: data_parallel, table_wise"):
        ParameterConstraints(sharding_types=["rowwise"])
    with pytest.raises(PlanError, match="constraint ranks must be a non-empty list of ints >= 0"):
        ParameterConstraints(ranks=[-1])
    with pytest.raises(PlanError, match="pooling_factor must be a number >= 0"):
        ParameterConstraints(pooling_factor=-2)
    tables = [_t("a", 10, 4)]
    with pytest.raises(PlanError, match="name tables \\['nope'\\] not among \\['a'\\]"):
        EmbeddingShardingPlanner(4, constraints={"nope": ParameterConstraints()}).plan(tables)
    with pytest.raises(PlanError, match="name tables \\['nope'\\]"):
        EmbeddingShardingPlanner(4, pooling_factors={"nope": 2.0}).plan(tables)
    with pytest.raises(PlanError, match="table 'a': constraint ranks \\[4\\] are outside a world of 4"):
        EmbeddingShardingPlanner(4, constraints={"a": ParameterConstraints(ranks=[4])}).plan(tables)
    with pytest.raises(PlanError, match="two tables are named 'a'"):
        EmbeddingShardingPlanner(4).plan(tables + tables)


def test_takes_a_collection_or_its_tables_and_is_deterministic() -> None:
    tables = _criteo()[:8]
    ebc = EmbeddingBagCollection(tables, device="meta")
    planner = EmbeddingShardingPlanner(4, memory_budget_bytes=GiB, batch_size=256, optimizer_state="rowwise_adagrad")
    plan = planner.plan(ebc)
    assert plan == planner.plan(tables) == EmbeddingShardingPlanner(4, memory_budget_bytes=GiB, batch_size=256,
                                                                    optimizer_state="rowwise_adagrad").plan(tables)  # fmt: skip
    assert plan.memory_budget_bytes == GiB
    assert plan.notes[0].startswith("assumed per step: batch 256 per rank; mean ids per bag 1")
    assert "rowwise_adagrad" in plan.notes[0] and "bandwidth" in plan.notes[1]
    plan.check(tables, 4)
    assert EmbeddingShardingPlanner(3).plan([]).tables == ()


def test_explain_names_every_table_rank_choice_and_reason() -> None:
    tables = _criteo()
    plan = EmbeddingShardingPlanner(8, ranks_per_host=4, memory_budget_bytes=4 * GiB).plan(tables)
    text = plan.explain()
    assert text.startswith("Sharding plan for 8 rank(s), 4 per host, budget 4.0 GiB per rank: 26 table(s)")
    assert "chosen: " in text and "of budget" in text
    for tp in plan.tables:
        line = next(line for line in text.splitlines() if line.split()[:1] == [tp.name])
        assert tp.sharding_type in line and tp.reason in line
    rank_lines = text.split("Per rank", 1)[1].split("Tables:", 1)[0].splitlines()[2:]
    assert [line.split()[0] for line in rank_lines] == [str(r) for r in range(8)]


@pytest.mark.parametrize("world", [2, 4, 8, 16, 32, 64, 128])
def test_planning_the_criteo_tables_is_fast(world: int) -> None:
    tables = _criteo()
    for planner in (
        EmbeddingShardingPlanner(world),
        EmbeddingShardingPlanner(world, ranks_per_host=min(8, world), memory_budget_bytes=(40 * GiB) // world),
    ):
        start = time.process_time()
        plan = planner.plan(tables)
        assert time.process_time() - start < 1.0  # CPU time: a guard against a blow-up, not a benchmark
        _check(plan, tables, world, planner.memory_budget_bytes)


def test_planning_a_thousand_tables_on_64_ranks_is_fast() -> None:
    rng = random.Random(0)
    tables = [_t(f"r{i}", rng.randint(1, 10**7), rng.randint(1, 256)) for i in range(1000)]
    budget = 2 * sum(2 * t.bytes for t in tables) // 64
    for planner in (EmbeddingShardingPlanner(64), EmbeddingShardingPlanner(64, 8, budget)):
        start = time.process_time()
        plan = planner.plan(tables)
        assert time.process_time() - start < 1.0  # CPU time: a guard against a blow-up, not a benchmark
        _check(plan, tables, 64, planner.memory_budget_bytes)
