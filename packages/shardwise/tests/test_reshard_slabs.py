"""Layout changes moved in parts, packing part k+1 while part k travels.

When a reshard's buffers would exceed the shard, ``redistribute`` moves the
data in parts: slabs of the tensor's row-major order, or every stream
between two ranks cut alike (:func:`shardwise._layout.plan.slab_plans`); on
the backend's path (ranks on several hosts, or ``SHARDWISE_LOCAL_COPY=0``)
each part's all-to-all is asynchronous and the next part is packed
meanwhile. These tests run that path on a group that keeps the backend's
path: every target equals the dense tensor's box, for random layouts and
part counts (tensors with one or two rows in dim 0 too), with and without
the handshake, and the reshard still holds at most twice the local shard,
also where the data that moves has one or two rows or lies in a thin band
of a tall tensor (counted by the buffers a call takes, every one of them).
"""

from __future__ import annotations

import itertools
import math
import threading
from typing import Any, Optional

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardwise
from shardwise._layout.plan import budget, plan
from shardwise._layout.redistribute import executed_slabs, redistribute
from shardwise.sharded_tensor import Shard, ShardMetadata, ShardedTensor, TensorProperties
from shardwise.sharding_spec import ChunkShardingSpec, EnumerableShardingSpec, ShardingSpec

from rank_helpers import box, group_without_local_copy, run

WORLD = 3


def _spec(layout: list[Any], size: list[int]) -> ShardingSpec:
    """``["chunk", dim, ranks]`` or ``["grid", row cuts, col cuts, ranks]`` as a spec of ``size``."""
    if layout[0] == "chunk":
        return ChunkShardingSpec(layout[1], [f"rank:{r}/cpu" for r in layout[2]])
    _, rows, cols, ranks = layout
    edges = [[0, *rows, size[0]], [0, *cols, size[1]]]
    shards = []
    for i in range(len(edges[0]) - 1):
        for j in range(len(edges[1]) - 1):
            k = i * (len(edges[1]) - 1) + j
            offsets = [edges[0][i], edges[1][j]]
            sizes = [edges[0][i + 1] - edges[0][i], edges[1][j + 1] - edges[1][j]]
            shards.append(ShardMetadata(offsets, sizes, f"rank:{ranks[k % len(ranks)]}/cpu"))
    return EnumerableShardingSpec(shards)


def _moves(cases: list[dict[str, Any]]) -> list[str]:
    g = shardwise.get_default_group()
    off = group_without_local_copy(g)
    failures = []
    # One case that surely crosses the wire in several slabs, before the drawn ones.
    rows_to_cols = {"size": [30, 8], "src": ["chunk", 0, [0, 1, 2]], "dst": ["chunk", 1, [2, 1, 0]], "rounds": 3}
    for n, case in enumerate([rows_to_cols, *cases]):
        size = case["size"]
        dense = torch.arange(size[0] * size[1], dtype=torch.float32).reshape(size) + 1000 * n
        props = TensorProperties(dtype=dense.dtype)
        src_md = _spec(case["src"], size).build_metadata(torch.Size(size), props)
        dst_md = _spec(case["dst"], size).build_metadata(torch.Size(size), props)
        mine = [Shard(box(dense, s).clone(), s) for s in src_md.shards_metadata if s.rank == g.rank]
        for trusted in (True, False):
            got = redistribute(mine, src_md, dst_md, off, trusted=trusted, rounds=case["rounds"])
            want = [s for s in dst_md.shards_metadata if s.rank == g.rank]
            if [s.metadata for s in got] != want:
                failures.append(f"{case} trusted={trusted}: targets {[s.metadata for s in got]}")
                continue
            for shard in got:
                if not torch.equal(shard.tensor, box(dense, shard.metadata)):
                    failures.append(f"{case} trusted={trusted}: shard {shard.metadata} differs")
    # The slabs went through asynchronous collectives: the group's worker thread ran them.
    if not any(t.name.endswith("-collectives") for t in threading.enumerate()):
        failures.append("no collectives worker thread: the slabs were not moved asynchronously")
    return failures


