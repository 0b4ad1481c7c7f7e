"""One-copy layout changes whose boxes are cut between their two ends (``shardwise._comm.box_moves``).

The cut rule is checked alone (both ends agree, and it evens a pair's and a
star's work as well as any cut can), and the layout changes it drives are
checked against the dense tensor on 2-4 ranks, over layouts drawn by
hypothesis and under several cost models (so that boxes are read, written and
cut at many places).
"""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardwise
from shardwise._comm import box_moves, buffers, local_copy

from rank_helpers import box, run


def _box(src_rank: int, dst_rank: int, rows: int, cols: int = 4) -> box_moves.BoxMove:
    return box_moves.BoxMove(src_rank, dst_rank, 0, (rows, cols), (0, 0), 0, (rows, cols), (0, 0), (rows, cols))


def _work(boxes: list[box_moves.BoxMove], local: list[int], cost: list[tuple[int, int]], world: int) -> list[float]:
    """Each rank's work once every box is cut by :func:`box_moves.pushed_rows` (from the ranks' own views)."""
    rows = [
        box_moves.loads(
            [b for b in boxes if me in (b.src_rank, b.dst_rank)],
            me,
            local[me],
            [c for b, c in zip(boxes, cost, strict=True) if me in (b.src_rank, b.dst_rank)],
        )
        for me in range(world)
    ]
    work = [float(x) for x in local]
    for b, (read, write) in zip(boxes, cost, strict=True):
        n = b.sizes[0]
        pushed = box_moves.pushed_rows(b, (read, write), rows)
        assert 0 <= pushed <= n
        work[b.src_rank] += write * pushed / n
        work[b.dst_rank] += read * (n - pushed) / n
    return work


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 64),
    local=st.tuples(st.integers(0, 10**6), st.integers(0, 10**6)),
    read=st.integers(1, 10**6),
    write=st.integers(1, 10**6),
)
def test_a_pair_is_cut_as_evenly_as_any_cut_can(n: int, local: tuple[int, int], read: int, write: int) -> None:
    b = _box(0, 1, n)
    got = max(_work([b], list(local), [(read, write)], 2))
    # Every cut at a row: none does better than the rule by more than one row's cost.
    best = min(max(local[0] + write * k / n, local[1] + read * (n - k) / n) for k in range(n + 1))
    assert got <= best + max(read, write) / n + 1e-6


@settings(max_examples=100, deadline=None)
@given(
    leaves=st.integers(1, 6),
    rows=st.integers(64, 512),
    root_local=st.integers(0, 10**6),
    read=st.integers(1, 10**5),
    write=st.integers(1, 10**5),
    outward=st.booleans(),
)
def test_a_star_is_evened_for_any_number_of_ranks(
    leaves: int, rows: int, root_local: int, read: int, write: int, outward: bool
) -> None:
    # A scatter (the root sends a box to each leaf) or a gather (each leaf sends one to the root).
    boxes = [_box(0, leaf, rows) if outward else _box(leaf, 0, rows) for leaf in range(1, leaves + 1)]
    work = _work(boxes, [root_local] + [0] * leaves, [(read * rows, write * rows)] * leaves, leaves + 1)
    # The root's cost per row it copies, and a leaf's: the sender writes, the receiver reads.
    root_row, leaf_row = (write, read) if outward else (read, write)
    # By symmetry the best cut gives every leaf the same k rows (the rest copied by the root).
    best = min(max(root_local + leaves * root_row * (rows - k), leaf_row * k) for k in range(rows + 1))
    assert max(work) <= best + leaves * max(read, write) + 1e-6


def test_a_tie_is_read_and_an_even_exchange_keeps_each_box_with_its_cheaper_end() -> None:
    # Two ranks swapping equal boxes: loads are equal, so nothing is cut.
    boxes = [_box(0, 1, 8), _box(1, 0, 8)]
    rows = [box_moves.loads(boxes, me, 100, [(50, 50), (50, 50)]) for me in (0, 1)]
    assert [box_moves.pushed_rows(b, (50, 50), rows) for b in boxes] == [0, 0]  # both read
    rows = [box_moves.loads(boxes, me, 100, [(90, 50), (90, 50)]) for me in (0, 1)]
    assert [box_moves.pushed_rows(b, (90, 50), rows) for b in boxes] == [8, 8]  # both written


