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
from typing import Any, Optional

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardwise
from shardwise._comm import box_moves, buffers, copy_rates, cross_memory, local_copy
from shardwise._comm.copy_rates import SCALE

from rank_helpers import box, run


def _box(src_rank: int, dst_rank: int, rows: int, cols: int = 4, src: int = 0, dst: int = 0) -> box_moves.BoxMove:
    return box_moves.BoxMove(src_rank, dst_rank, src, (rows, cols), (0, 0), dst, (rows, cols), (0, 0), (rows, cols))


Prices = Optional[tuple[int, int]]


def _cuts(
    boxes: list[box_moves.BoxMove], local: list[int], src_huge: list[int], dst_huge: list[int], world: int,
    prices: Prices = None,
) -> tuple[list[int], list[box_moves.Loads]]:  # fmt: skip
    """Every box's cut as its ends compute it: each rank publishes its shares from its own boxes alone."""
    n_src, n_dst = len(src_huge), len(dst_huge)
    rows = [
        box_moves.shares([b for b in boxes if me in (b.src_rank, b.dst_rank)], me, local[me], 1, n_src, n_dst)
        for me in range(world)
    ]
    everyone = box_moves.loads(rows, src_huge, dst_huge, prices)
    return [box_moves.pushed_rows(b, everyone) for b in boxes], everyone


def _price(b: box_moves.BoxMove, huge: int, pushed: bool, prices: Prices = None) -> float:
    """What copying all of ``b`` costs the end that does it (one byte per element), in local bytes."""
    small, huge_price = prices if prices is not None else (box_moves.SMALL_PAGE_COST * SCALE, SCALE)
    per_byte = (huge_price if huge else small) / SCALE
    return b.numel * per_byte + box_moves.remote_runs(b, pushed) * box_moves.IOVEC_COST


def _work(boxes: list[box_moves.BoxMove], local: list[int], src_huge: list[int], dst_huge: list[int],
          world: int, prices: Prices = None) -> list[float]:  # fmt: skip
    """Each rank's priced work once every box is cut."""
    cuts, _ = _cuts(boxes, local, src_huge, dst_huge, world, prices)
    work = [float(x) for x in local]
    for b, pushed in zip(boxes, cuts, strict=True):
        n = b.sizes[0]
        assert 0 <= pushed <= n
        work[b.src_rank] += _price(b, dst_huge[b.dst], True, prices) * pushed / n
        work[b.dst_rank] += _price(b, src_huge[b.src], False, prices) * (n - pushed) / n
    return work