@st.composite
def _layouts(draw: Any, size: list[int]) -> list[Any]:
    ranks = draw(st.lists(st.integers(0, WORLD - 1), min_size=1, max_size=2 * WORLD))
    if draw(st.booleans()):
        return ["chunk", draw(st.integers(0, 1)), ranks]
    rows = sorted(draw(st.sets(st.integers(1, size[0] - 1), max_size=3))) if size[0] > 1 else []
    cols = sorted(draw(st.sets(st.integers(1, size[1] - 1), max_size=2))) if size[1] > 1 else []
    return ["grid", rows, cols, ranks]


@st.composite
def _cases(draw: Any) -> dict[str, Any]:
    size = [draw(st.integers(2, 40)), draw(st.integers(1, 12))]
    return {"size": size, "src": draw(_layouts(size)), "dst": draw(_layouts(size)), "rounds": draw(st.integers(2, 5))}


@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck))
@given(cases=st.lists(_cases(), min_size=6, max_size=6))
def test_slabs_in_flight_move_every_layout_exactly(cases: list[dict[str, Any]]) -> None:
    for rank, failures in enumerate(run(_moves, WORLD, cases)):
        assert not failures, f"rank {rank}:\n" + "\n".join(failures)


def _memory_without_local_copy() -> list[float]:
    from shardwise._comm import buffers

    g = group_without_local_copy(shardwise.get_default_group())
    places = [f"rank:{r}/cpu" for r in range(g.size)]
    rows, cols = ChunkShardingSpec(0, places), ChunkShardingSpec(1, places)
    dense = torch.randn(1536, 3072, generator=torch.Generator().manual_seed(7))  # 18 MiB: 6 MiB shards (tracked)
    st0 = shardwise.shard_tensor(dense, rows, src_rank=0, process_group=g)
    shard_bytes = st0.local_tensor().numel() * 4
    ratios = []
    for spec in (cols, rows):
        buffers.reset_peak()
        st0 = st0.reshard(spec)
        ratios.append(buffers.peak_new_bytes() / shard_bytes)
        for shard in st0.local_shards():
            assert torch.equal(shard.tensor, box(dense, shard.metadata))
    return ratios


def test_slabs_in_flight_stay_within_twice_the_shard() -> None:
    from shardwise._comm import buffers

    if not buffers.huge_pages_enabled():
        pytest.skip("needs shardwise's tracked buffers (Linux, SHARDWISE_HUGE_PAGES)")
    for rank, ratios in enumerate(run(_memory_without_local_copy, WORLD)):
        assert all(1 <= x <= 2 for x in ratios), (rank, ratios)


# -- one or two rows in dim 0 ------------------------------------------------------


def _grid_spec(cuts: list[list[int]], size: list[int], ranks: list[int]) -> ShardingSpec:
    """The grid cut at ``cuts`` (per dim) of a tensor of ``size``, cell k on ``ranks[k % len(ranks)]``."""
    edges = [[0, *c, n] for c, n in zip(cuts, size, strict=True)]
    shards = []
    for k, cell in enumerate(itertools.product(*(range(len(e) - 1) for e in edges))):
        offsets = [edges[d][c] for d, c in enumerate(cell)]
        sizes = [edges[d][c + 1] - edges[d][c] for d, c in enumerate(cell)]
        shards.append(ShardMetadata(offsets, sizes, f"rank:{ranks[k % len(ranks)]}/cpu"))
    return EnumerableShardingSpec(shards)


def _few_rows_spec(layout: list[Any], size: list[int]) -> ShardingSpec:
    """``["chunk", dim, ranks]`` or ``["grid", cuts per dim, ranks]`` as a spec of ``size``."""
    if layout[0] == "chunk":
        return ChunkShardingSpec(layout[1], [f"rank:{r}/cpu" for r in layout[2]])
    return _grid_spec(layout[1], size, layout[2])


