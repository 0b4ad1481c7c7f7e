"""Shard validation (overlaps, covering) against a brute-force check, on every layout path.

``shardwise._vocab.validation`` picks an algorithm by layout (one cut dim, two,
three or more, a cell budget that falls back to a sweep, the fast tiling
check of ``validate_layout``); these tests compare each with a cell-by-cell
oracle on small random shard sets, and check the messages keep torch 2.13's
wording. No timing here: ``benchmarks/validation.py`` compares speed.
"""

from __future__ import annotations

import itertools
import math
import re
from typing import Any, Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise._vocab import validation as _validation
from shardwise._vocab import validation_sweep as _sweeps
from shardwise._vocab import validation_tree as _trees
from shardwise._vocab.metadata import ShardMetadata
from shardwise._vocab.validation import check_covering, find_overlap, validate_layout, validate_non_overlapping


def _cells(md: ShardMetadata) -> set[tuple[int, ...]]:
    ranges = [range(o, o + s) for o, s in zip(md.shard_offsets, md.shard_sizes, strict=True)]
    return set(itertools.product(*ranges))


def _brute_overlap(shards: list[ShardMetadata]) -> bool:
    cells = [_cells(s) for s in shards]
    return any(cells[i] & cells[j] for i in range(len(shards)) for j in range(i + 1, len(shards)))


def _brute_valid(shards: list[ShardMetadata], size: list[int]) -> bool:
    """No overlap, every non-empty shard inside the tensor, every element covered."""
    if _brute_overlap(shards):
        return False
    inside = all(
        0 in s.shard_sizes or all(o + n <= lim for o, n, lim in zip(s.shard_offsets, s.shard_sizes, size, strict=True))
        for s in shards
    )
    # Inside and disjoint: covered exactly when the cells add up to the tensor's.
    return inside and sum(len(_cells(s)) for s in shards) == math.prod(size)


def _box(ndim: int, extent: int) -> st.SearchStrategy[ShardMetadata]:
    offsets = st.lists(st.integers(0, extent - 1), min_size=ndim, max_size=ndim)
    sizes = st.lists(st.integers(0, 3), min_size=ndim, max_size=ndim)
    return st.builds(lambda o, s: ShardMetadata(o, s, "rank:0/cpu"), offsets, sizes)


@st.composite
def shard_sets(draw: st.DrawFn) -> tuple[list[ShardMetadata], list[int]]:
    """Random boxes in 1 to 4 dims; some dims shared by every shard so each algorithm gets its turn."""
    ndim = draw(st.integers(1, 4))
    shards = draw(st.lists(_box(ndim, 5), min_size=1, max_size=9))
    # Make some dims uncut (every shard spans the same range): then 0, 1, 2 or 3+ dims are cut.
    for d in range(ndim):
        if draw(st.booleans()):
            o, n = draw(st.integers(0, 2)), draw(st.integers(1, 3))
            for s in shards:
                s.shard_offsets[d], s.shard_sizes[d] = o, n
    size = [
        max([o + n for s in shards for o, n in [(s.shard_offsets[d], s.shard_sizes[d])]] + [1]) for d in range(ndim)
    ]
    return shards, size


@st.composite
def tilings(draw: st.DrawFn) -> tuple[list[ShardMetadata], list[int]]:
    """A valid grid tiling (cut points per dim), shuffled, optionally with one shard perturbed."""
    ndim = draw(st.integers(1, 3))
    size = draw(st.lists(st.integers(1, 6), min_size=ndim, max_size=ndim))
    cuts = [sorted(draw(st.sets(st.integers(1, max(1, n - 1)), max_size=3)) | {0, n}) for n in size]
    shards = [
        ShardMetadata([a for a, _ in cell], [b - a for a, b in cell], "rank:0/cpu")
        for cell in itertools.product(*[list(zip(c, c[1:], strict=False)) for c in cuts])
    ]
    shards = draw(st.permutations(shards))
    if draw(st.booleans()):
        victim = draw(st.integers(0, len(shards) - 1))
        d = draw(st.integers(0, ndim - 1))
        shards[victim].shard_sizes[d] += draw(st.sampled_from([-1, 1]))
        shards[victim].shard_sizes[d] = max(shards[victim].shard_sizes[d], 0)
    return list(shards), size


