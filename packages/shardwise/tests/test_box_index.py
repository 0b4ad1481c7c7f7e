"""BoxIndex against the definition: every query answers what comparing the query with every box answers.

The box sets are those the planners index (grids, slabs along any dim,
chunks of mixed lengths, empty and duplicate boxes) and random ones; the
queries are random boxes, the boxes themselves and bands along each dim,
so both the index's own dim and the others are the ones a query is
answered along. A last test counts the boxes a query compares with, so a
query long along the indexed dim that scans every box shows as a failure.
"""

from __future__ import annotations

import itertools
from typing import Any, Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise._vocab import box_index
from shardwise._vocab.box_index import BoxIndex, intersect

Box = tuple[list[int], list[int]]
Met = tuple[int, tuple[int, ...], tuple[int, ...]]

# The extent of every drawn layout, per dim; queries reach a little beyond it.
_SIZE = 24
# Cuts per dim, by number of dims: grids of a few hundred boxes at most, enough for windows wider than _FEW.
_MAX_CUTS = {1: 40, 2: 14, 3: 5, 4: 3}


def _reference(boxes: list[Box], offsets: list[int], sizes: list[int]) -> list[Met]:
    """Every box's intersection with the query, every box compared."""
    out = []
    for i, (o, s) in enumerate(boxes):
        met = intersect(o, s, offsets, sizes)
        if met is not None:
            out.append((i, tuple(met[0]), tuple(met[1])))
    return out


@st.composite
def _grid(draw: Any, ndim: int) -> list[Box]:
    """Cells of a grid cut along each dim (no cuts along a dim: slabs along the others)."""
    bounds = []
    for _ in range(ndim):
        cuts = draw(st.lists(st.integers(1, _SIZE - 1), max_size=_MAX_CUTS[ndim], unique=True))
        bounds.append([0, *sorted(cuts), _SIZE])
    return [
        ([bounds[d][k] for d, k in enumerate(cell)], [bounds[d][k + 1] - bounds[d][k] for d, k in enumerate(cell)])
        for cell in itertools.product(*(range(len(b) - 1) for b in bounds))
    ]


@st.composite
def _slabs(draw: Any, ndim: int) -> list[Box]:
    """Slabs of equal thickness along one dim, full along the others (a ChunkShardingSpec's layout)."""
    d = draw(st.integers(0, ndim - 1))
    step = draw(st.integers(1, 4))
    return [
        (
            [start if k == d else 0 for k in range(ndim)],
            [min(step, _SIZE - start) if k == d else _SIZE for k in range(ndim)],
        )
        for start in range(0, _SIZE, step)
    ]


@st.composite
def _random_boxes(draw: Any, ndim: int) -> list[Box]:
    """Boxes anywhere, of any lengths (empty ones too), overlapping or not."""
    box = st.tuples(
        st.lists(st.integers(0, _SIZE), min_size=ndim, max_size=ndim),
        st.lists(st.integers(0, _SIZE), min_size=ndim, max_size=ndim),
    )
    return [(list(o), list(s)) for o, s in draw(st.lists(box, max_size=40))]


@st.composite
def _boxes(draw: Any) -> list[Box]:
    """One or two layouts together (mixed lengths), some boxes emptied or repeated, in any order."""
    ndim = draw(st.integers(1, 4))
    kinds = st.sampled_from([_grid, _slabs, _random_boxes])
    boxes: list[Box] = []
    for kind in draw(st.lists(kinds, min_size=1, max_size=2)):
        boxes += draw(kind(ndim))
    if boxes:
        for i in draw(st.lists(st.integers(0, len(boxes) - 1), max_size=3)):
            d = draw(st.integers(0, ndim - 1))
            boxes[i] = (boxes[i][0], [0 if k == d else s for k, s in enumerate(boxes[i][1])])
        boxes += [boxes[i] for i in draw(st.lists(st.integers(0, len(boxes) - 1), max_size=3))]
    order = draw(st.permutations(range(len(boxes))))
    return [boxes[k] for k in order]


