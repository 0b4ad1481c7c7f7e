"""Metadata that scales: complexity bounds (generous wall-clock limits) and the fast paths against references.

The references are written here the straightforward way (every pair of
boxes), so a fast path that skips a pair it should not shows as a
difference.
"""

from __future__ import annotations

import gc
import itertools
import math
import time
from typing import Any, Callable, Optional

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from shardwise import ShardMetadata
from shardwise._layout.plan import plan
from shardwise._modules.load_plan import IndexCache, read_items
from shardwise._vocab.box_index import intersect
from shardwise._vocab.metadata import ShardedTensorMetadata
from shardwise._vocab.metadata import TensorProperties as SwTensorProperties
from shardwise._vocab.validation import validate_layout, validate_non_overlapping
from shardwise.sharding_spec import ChunkShardingSpec

Box = tuple[list[int], list[int]]


def _seconds(fn: Callable[[], Any]) -> float:
    gc.collect()
    gc.disable()
    try:
        start = time.process_time()
        fn()
        return time.process_time() - start
    finally:
        gc.enable()


# -- complexity bounds ---------------------------------------------------------


def _columns(n: int) -> tuple[list[Box], list[int]]:
    return [([0, i], [4, 1]) for i in range(n)], [4, n]


def _grid(n: int) -> tuple[list[Box], list[int]]:
    k = round(math.sqrt(n))
    return [([2 * i, 3 * j], [2, 3]) for i in range(k) for j in range(k)], [2 * k, 3 * k]


def _grid3d(n: int) -> tuple[list[Box], list[int]]:
    k = round(n ** (1 / 3))
    return [([i, j, m], [1, 1, 1]) for i in range(k) for j in range(k) for m in range(k)], [k, k, k]


class _Shard:
    """What validation reads of a shard, built faster than a ShardMetadata (10^5 of them per test)."""

    __slots__ = ("shard_offsets", "shard_sizes")

    def __init__(self, offsets: list[int], sizes: list[int]) -> None:
        self.shard_offsets, self.shard_sizes = offsets, sizes

    def describe(self) -> str:
        return f"offsets={self.shard_offsets} sizes={self.shard_sizes}"


@pytest.mark.parametrize("make", [_columns, _grid, _grid3d], ids=["columns", "grid", "grid3d"])
def test_validation_of_100k_shards_takes_under_a_second(make: Callable[[int], tuple[list[Box], list[int]]]) -> None:
    boxes, size = make(100_000)
    boxes.reverse()  # not in row-major order
    shards = [_Shard(o, s) for o, s in boxes]
    assert _seconds(lambda: validate_layout(shards, size)) < 1.0


def _staggered(n: int, ndim: int) -> list[Box]:
    """Each column (one cell in dims 1..) split in two along dim 0 at its own row, less one shard: a gap."""
    side = round((n / 2) ** (1 / (ndim - 1)))
    length = side ** (ndim - 1) + 1
    boxes: list[Box] = []
    for k, cell in enumerate(itertools.product(range(side), repeat=ndim - 1)):
        ones = [1] * (ndim - 1)
        boxes += [([0, *cell], [1 + k, *ones]), ([1 + k, *cell], [length - 1 - k, *ones])]
    return boxes[1:]


def _grid_nd(n: int, ndim: int) -> list[Box]:
    k = round(n ** (1 / ndim))
    return [(list(c), [1] * ndim) for c in itertools.product(range(k), repeat=ndim)]


@pytest.mark.parametrize(
    "boxes",
    [
        pytest.param(lambda: _staggered(100_000, 2), id="staggered2d-gap"),
        pytest.param(lambda: _staggered(100_000, 3), id="staggered3d-gap"),
        pytest.param(lambda: [*_staggered(100_000, 3), ([100, 3, 3], [1, 1, 1])], id="staggered3d-overlap"),
        pytest.param(lambda: _grid_nd(100_000, 5), id="grid5d"),
        pytest.param(lambda: _grid_nd(117_649, 6), id="grid6d"),
    ],
)
def test_overlap_check_of_100k_shards_not_tiling_or_in_many_dims(boxes: Callable[[], list[Box]]) -> None:
    # Quadratic before: the 3-D gap took 87 s at 28,800 shards. Measured 0.3 to 0.8 s on a busy machine;
    # the bound leaves room for slower CI while no O(n^2) or O(n^1.5) method could meet it.
    made = boxes()
    made.reverse()
    shards = [_Shard(o, s) for o, s in made]
    errors: list[str] = []

    def check() -> None:
        try:
            validate_non_overlapping(shards)
        except ValueError as exc:
            errors.append(str(exc))

    assert _seconds(check) < 2.0
    assert bool(errors) == (len(made[0][0]) == 3 and made[0][0] == [100, 3, 3])