def _agreed(src_md: Any, dst_md: Any, world: int) -> int:
    """The round count the ranks would agree on (the largest any plan asks for), as ``reshard`` does."""
    return max(plan(src_md, dst_md, r, world).rounds for r in range(world))


def _moves_few_rows(cases: list[dict[str, Any]]) -> list[str]:
    g = shardwise.get_default_group()
    off = group_without_local_copy(g)
    failures = []
    for n, case in enumerate(cases):
        size = case["size"]
        dense = torch.arange(math.prod(size), dtype=torch.float32).reshape(size) + 1000 * n
        props = TensorProperties(dtype=dense.dtype)
        src_md = _few_rows_spec(case["src"], size).build_metadata(torch.Size(size), props)
        dst_md = _few_rows_spec(case["dst"], size).build_metadata(torch.Size(size), props)
        rounds = case["rounds"] or _agreed(src_md, dst_md, g.size)
        mine = [Shard(box(dense, s).clone(), s) for s in src_md.shards_metadata if s.rank == g.rank]
        for trusted in (True, False):
            got = redistribute(mine, src_md, dst_md, off, trusted=trusted, rounds=rounds)
            want = [s for s in dst_md.shards_metadata if s.rank == g.rank and 0 not in s.shard_sizes]
            if [s.metadata for s in got if 0 not in s.metadata.shard_sizes] != want:
                failures.append(f"{case} rounds={rounds} trusted={trusted}: targets {[s.metadata for s in got]}")
                continue
            for shard in got:
                if not torch.equal(shard.tensor, box(dense, shard.metadata)):
                    failures.append(f"{case} rounds={rounds} trusted={trusted}: shard {shard.metadata} differs")
    return failures


@st.composite
def _few_rows_layouts(draw: Any, size: list[int]) -> list[Any]:
    ranks = draw(st.lists(st.integers(0, WORLD - 1), min_size=1, max_size=2 * WORLD))
    if draw(st.booleans()):
        return ["chunk", draw(st.integers(0, len(size) - 1)), ranks]
    cuts = [sorted(draw(st.sets(st.integers(1, n - 1), max_size=3))) if n > 1 else [] for n in size]
    return ["grid", cuts, ranks]


@st.composite
def _few_rows_cases(draw: Any) -> dict[str, Any]:
    size = [draw(st.integers(1, 2)), *draw(st.lists(st.integers(1, 24), min_size=1, max_size=2))]
    return {
        "size": size,
        "src": draw(_few_rows_layouts(size)),
        "dst": draw(_few_rows_layouts(size)),
        "rounds": draw(st.sampled_from([None, 2, 4, 8])),
    }


@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck))
@given(cases=st.lists(_few_rows_cases(), min_size=8, max_size=8))
def test_one_or_two_rows_move_exactly_in_parts(cases: list[dict[str, Any]]) -> None:
    for rank, failures in enumerate(run(_moves_few_rows, WORLD, cases)):
        assert not failures, f"rank {rank}:\n" + "\n".join(failures)


def _worst_in_flight(pl: Any, rounds: int) -> int:
    """The most buffer elements ``pl`` holds at once when run at ``rounds``: two consecutive parts, or the one."""
    parts = executed_slabs(pl, rounds)
    if len(parts) == 1:
        return parts[0].buffer_numel
    return max(a.buffer_numel + b.buffer_numel for a, b in zip(parts, parts[1:], strict=False))