@settings(max_examples=200, deadline=None)
@given(
    rows=st.integers(1, 64),
    cols=st.integers(1, 16),
    local=st.tuples(st.integers(0, 2000), st.integers(0, 2000)),
    huge=st.tuples(st.integers(0, 1), st.integers(0, 1)),
    strided=st.sampled_from(["neither", "source", "target"]),
    prices=st.one_of(st.none(), st.tuples(st.integers(SCALE // 2, 4 * SCALE), st.integers(SCALE // 2, 4 * SCALE))),
)
def test_a_pair_is_cut_as_evenly_as_any_cut_can(
    rows: int, cols: int, local: tuple[int, int], huge: tuple[int, int], strided: str, prices: Prices
) -> None:
    # Under the default prices and under any measured ones (copy_rates.prices' range).
    box_moves.IOVEC_COST = 3  # comparable to a row's bytes here, so strided sides matter
    try:
        wide = 2 * cols
        src_shape, dst_shape = (rows, wide if strided == "source" else cols), (rows, wide if strided == "target" else cols)
        b = box_moves.BoxMove(0, 1, 0, src_shape, (0, 0), 0, dst_shape, (0, 0), (rows, cols))
        got = max(_work([b], list(local), [huge[0]], [huge[1]], 2, prices))
        write, read = _price(b, huge[1], True, prices), _price(b, huge[0], False, prices)
        # Every cut at a row: none does better than the rule by more than one row's cost.
        best = min(max(local[0] + write * k / rows, local[1] + read * (rows - k) / rows) for k in range(rows + 1))
        assert got <= best + max(read, write) / rows + 1e-6
    finally:
        box_moves.IOVEC_COST = 8 << 10


@settings(max_examples=100, deadline=None)
@given(
    leaves=st.integers(1, 6),
    rows=st.integers(64, 512),
    root_local=st.integers(0, 10**5),
    root_huge=st.integers(0, 1),
    leaf_huge=st.integers(0, 1),
    outward=st.booleans(),
)
def test_a_star_is_evened_for_any_number_of_ranks(
    leaves: int, rows: int, root_local: int, root_huge: int, leaf_huge: int, outward: bool
) -> None:
    # A scatter (the root's source shard 0 feeds each leaf's target shard) or a gather (each leaf's source shard
    # feeds the root's target shard 0); no iovec costs, so only bytes and page sizes matter.
    box_moves.IOVEC_COST = 0
    try:
        if outward:
            boxes = [_box(0, leaf, rows, src=0, dst=leaf - 1) for leaf in range(1, leaves + 1)]
            src_huge, dst_huge = [root_huge], [leaf_huge] * leaves
        else:
            boxes = [_box(leaf, 0, rows, src=leaf - 1, dst=0) for leaf in range(1, leaves + 1)]
            src_huge, dst_huge = [leaf_huge] * leaves, [root_huge]
        work = _work(boxes, [root_local] + [0] * leaves, src_huge, dst_huge, leaves + 1)
        # Per row (4 bytes): a leaf's far side is the root's shard, the root's far side a leaf's.
        cost_leaf = (1 if root_huge else box_moves.SMALL_PAGE_COST) * 4
        cost_root = (1 if leaf_huge else box_moves.SMALL_PAGE_COST) * 4
        # By symmetry the best cut gives every leaf the same k rows (the rest copied by the root).
        best = min(max(root_local + leaves * cost_root * (rows - k), cost_leaf * k) for k in range(rows + 1))
        assert max(work) <= best + leaves * max(cost_leaf, cost_root) + 1e-6
    finally:
        box_moves.IOVEC_COST = 8 << 10


def test_an_even_exchange_keeps_each_box_with_the_end_whose_far_side_is_contiguous() -> None:
    # Two ranks swapping equal boxes: loads are equal, so nothing is cut. A box contiguous on both sides is
    # read; one strided in its source (a column block of a wider shard) is written.
    plain = [_box(0, 1, 8), _box(1, 0, 8)]
    cuts, _ = _cuts(plain, [100, 100], [1], [1], 2)
    assert cuts == [0, 0]
    strided = [
        box_moves.BoxMove(s, 1 - s, 0, (8, 8), (0, 0), 0, (8, 4), (0, 0), (8, 4)) for s in (0, 1)
    ]  # fmt: skip
    cuts, _ = _cuts(strided, [100, 100], [1], [1], 2)
    assert cuts == [8, 8]


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
    dst_iovecs = cross_memory._segments(runs[:, 0], runs[:, 2]).shape[0]
    src_iovecs = cross_memory._segments(runs[:, 1], runs[:, 2]).shape[0]
    assert box_moves.remote_runs(b, pushed=False) == src_iovecs
    assert box_moves.remote_runs(b, pushed=True) == dst_iovecs
    assert box_moves.read_by_default(b) == (src_iovecs <= dst_iovecs)


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


def _layout_changes(cases: list[Case], page_cost: int, iovec_cost: int, measured: bool = False) -> dict[str, int]:
    box_moves.SMALL_PAGE_COST, box_moves.IOVEC_COST = page_cost, iovec_cost
    if not measured:
        # The model's own prices: nothing this process copies is timed.
        copy_rates.forget()
        copy_rates.MIN_OBSERVED_BYTES = 1 << 62
    g = shardwise.get_default_group()
    w = g.size
    calls = {"read": 0, "write": 0}
    real = cross_memory.read_runs, cross_memory.write_runs

    def counted(kind: str, fn: Any) -> Any:
        def copy(pid: int, runs: torch.Tensor) -> int:
            calls[kind] += 1
            return int(fn(pid, runs))

        return copy

    cross_memory.read_runs, cross_memory.write_runs = counted("read", real[0]), counted("write", real[1])
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
        cross_memory.read_runs, cross_memory.write_runs = real
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



# -- measured prices ----------------------------------------------------------------------------------------


def _scatter_writes_under(readings: dict[int, int]) -> dict[str, Any]:
    """Rank 0 alone has timed its copies (picoseconds per byte by kind); then an 8 MiB scatter and gather."""
    copy_rates.forget()
    if shardwise.get_default_group().rank == 0:
        for kind, ps in readings.items():
            copy_rates.observe(kind, copy_rates.MIN_OBSERVED_BYTES, ps * copy_rates.MIN_OBSERVED_BYTES / 1e12)
    published = copy_rates.published()
    copy_rates.MIN_OBSERVED_BYTES = 1 << 62  # the scatter itself adds no reading
    assert local_copy.usable(shardwise.get_default_group())  # its probe (a tiny read and write) before counting
    writes = {"n": 0}
    real = cross_memory.write_runs

    def counted(pid: int, runs: torch.Tensor) -> int:
        writes["n"] += 1
        return int(real(pid, runs))

    cross_memory.write_runs = counted
    try:
        dense = torch.randn(2048, 1024, generator=torch.Generator().manual_seed(5))
        st_ = shardwise.shard_tensor(dense, _spec(0, 2, 0), src_rank=0)
    finally:
        cross_memory.write_runs = real
    _check(st_, dense, "shard_tensor")
    return {"writes": writes["n"], "published": published, "boxes": local_copy.stats.get("boxes", 0)}


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="cross-memory attach is Linux only")
def test_the_cut_follows_the_prices_one_rank_measured_and_every_rank_agrees() -> None:
    # A scatter of 8 MiB from rank 0 to 2 ranks. Reading a peer's 4 KiB pages timed at 4x a local copy: the
    # root writes part of rank 1's box. Timed at 0.8x: the reader's share costs it less than the root's own
    # local copy, so the root writes nothing. Only rank 0 timed anything; had rank 1 cut by other prices,
    # some rows would be copied twice and others never, and the values would differ (checked on each rank).
    dear = run(_scatter_writes_under, 2, {copy_rates.LOCAL: 100, copy_rates.FAR_SMALL: 400})
    cheap = run(_scatter_writes_under, 2, {copy_rates.LOCAL: 100, copy_rates.FAR_SMALL: 80})
    assert dear[0]["published"] == [100, 400, 0] and dear[1]["published"] == [0, 0, 0]
    assert dear[0]["writes"] > 0 and cheap[0]["writes"] == 0, (dear, cheap)
    assert all(res["boxes"] > 0 for res in dear + cheap)


def _measured_layout_changes(cases: list[Case]) -> dict[str, Any]:
    copy_rates.forget()
    counts = _layout_changes(cases, 2, 8 << 10, measured=True)
    return {**counts, "published": copy_rates.published()}


@pytest.mark.parametrize("world_size", [2, 3])
def test_layout_changes_cut_by_the_prices_they_measure_equal_the_dense_tensor(world_size: int) -> None:
    # Large enough that the copies are timed: later calls cut their boxes by what the earlier ones measured.
    cases = [(1536, 1536, 0, 1, s, s + 1, s) for s in range(3)]
    results = run(_measured_layout_changes, world_size, cases)
    assert all(res["boxes"] > 0 for res in results)
    timed = [sum(res["published"][kind] > 0 for res in results) for kind in range(copy_rates.KINDS)]
    assert timed[copy_rates.LOCAL] and (timed[copy_rates.FAR_SMALL] or timed[copy_rates.FAR_HUGE]), results