def test_chunk_to_chunk_plan_for_4096_ranks_takes_under_a_tenth_of_a_second_per_rank() -> None:
    world = 4096
    places = [f"rank:{i}/cpu" for i in range(world)]
    src = ChunkShardingSpec(0, places).build_metadata([2 * world, 2 * world])
    dst = ChunkShardingSpec(1, places).build_metadata([2 * world, 2 * world])
    got: list[Any] = []
    # Generous: measured about 0.07 s; the bound is what a whole-world scan (16 million pairs) cannot meet.
    assert _seconds(lambda: got.append(plan(src, dst, 7, world))) < 0.3
    assert sum(map(len, got[0].send)) == world - 1 and sum(map(len, got[0].recv)) == world - 1


def _saved(tensors: int, grid: int, rows: int, cols: int) -> dict[str, Any]:
    props = TensorProperties(dtype=torch.float32)
    return {
        f"t{k}": TensorStorageMetadata(
            props,
            torch.Size((rows, cols)),
            [
                ChunkStorageMetadata(
                    torch.Size((i * rows // grid, j * cols // grid)),
                    torch.Size(((i + 1) * rows // grid - i * rows // grid, (j + 1) * cols // grid - j * cols // grid)),
                )
                for i in range(grid)
                for j in range(grid)
            ],
        )
        for k in range(tensors)
    }


def _index_key(index: Any) -> tuple[Any, ...]:
    return index.fqn, tuple(index.offset), index.index


def _key(item: Any) -> tuple[Any, ...]:
    return (
        item.type.value,
        _index_key(item.dest_index),
        tuple(item.dest_offsets),
        _index_key(item.storage_index),
        tuple(item.storage_offsets),
        tuple(item.lengths),
    )


def test_checkpoint_load_plan_reads_what_torch_reads_in_a_fraction_of_its_time() -> None:
    saved = _saved(40, 32, 256, 256)
    local = [ChunkStorageMetadata(torch.Size((40, 0)), torch.Size((8, 256)))]
    cache = IndexCache()
    ours: list[Any] = []
    elapsed = _seconds(lambda: ours.extend(it for fqn, md in saved.items() for it in read_items(fqn, md, local, cache)))
    theirs = [it for fqn, md in saved.items() for it in create_read_items_for_chunk_list(fqn, md, local)]
    assert sorted(map(_key, ours)) == sorted(map(_key, theirs))
    # 40 tensors of 1024 chunks each: the whole 1000 x 4096 case is about 100 times this; its target is 2 s.
    assert elapsed < 0.1


# -- fast paths against references ---------------------------------------------


@st.composite
def _layouts(draw: Any) -> tuple[list[Box], list[int]]:
    """A tiling by cuts per dim (a grid, with some cells merged along dim 0), then maybe one box disturbed."""
    ndim = draw(st.integers(1, 3))
    cuts = [sorted(set(draw(st.lists(st.integers(1, 11), max_size=5)))) for _ in range(ndim)]
    bounds = [[0, *c, 12] for c in cuts]
    boxes: list[Box] = []
    for cell in itertools.product(*(range(len(b) - 1) for b in bounds)):
        boxes.append(
            ([bounds[d][k] for d, k in enumerate(cell)], [bounds[d][k + 1] - bounds[d][k] for d, k in enumerate(cell)])
        )
    if len(boxes) > 1 and draw(st.booleans()):
        i = draw(st.integers(0, len(boxes) - 1))
        kind = draw(st.sampled_from(["grow", "shrink", "drop", "copy", "empty", "shift"]))
        offsets, sizes = boxes[i]
        d = draw(st.integers(0, ndim - 1))
        if kind == "grow":
            sizes = [s + (k == d) for k, s in enumerate(sizes)]
        elif kind == "shrink" and sizes[d] > 1:
            sizes = [s - (k == d) for k, s in enumerate(sizes)]
        elif kind == "shift" and offsets[d] > 0:
            offsets = [o - (k == d) for k, o in enumerate(offsets)]
        elif kind == "empty":
            sizes = [0 if k == d else s for k, s in enumerate(sizes)]
        if kind == "drop":
            del boxes[i]
        elif kind == "copy":
            boxes.append(boxes[i])
        else:
            boxes[i] = (offsets, sizes)
    order = draw(st.permutations(range(len(boxes))))
    return [boxes[k] for k in order], [12] * ndim


def _reference_overlap(boxes: list[Box]) -> bool:
    return any(intersect(a[0], a[1], b[0], b[1]) is not None for a, b in itertools.combinations(boxes, 2))


@settings(max_examples=150, deadline=None)
@given(_layouts())
def test_validation_verdicts_match_every_pair_compared(layout: tuple[list[Box], list[int]]) -> None:
    boxes, size = layout
    shards = [ShardMetadata(o, s, "rank:0/cpu") for o, s in boxes]
    overlap = _reference_overlap(boxes)
    inside = all(o + s <= n for off, sz in boxes if 0 not in sz for o, s, n in zip(off, sz, size, strict=True))
    covered = sum(math.prod(sz) for _, sz in boxes) == math.prod(size)
    error: Optional[str] = None
    try:
        validate_non_overlapping(shards)
    except ValueError as exc:
        error = str(exc)
    assert (error is not None) == overlap
    try:
        validate_layout(shards, size)
        valid = True
    except ValueError as exc:
        valid = False
        assert ("overlap" in str(exc)) == overlap
    assert valid == (not overlap and inside and covered)


def _reference_plan(src: ShardedTensorMetadata, dst: ShardedTensorMetadata, rank: int) -> Any:
    """(local, send, recv) boxes in (target, source) order and needs_wire, comparing every pair."""
    local, send, recv, wire = [], [], [], False
    for j, b in enumerate(dst.shards_metadata):
        for i, a in enumerate(src.shards_metadata):
            met = intersect(a.shard_offsets, a.shard_sizes, b.shard_offsets, b.shard_sizes)
            if met is None:
                continue
            frm, to = a.placement.rank(), b.placement.rank()  # type: ignore[union-attr]
            wire = wire or frm != to
            entry = (i, j, tuple(met[0]), tuple(met[1]))
            if frm == to == rank:
                local.append(entry)
            elif to == rank and frm != rank:
                recv.append((frm, *entry))
            elif frm == rank and to != rank:
                send.append((to, *entry))
    return local, sorted(send, key=lambda e: e[0]), sorted(recv, key=lambda e: e[0]), wire


@settings(max_examples=60, deadline=None)
@given(_layouts(), _layouts(), st.integers(2, 4), st.randoms(use_true_random=False))
def test_plans_match_every_pair_compared(a: Any, b: Any, world: int, rnd: Any) -> None:
    (src_boxes, size), (dst_boxes, dst_size) = a, b
    if size != dst_size:
        dst_boxes, size = src_boxes, size

    def md(boxes: list[Box]) -> ShardedTensorMetadata:
        return ShardedTensorMetadata(
            [ShardMetadata(o, s, f"rank:{rnd.randrange(world)}/cpu") for o, s in boxes],
            list(size),
            SwTensorProperties(),
        )

    try:
        src, dst = md(src_boxes), md(dst_boxes)
    except ValueError:
        return  # a disturbed layout: plans are made only between valid ones
    for rank in range(world):
        got = plan(src, dst, rank, world)
        local, send, recv, wire = _reference_plan(src, dst, rank)

        def boxes(pieces: Any) -> list[tuple[Any, ...]]:
            return [(p.src, p.dst, p.offsets, p.sizes) for p in pieces]

        assert boxes(got.local) == local
        assert [(r, *e) for r, per in enumerate(got.send) for e in boxes(per)] == send
        assert [(r, *e) for r, per in enumerate(got.recv) for e in boxes(per)] == recv
        assert got.needs_wire == wire


@settings(max_examples=60, deadline=None)
@given(_layouts(), _layouts())
def test_checkpoint_reads_match_torchs(saved_layout: Any, local_layout: Any) -> None:
    (saved_boxes, size), (local_boxes, local_size) = saved_layout, local_layout
    if size != local_size:
        return
    chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in saved_boxes if 0 not in s]
    md = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(size), chunks)
    local = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in local_boxes if 0 not in s]
    ours = read_items("w", md, local)
    assert sorted(map(_key, ours)) == sorted(map(_key, create_read_items_for_chunk_list("w", md, local)))