@settings(max_examples=200, deadline=None)
@given(data=st.data(), dims=st.integers(1, 3))
def test_remote_runs_count_the_iovecs_the_copy_takes(data: Any, dims: int) -> None:
    src_shape = [data.draw(st.integers(1, 5)) for _ in range(dims)]
    dst_shape = [data.draw(st.integers(1, 5)) for _ in range(dims)]
    sizes = [data.draw(st.integers(1, min(a, b))) for a, b in zip(src_shape, dst_shape, strict=True)]
    src_start = [data.draw(st.integers(0, a - n)) for a, n in zip(src_shape, sizes, strict=True)]
    dst_start = [data.draw(st.integers(0, a - n)) for a, n in zip(dst_shape, sizes, strict=True)]
    b = box_moves.BoxMove(
        0, 1, 0, tuple(src_shape), tuple(src_start), 0, tuple(dst_shape), tuple(dst_start), tuple(sizes)
    )  # fmt: skip
    runs = box_moves.box_runs(b, 4, 1 << 20, 1 << 30)
    dst_iovecs = local_copy._segments(runs[:, 0], runs[:, 2]).shape[0]
    src_iovecs = local_copy._segments(runs[:, 1], runs[:, 2]).shape[0]
    assert box_moves.remote_runs(b, pushed=False) == src_iovecs
    assert box_moves.remote_runs(b, pushed=True) == dst_iovecs
    read, write = box_moves.costs(b, 4, 1, 0)
    assert read == b.numel * 4 + src_iovecs * box_moves.IOVEC_COST
    assert write == b.numel * 4 * box_moves.SMALL_PAGE_COST + dst_iovecs * box_moves.IOVEC_COST


def test_huge_page_buffers_are_known_while_in_use() -> None:
    big = buffers.empty((buffers.HUGE_PAGE_MIN_BYTES // 4,), torch.float32)
    assert buffers.huge_pages_enabled() == buffers.on_huge_pages(big)
    assert buffers.on_huge_pages(big[7:]) == buffers.on_huge_pages(big)  # a view inside the mapping
    assert not buffers.on_huge_pages(torch.empty(buffers.HUGE_PAGE_MIN_BYTES // 4))
    at = big.data_ptr()
    del big
    assert not any(start <= at < start + size for start, size in buffers._spans.items())


# -- on ranks --------------------------------------------------------------------------------------------

Case = tuple[int, int, int, int, int, int, int]  # rows, cols, from dim, to dim, source rank, gather rank, seed


def _spec(dim: int, world: int, seed: int) -> Any:
    order = torch.randperm(world, generator=torch.Generator().manual_seed(seed)).tolist()
    return shardwise.ChunkShardingSpec(dim=dim, placements=[f"rank:{r}/cpu" for r in order])


def _check(st_: Any, dense: torch.Tensor, what: str) -> None:
    for s in st_.local_shards():
        assert torch.equal(s.tensor, box(dense, s.metadata)), what


def _layout_changes(cases: list[Case], page_cost: int, iovec_cost: int) -> dict[str, int]:
    box_moves.SMALL_PAGE_COST, box_moves.IOVEC_COST = page_cost, iovec_cost
    g = shardwise.get_default_group()
    w = g.size
    calls = {"read": 0, "write": 0}
    real = local_copy._read_runs, local_copy._write_runs

    def counted(kind: str, fn: Any) -> Any:
        def copy(pid: int, runs: torch.Tensor) -> int:
            calls[kind] += 1
            return int(fn(pid, runs))

        return copy

    local_copy._read_runs, local_copy._write_runs = counted("read", real[0]), counted("write", real[1])
    try:
        for rows, cols, src_dim, dst_dim, src, dst, seed in cases:
            dense = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
            st_ = shardwise.shard_tensor(dense, _spec(src_dim, w, seed), src_rank=src % w, process_group=g)
            _check(st_, dense, "shard_tensor")
            st_.reshard(_spec(dst_dim, w, seed + 1))
            _check(st_, dense, "reshard")
            out = torch.empty_like(dense) if g.rank == dst % w else None
            st_.gather(dst=dst % w, out=out)
            assert out is None or torch.equal(out, dense), "gather"
    finally:
        local_copy._read_runs, local_copy._write_runs = real
    return {**calls, "boxes": local_copy.stats.get("boxes", 0)}


_case = st.tuples(
    st.integers(1, 40),
    st.integers(64, 700),  # wide enough rows that most column boxes take the one-copy path
    st.integers(0, 1),
    st.integers(0, 1),
    st.integers(0, 3),
    st.integers(0, 3),
    st.integers(0, 10**6),
)


@pytest.mark.parametrize("world_size", [2, 3, 4])
@settings(max_examples=2, deadline=None)
@given(
    cases=st.lists(_case, min_size=6, max_size=6),
    model=st.sampled_from([(2, 8 << 10), (1, 0), (5, 1 << 20)]),
)
def test_layout_changes_with_boxes_cut_between_their_ends_equal_the_dense_tensor(
    world_size: int, cases: list[Case], model: tuple[int, int]
) -> None:
    for res in run(_layout_changes, world_size, cases, *model):
        assert res["boxes"] > 0


def _big_scatter_and_gather() -> dict[str, int]:
    # 8 MiB: the shards live on huge-page buffers, the dense tensor and ``out`` in 4 KiB pages.
    return _layout_changes([(2048, 1024, 0, 1, 0, 0, 5), (2048, 1024, 1, 0, 1, 1, 6)], 2, 8 << 10)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="cross-memory attach is Linux only")
def test_a_scatters_root_and_a_gathers_senders_write_part_of_the_boxes() -> None:
    results = run(_big_scatter_and_gather, 2)
    # Each rank both read and wrote: the roots handed part of the copying over.
    assert all(res["read"] > 0 and res["write"] > 0 for res in results), results
    assert math.prod(res["boxes"] for res in results) > 0