@st.composite
def _queries(draw: Any, boxes: list[Box], ndim: int) -> list[Box]:
    """Random boxes (empty ones too, some past the extent), some of the boxes, and bands along each dim."""
    coords = st.lists(st.integers(-2, _SIZE + 2), min_size=ndim, max_size=ndim)
    lengths = st.lists(st.integers(0, _SIZE + 4), min_size=ndim, max_size=ndim)
    queries = [(list(o), list(s)) for o, s in draw(st.lists(st.tuples(coords, lengths), max_size=6))]
    if boxes:
        queries += [boxes[i] for i in draw(st.lists(st.integers(0, len(boxes) - 1), max_size=3))]
    for d in range(ndim):
        lo = draw(st.integers(0, _SIZE - 1))
        width = draw(st.integers(1, _SIZE - lo))
        queries.append(([lo if k == d else 0 for k in range(ndim)], [width if k == d else _SIZE for k in range(ndim)]))
    return queries


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_queries_meet_what_every_box_compared_meets(data: Any) -> None:
    boxes = data.draw(_boxes())
    ndim = len(boxes[0][0]) if boxes else data.draw(st.integers(1, 4))
    dim: Optional[int] = data.draw(st.one_of(st.none(), st.integers(0, ndim - 1)))
    index = BoxIndex([o for o, _ in boxes], [s for _, s in boxes], dim=dim)
    if dim is not None:
        assert index.dim == dim
    for offsets, sizes in data.draw(_queries(boxes, ndim)):
        got = [(i, tuple(o), tuple(s)) for i, o, s in index.query(offsets, sizes)]
        assert len(got) == len(set(got)), "a box listed twice"
        assert sorted(got) == _reference(boxes, offsets, sizes)


def test_boxes_of_different_numbers_of_dims_are_refused() -> None:
    with pytest.raises(ValueError, match="different numbers of dimensions"):
        BoxIndex([[0, 0], [0]], [[1, 1], [1]])


def test_scalars_meet_every_scalar_query() -> None:
    # 0-dim boxes (a scalar's one chunk): nothing to sort along, every box meets every query.
    assert [i for i, _, _ in BoxIndex([[], []], [[], []]).query([], [])] == [0, 1]


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the boxes queries compare with, from here on."""
    calls = [0]

    def counted(*args: Any) -> Any:
        calls[0] += 1
        return intersect(*args)

    monkeypatch.setattr(box_index, "intersect", counted)
    return calls


def _grid_64x64() -> tuple[list[list[int]], list[list[int]]]:
    """A 512 x 512 tensor saved as 64 x 64 chunks of 8 x 8: square, so neither dim is the better one to sort along."""
    cells = list(itertools.product(range(64), repeat=2))
    return [[8 * i, 8 * j] for i, j in cells], [[8, 8] for _ in cells]


@pytest.mark.parametrize("band_dim", [0, 1])
def test_a_band_across_a_square_grid_compares_only_the_boxes_near_it(
    band_dim: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    offsets, sizes = _grid_64x64()
    index = BoxIndex(offsets, sizes)
    calls = _counting(monkeypatch)
    # One row or column of chunks, whichever dim the index sorted along: 64 met, O(64) compared, not 4096.
    band = ([40, 0], [8, 512]) if band_dim == 0 else ([0, 40], [512, 8])
    met = list(index.query(*band))
    assert len(met) == 64
    assert calls[0] <= 2 * 64
    # Again, with the other dim's sort kept; and a small query, which compares at most the two bands it crosses.
    calls[0] = 0
    assert len(list(index.query(*band))) == 64 and calls[0] <= 2 * 64
    calls[0] = 0
    assert len(list(index.query([100, 100], [8, 8]))) == 4 and calls[0] <= 2 * 64


def test_a_given_dim_is_the_only_one_looked_along(monkeypatch: pytest.MonkeyPatch) -> None:
    offsets, sizes = _grid_64x64()
    index = BoxIndex(offsets, sizes, dim=0)
    calls = _counting(monkeypatch)
    assert len(list(index.query([0, 40], [512, 8]))) == 64
    assert calls[0] == 64 * 64


def test_the_other_dims_are_sorted_once_and_only_for_queries_long_along_the_indexed_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    offsets, sizes = _grid_64x64()
    index = BoxIndex(offsets, sizes)
    assert index.dim == 0
    sorts = [0]
    real = box_index._classes

    def counted(*args: Any) -> Any:
        sorts[0] += 1
        return real(*args)

    monkeypatch.setattr(box_index, "_classes", counted)
    # Row bands: each window holds just the 64 boxes the band meets, so nothing is worth sorting along dim 1.
    for i in range(8):
        assert len(list(index.query([8 * i, 0], [8, 512]))) == 64
    assert sorts[0] == 0
    # Column bands: sorted along dim 1 once, for the first.
    for j in range(8):
        assert len(list(index.query([0, 8 * j], [512, 8]))) == 64
    assert sorts[0] == 1