def _outcome(fn: object) -> Optional[str]:
    try:
        fn()  # type: ignore[operator]
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("few", [0, _validation._FEW], ids=["sweep-and-cells", "small-sweep"])
@settings(max_examples=400, deadline=None)
@given(case=shard_sets())
def test_overlap_matches_brute_force(few: int, case: tuple[list[ShardMetadata], list[int]]) -> None:
    # few=0: every multi-dim layout goes through the two-dim sweep or the cell check, as large ones do.
    shards, _ = case
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_validation, "_FEW", few)
        direct = find_overlap(shards)
        pair = find_overlap(shards, _validation._Columns(shards))  # the column path
    assert (direct is None) == (pair is None)
    if direct is not None:
        i, j = direct
        assert i < j and _cells(shards[i]) & _cells(shards[j])
    assert (pair is not None) == _brute_overlap(shards)
    if pair is not None:
        i, j = pair
        assert i < j and _cells(shards[i]) & _cells(shards[j])


@pytest.mark.parametrize("few", [0, _validation._FEW], ids=["sweep-and-cells", "small-sweep"])
@settings(max_examples=300, deadline=None)
@given(case=st.one_of(shard_sets(), tilings()))
def test_layout_matches_brute_force(few: int, case: tuple[list[ShardMetadata], list[int]]) -> None:
    shards, size = case
    expected = _brute_valid(shards, size)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_validation, "_FEW", few)
        combined = _outcome(lambda: validate_layout(shards, size))
        separate = _outcome(lambda: (validate_non_overlapping(shards), check_covering(shards, size)))
        cols = _validation._Columns(shards)
        by_columns = _outcome(lambda: (validate_non_overlapping(shards, cols), check_covering(shards, size, cols)))
    assert (by_columns is None) == expected, (by_columns, shards, size)
    assert (combined is None) == expected, (combined, shards, size)
    assert combined == separate


@settings(max_examples=200, deadline=None)
@given(shard_sets())
def test_sweep_fallback_matches_cells(case: tuple[list[ShardMetadata], list[int]]) -> None:
    # The cell check's budget exhausted: the segment trees must find the same answer.
    shards, _ = case
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_validation, "_FEW", 0)
        mp.setattr(_validation, "_CELLS_PER_SHARD", -(10**9))
        swept = find_overlap(shards)
    assert (swept is not None) == _brute_overlap(shards)


def test_messages_name_the_shards_and_carry_torch_wording() -> None:
    a, b = ShardMetadata([0, 0], [3, 3], "rank:0/cpu"), ShardMetadata([2, 0], [3, 3], "rank:1/cpu")
    with pytest.raises(ValueError, match=r"Shards.*overlap") as info:
        validate_non_overlapping([a, b])
    assert "shards 0 (offsets=[0, 0] sizes=[3, 3] on rank:0/cpu) and 1" in str(info.value)
    with pytest.raises(ValueError, match=r"Rank of tensor is 3, but shards rank is 2"):
        check_covering([a], [3, 3, 3])
    with pytest.raises(ValueError, match=r"ends at 3 in dim 1.*exceeds tensor dim: 2"):
        check_covering([a], [3, 2])
    with pytest.raises(ValueError, match=r"does not match tensor volume.*do not cover the entire tensor"):
        check_covering([a], [4, 3])
    with pytest.raises(ValueError, match="Found inconsistent ranks for shards"):
        validate_non_overlapping([a, ShardMetadata([0], [1], "rank:0/cpu")])