@settings(max_examples=300, deadline=None)
@given(_few_rows_cases(), st.integers(2, 4))
def test_the_agreed_rounds_keep_every_rank_within_its_shard(case: dict[str, Any], world: int) -> None:
    # Plans only (no ranks): at the count the ranks agree on, every rank's buffers in flight fit its budget,
    # give or take the documented element per stream where streams are only a few elements long.
    size = case["size"]
    props = TensorProperties(dtype=torch.float32)
    layouts = [[*layout[:-1], [r % world for r in layout[-1]]] for layout in (case["src"], case["dst"])]
    src_md, dst_md = (_few_rows_spec(x, size).build_metadata(torch.Size(size), props) for x in layouts)
    plans = [plan(src_md, dst_md, r, world) for r in range(world)]
    agreed = max(p.rounds for p in plans)
    for pl in plans:
        if not pl.needs_wire:
            continue
        streams = sum(1 for n in pl.send_counts + pl.recv_counts if n)
        assert _worst_in_flight(pl, agreed) <= budget(pl) + streams, (pl.rank, agreed)
        if pl.rounds == agreed and _worst_in_flight(pl, agreed) > budget(pl):
            # Over its own budget at its own count: only where its streams are a few elements each.
            assert sum(pl.send_counts + pl.recv_counts) < 3 * streams, (pl.rank, agreed)


# -- memory where the moving data has few rows or lies in a band --------------------


def _exact_buffers() -> tuple[int, int]:
    """Have every buffer mapped and counted to the page (the default counts mappings of 4 MiB and more)."""
    from shardwise._comm import buffers

    before = buffers.HUGE_PAGE_MIN_BYTES, buffers._GRAIN
    buffers.HUGE_PAGE_MIN_BYTES, buffers._GRAIN = 1, 4096
    return before


def _peak_ratio(st0: Any, spec: ShardingSpec, dense: torch.Tensor) -> Optional[float]:
    """Reshard ``st0`` to ``spec``: peak new buffer bytes over this rank's shard bytes (None: it holds none)."""
    from shardwise._comm import buffers

    shard_bytes = sum(s.tensor.numel() for s in st0.local_shards()) * dense.element_size()
    buffers.reset_peak()
    st0.reshard(spec)
    peak = buffers.peak_new_bytes()
    for shard in st0.local_shards():
        assert torch.equal(shard.tensor, box(dense, shard.metadata)), shard.metadata
    return peak / shard_bytes if shard_bytes else None


