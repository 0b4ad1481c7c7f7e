"""Layout changes moved in dim-0 slabs, packing slab k+1 while slab k travels.

When a reshard's buffers would exceed the shard, ``redistribute`` moves the
data in slabs; on the backend's path (ranks on several hosts, or
``SHARDWISE_LOCAL_COPY=0``) each slab's all-to-all is asynchronous and the
next slab is packed meanwhile. These tests run that path on a group that
keeps the backend's path: every target equals the dense tensor's box, for
random layouts and slab counts, with and without the handshake, and the
reshard still holds at most twice the local shard.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardwise
from shardwise._layout.redistribute import redistribute
from shardwise.sharded_tensor import Shard, ShardMetadata, TensorProperties
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