def test_covering_message_lists_few_shards() -> None:
    # A message naming 10^4 shards would be unreadable (and slow to build).
    shards = [ShardMetadata([i], [1], "rank:0/cpu") for i in range(10_000)]
    with pytest.raises(ValueError, match=r"and 9992 more") as info:
        check_covering(shards, [10_001])
    assert len(str(info.value)) < 2_000


def test_many_column_shards_validate() -> None:
    # The case: column shards each spanning all of dim 0 (quadratic before; a sort now).
    n = 20_000
    shards = [ShardMetadata([0, i], [4, 1], f"rank:{i % 4}/cpu") for i in range(n)]
    validate_layout(shards, [4, n])
    validate_non_overlapping(shards)
    shards.append(ShardMetadata([1, n - 1], [1, 1], "rank:0/cpu"))
    with pytest.raises(ValueError, match=f"shards {n - 1} .* and {n} .* overlap"):
        validate_non_overlapping(shards)


# -- the sweeps of validation_sweep, each forced on small layouts ------------------------------


def _staggered(columns: int, ndim: int) -> tuple[list[ShardMetadata], list[int]]:
    """Each column (one cell in dims 1..ndim-1) split in two along dim 0 at its own row: a tiling."""
    side = round(columns ** (1 / (ndim - 1)))
    length = side ** (ndim - 1) + 1
    shards = []
    for n, cell in enumerate(itertools.product(range(side), repeat=ndim - 1)):
        cut = 1 + n
        shards.append(ShardMetadata([0, *cell], [cut, *[1] * len(cell)], "rank:0/cpu"))
        shards.append(ShardMetadata([cut, *cell], [length - cut, *[1] * len(cell)], "rank:1/cpu"))
    return shards, [length, *[side] * (ndim - 1)]


@pytest.mark.parametrize("ndim", [2, 3, 4])
def test_staggered_splits_with_a_gap_or_an_overlap(ndim: int) -> None:
    # Past the tiling test these reach the blocked 2-D sweep and the projected-cell sweep.
    shards, size = _staggered(400, ndim)
    validate_layout(shards, size)
    validate_non_overlapping(shards[1:])  # a gap, no overlap
    with pytest.raises(ValueError, match="do not cover"):
        validate_layout(shards[1:], size)
    middle = [size[0] // 2, *[s // 2 for s in size[1:]]]
    extra = [*shards, ShardMetadata(middle, [1] * ndim, "rank:2/cpu")]
    with pytest.raises(ValueError, match=re.escape(f"and {len(shards)} (offsets={middle} ")):
        validate_non_overlapping(extra)
    assert find_overlap(extra, _validation._Columns(extra)) is not None


@st.composite
def _columns(draw: st.DrawFn) -> tuple[list[list[int]], list[list[int]]]:
    """Small random non-empty boxes as columns (starts and sizes by dim), 2 to 4 dims."""
    ndim, n = draw(st.integers(2, 4)), draw(st.integers(1, 14))
    starts = [draw(st.lists(st.integers(0, 6), min_size=n, max_size=n)) for _ in range(ndim)]
    sizes = [draw(st.lists(st.integers(1, 4), min_size=n, max_size=n)) for _ in range(ndim)]
    return starts, sizes


def _pair_overlaps(starts: list[list[int]], sizes: list[list[int]], pair: tuple[int, int]) -> bool:
    i, j = pair
    return i != j and all(s[i] < s[j] + z[j] and s[j] < s[i] + z[i] for s, z in zip(starts, sizes, strict=True))


@settings(max_examples=400, deadline=None)
@given(_columns())
def test_each_sweep_matches_every_pair_compared(columns: tuple[list[list[int]], list[list[int]]]) -> None:
    starts, sizes = columns
    n = len(starts[0])
    expected = any(_pair_overlaps(starts, sizes, (i, j)) for i in range(n) for j in range(i + 1, n))
    results: list[Optional[tuple[int, int]]] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_sweeps, "_BLOCK", 1)  # blocks split and empty all the time
        for a in range(len(starts)):
            results.append(_sweeps.pairwise_sweep(starts, sizes, a))
            if len(starts) == 2:
                results.append(_sweeps.two_dims(starts, sizes, a))
        # A budget of n allows grids' one cell a shard only; 0 forces the projected sweep or nothing.
        for budget in (10**6, n, 0):
            try:
                results.append(_sweeps.many_dims(starts, sizes, budget, 0))
            except OverflowError:
                pass
    for pair in results:
        assert (pair is not None) == expected, (pair, starts, sizes)
        if pair is not None:
            assert _pair_overlaps(starts, sizes, pair)