def _memory_of_thin_layouts() -> dict[str, Any]:
    from shardwise._comm import buffers

    saved = _exact_buffers()
    try:
        g = shardwise.get_default_group()
        off = group_without_local_copy(g)
        w = g.size
        places = [f"rank:{r}/cpu" for r in range(w)]
        reversed_twice = [f"rank:{r}/cpu" for r in list(range(w))[::-1] * 2]
        out: dict[str, Any] = {}
        # One and two very wide rows, chunked on dim 1, the placements reversed (the backend's path).
        for rows in (1, 2):
            size = [rows, (1 << 18) // rows]
            dense = torch.arange(1 << 18, dtype=torch.float32).reshape(size)
            st0 = shardwise.shard_tensor(dense, ChunkShardingSpec(1, places), src_rank=0, process_group=off)
            out[f"{rows} row(s)"] = _peak_ratio(st0, ChunkShardingSpec(1, reversed_twice), dense)
        # The moving data in one row of a tall tensor: strips swapped between ranks 0 and 1, the rest unmoved.
        rows, cols, strips = 16, 1 << 16, 4
        width = cols // strips
        band = [[ShardMetadata([0, s * width], [1, width], f"rank:{(s + k) % 2}/cpu") for s in range(strips)]
                for k in (0, 1)]
        rest = [ShardMetadata([1, 0], [rows - 1, cols], f"rank:{w - 1}/cpu")]
        a, b = (EnumerableShardingSpec(x + rest) for x in band)
        dense = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
        props = TensorProperties(dtype=dense.dtype)
        md = a.build_metadata(torch.Size([rows, cols]), props)
        mine = [Shard(box(dense, s).clone(), s) for s in md.shards_metadata if s.rank == g.rank]
        st0 = ShardedTensor._init_from_local_shards_and_global_metadata(mine, md, process_group=off, sharding_spec=a)
        out["band"] = _peak_ratio(st0, b, dense)
        # Default settings: [1, n, 16] chunked on its last dim; runs too short for one-copy reads.
        size = [1, 1 << 14, 16]
        dense = torch.arange(math.prod(size), dtype=torch.float32).reshape(size)
        st0 = shardwise.shard_tensor(dense, ChunkShardingSpec(2, places), src_rank=0)
        out["default"] = _peak_ratio(st0, ChunkShardingSpec(2, reversed_twice), dense)
        return out
    finally:
        buffers.HUGE_PAGE_MIN_BYTES, buffers._GRAIN = saved


def test_thin_layouts_stay_within_twice_the_shard() -> None:
    from shardwise._comm import buffers

    if not buffers.huge_pages_enabled():
        pytest.skip("needs shardwise's tracked buffers (Linux, SHARDWISE_HUGE_PAGES)")
    for rank, ratios in enumerate(run(_memory_of_thin_layouts, 4)):
        for case, ratio in ratios.items():
            assert ratio is None or ratio <= 2, (rank, case, ratios)


def test_thin_layouts_are_moved_in_parts() -> None:
    # The layouts above ask for parts (one round would hold three times the shard), cut in streams or within rows.
    w = 4
    places = [f"rank:{r}/cpu" for r in range(w)]
    reversed_twice = [f"rank:{r}/cpu" for r in list(range(w))[::-1] * 2]
    props = TensorProperties(dtype=torch.float32)
    for size, dim in (([1, 1 << 18], 1), ([2, 1 << 17], 1), ([1, 1 << 14, 16], 2)):
        src_md = ChunkShardingSpec(dim, places).build_metadata(torch.Size(size), props)
        dst_md = ChunkShardingSpec(dim, reversed_twice).build_metadata(torch.Size(size), props)
        plans = [plan(src_md, dst_md, r, w) for r in range(w)]
        assert plans[0].buffer_numel > budget(plans[0]) and plans[0].rounds > 1, size
        agreed = max(p.rounds for p in plans)
        assert all(_worst_in_flight(p, agreed) <= budget(p) for p in plans), size


# -- planning where nothing crosses the wire -------------------------------------------


def test_a_plan_where_nothing_moves_costs_what_concerns_its_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each rank's chunk cut in 8 on the same rank, 4096 ranks: no rank sends anything. Finding that out used
    # to look up every target shard in the index of the sources; now a target inside the box its rank's
    # previous one lay in costs a comparison: a lookup or two per rank, not one per target.
    import time

    from shardwise._vocab.box_index import BoxIndex

    world, reps = 4096, 8
    props = TensorProperties(dtype=torch.float32)
    size = torch.Size([world * reps * 4, 16])
    src = ChunkShardingSpec(0, [f"rank:{r}/cpu" for r in range(world)]).build_metadata(size, props)
    places = [f"rank:{r}/cpu" for r in range(world) for _ in range(reps)]
    dst = ChunkShardingSpec(0, places).build_metadata(size, props)
    start = time.process_time()
    got = plan(src, dst, 2048, world)
    # Generous: measured about 0.08 s, and 0.1-0.2 s with a lookup per target.
    assert time.process_time() - start < 0.3
    assert not got.needs_wire and len(got.local) == reps
    lookups = [0]
    query = BoxIndex.query

    def counted(self: BoxIndex, offsets: Any, sizes: Any) -> Any:
        lookups[0] += 1
        return query(self, offsets, sizes)

    monkeypatch.setattr(BoxIndex, "query", counted)
    plan(src, dst, 2048, world)
    assert lookups[0] <= 2 * world + 2 * reps, lookups  # was one per target: reps * world
    # One target on another rank: every rank runs the collective, also those with nothing of their own to move.
    places[-1] = "rank:0/cpu"
    moved = ChunkShardingSpec(0, places).build_metadata(size, props)
    assert plan(src, moved, 2048, world).needs_wire