@st.composite
def _many_boxes(draw: st.DrawFn) -> tuple[list[list[int]], list[list[int]]]:
    """Up to 80 non-empty boxes in 1 to 4 dims: random, or a k-d split of a cube with some boxes dropped or grown."""
    ndim = draw(st.integers(1, 4))
    if draw(st.booleans()):
        n = draw(st.integers(1, 80))
        extent = draw(st.sampled_from([4, 12, 40]))
        starts = [draw(st.lists(st.integers(0, extent), min_size=n, max_size=n)) for _ in range(ndim)]
        sizes = [draw(st.lists(st.integers(1, extent), min_size=n, max_size=n)) for _ in range(ndim)]
        return starts, sizes
    boxes = [([0] * ndim, [12] * ndim)]
    for _ in range(draw(st.integers(0, 60))):
        k = draw(st.integers(0, len(boxes) - 1))
        d = draw(st.integers(0, ndim - 1))
        lo, size = boxes[k]
        if size[d] < 2:
            continue
        cut = draw(st.integers(1, size[d] - 1))
        upper = ([x + cut * (e == d) for e, x in enumerate(lo)], [z - cut * (e == d) for e, z in enumerate(size)])
        boxes[k] = (lo, [cut if e == d else z for e, z in enumerate(size)])
        boxes.append(upper)
    boxes = [box for box in boxes if not draw(st.booleans()) or len(boxes) < 3] or boxes  # gaps: no tiling
    if draw(st.booleans()):
        k, d = draw(st.integers(0, len(boxes) - 1)), draw(st.integers(0, ndim - 1))
        boxes[k][1][d] += draw(st.integers(1, 3))  # may now reach a neighbour
    boxes = draw(st.permutations(boxes))
    return [[lo[d] for lo, _ in boxes] for d in range(ndim)], [[z[d] for _, z in boxes] for d in range(ndim)]


@pytest.mark.parametrize("few", [(1, 0), (_trees._FEW, _trees._FEW_PAIRS)], ids=["trees-only", "default-cutoffs"])
@settings(max_examples=300, deadline=None)
@given(columns=_many_boxes())
def test_segment_trees_match_every_pair_compared(
    few: tuple[int, int], columns: tuple[list[list[int]], list[list[int]]]
) -> None:
    # Cut-offs of 1 and 0 leave every set, however small, to the trees and their one-dim checks.
    starts, sizes = columns
    n = len(starts[0])
    expected = any(_pair_overlaps(starts, sizes, (i, j)) for i in range(n) for j in range(i + 1, n))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_trees, "_FEW", few[0])
        mp.setattr(_trees, "_FEW_PAIRS", few[1])
        mp.setattr(_sweeps, "_BLOCK", 1)  # the two-dim sweep it calls, with blocks splitting all the time
        pair = _trees.any_overlap(starts, sizes)
    assert (pair is not None) == expected, (pair, starts, sizes)
    if pair is not None:
        assert _pair_overlaps(starts, sizes, pair)


def _stacked_slabs(m: int) -> list[ShardMetadata]:
    """Three stacked blocks of m slabs each, thin along dims 0, 1 and 2 in turn: a tiling of (m, m, 3m).

    Every dim crosses m slabs of one block at once, and each slab spans m
    elementary intervals of some other dim, so neither the cells nor a sweep
    along any dim stays near-linear once a slab is missing.
    """
    shards = []
    for i in range(m):
        shards.append(ShardMetadata([i, 0, 0], [1, m, m], "rank:0/cpu"))
        shards.append(ShardMetadata([0, i, m], [m, 1, m], "rank:1/cpu"))
        shards.append(ShardMetadata([0, 0, 2 * m + i], [m, m, 1], "rank:2/cpu"))
    return shards


def test_layouts_past_every_cell_budget_go_to_the_segment_trees() -> None:
    shards = _stacked_slabs(60)
    validate_layout(shards, [60, 60, 180])  # a tiling: the corner test accepts it
    gap = shards[:90] + shards[91:]
    calls: list[int] = []
    real = _trees.any_overlap

    def counted(starts: Any, sizes: Any) -> Optional[tuple[int, int]]:
        calls.append(len(starts[0]))
        return real(starts, sizes)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_validation, "any_overlap", counted)
        validate_non_overlapping(gap)
        assert calls == [len(gap)]
        grown = list(gap)
        grown[2] = ShardMetadata(gap[2].shard_offsets, [60, 60, 2], "rank:2/cpu")  # into the next dim-2 slab, 5
        with pytest.raises(ValueError, match=r"shards 2 .* and 5 .* overlap"):
            validate_non_overlapping(grown)
        assert find_overlap(grown, _validation._Columns(grown)) is not None
    assert len(calls) == 3


def test_projected_sweep_runs_where_all_cells_would_not_fit() -> None:
    # Staggered in 3-D: about n/2 cells a shard in all dims, one in the projection along dim 0.
    shards, _ = _staggered(100, 3)
    starts = [[s.shard_offsets[d] for s in shards] for d in range(3)]
    sizes = [[s.shard_sizes[d] for s in shards] for d in range(3)]
    assert _sweeps.many_dims(starts, sizes, 2 * len(shards), 0) is None
    sizes[0][0] += 1  # now it reaches the next shard of its column
    assert _sweeps.many_dims(starts, sizes, 2 * len(shards), 0) == (0, 1)


def test_torchs_shard_metadata_gets_value_errors_and_enumerable_specs() -> None:
    # Code written for torch passes torch's own ShardMetadata (no describe method) to the torch-named helpers.
    from torch.distributed._shard.metadata import ShardMetadata as TorchShardMetadata

    from shardwise.sharding_spec import EnumerableShardingSpec
    from shardwise.sharding_spec._internals import check_tensor, validate_non_overlapping_shards_metadata

    # Any: the helpers are typed for shardwise's class; torch's is accepted as torch's helpers accept it.
    a: Any = TorchShardMetadata([0, 0], [2, 2], "rank:0/cpu")
    b: Any = TorchShardMetadata([2, 0], [2, 2], "rank:1/cpu")
    other: Any = TorchShardMetadata([1, 1], [2, 2], "rank:1/cpu")
    validate_non_overlapping_shards_metadata([a, b])
    check_tensor([a, b], [4, 2])
    with pytest.raises(ValueError, match=r"shards 0 \(offsets=\[0, 0\] sizes=\[2, 2\] on rank:0/cpu\).*overlap"):
        validate_non_overlapping_shards_metadata([a, other])
    with pytest.raises(ValueError, match="do not cover"):
        check_tensor([a, b], [5, 2])
    with pytest.raises(ValueError, match="outside the tensor"):
        check_tensor([a, b], [3, 2])
    spec = EnumerableShardingSpec([a, b])
    assert all(isinstance(s, ShardMetadata) for s in spec.shards)
    assert [s.describe() for s in spec.shards] == ["offsets=[0, 0] sizes=[2, 2] on rank:0/cpu", _validation.describe(b)]
    with pytest.raises(ValueError, match="overlap"):
        EnumerableShardingSpec([a, other])
