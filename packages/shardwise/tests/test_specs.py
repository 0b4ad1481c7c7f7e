"""Sharding specs, metadata and box arithmetic (no processes)."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed._shard.sharding_spec import ChunkShardingSpec as TorchChunkSpec
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec as TorchEnumSpec
from torch.distributed._shard.sharding_spec import ShardMetadata as TorchShardMetadata

from shardwise._vocab.metadata import check_covering, intersect, validate_non_overlapping
from shardwise.sharded_tensor import ShardMetadata, ShardedTensorMetadata, TensorProperties
from shardwise.sharding_spec import (
    ChunkShardingSpec,
    DevicePlacementSpec,
    EnumerableShardingSpec,
    Placement,
    ShardingSpec,
    chunk_sizes,
    infer_sharding_spec,
    spec_from_dict,
)

# -- placements and metadata ---------------------------------------------------


def test_placement_parses_rank_and_device() -> None:
    p = Placement("rank:3/cuda:1")
    assert p.rank() == 3 and p.device() == torch.device("cuda:1")
    assert str(p) == "rank:3/cuda:1" and p == "rank:3/cuda:1" and p == Placement(p)
    assert Placement(torch.distributed._remote_device("rank:2/cpu")) == "rank:2/cpu"
    assert len({Placement("rank:0/cpu"), Placement(" rank:0/cpu ")}) == 1


@pytest.mark.parametrize(
    "bad, message",
    [
        # "cpu", "rank:0" and "worker0/cpu" are valid forms, as in torch (test_placement_forms.py).
        ("random:0", "expected 'rank:R' before the '/'.*Could not parse remote_device"),
        ("a/b/c", "at most one '/'"),
        ("rank:x/cpu", "rank 'x' is not an integer"),
        ("rank:-1/cpu", "rank must be >= 0"),
        ("rank:0/gpu7", "'gpu7' is not a torch device"),
        (3, "must be a 'rank:R/DEVICE' string"),
    ],
)
def test_bad_placements_say_the_expected_form(bad: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Placement(bad)  # type: ignore[arg-type]


def test_shard_metadata_validates_and_round_trips_through_json() -> None:
    md = ShardMetadata([0, 4], [2, 3], "rank:1/cpu")
    assert md.rank == 1 and md.numel() == 6 and md.ends() == [2, 7]
    data = json.loads(json.dumps(md.to_dict()))
    assert ShardMetadata.from_dict(data) == md and hash(ShardMetadata.from_dict(data)) == hash(md)
    with pytest.raises(ValueError, match="same number of dimensions"):
        ShardMetadata([0], [1, 2], "rank:0/cpu")
    with pytest.raises(ValueError, match="shard_offsets must be >= 0"):
        ShardMetadata([-1, 0], [1, 2], "rank:0/cpu")
    with pytest.raises(ValueError, match="shard_sizes must be >= 0"):
        ShardMetadata([0, 0], [1, -2], "rank:0/cpu")
    with pytest.raises(TypeError, match="integers"):
        ShardMetadata([0.5], [1], "rank:0/cpu")


def test_tensor_metadata_round_trips_through_json() -> None:
    props = TensorProperties(dtype=torch.bfloat16, requires_grad=True, pin_memory=False)
    meta = ShardedTensorMetadata([ShardMetadata([0], [3], "rank:0/cpu"), ShardMetadata([3], [1], "rank:1/cpu")], torch.Size([4]), props)
    back = ShardedTensorMetadata.from_dict(json.loads(json.dumps(meta.to_dict())))
    assert back == meta and back.size == torch.Size([4]) and back.tensor_properties.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        TensorProperties.from_dict({**props.to_dict(), "dtype": "float99"})


# -- chunk specs -----------------------------------------------------------------


def test_chunk_sizes_follow_torch_chunk() -> None:
    assert chunk_sizes(10, 4) == [3, 3, 3, 1]
    assert chunk_sizes(3, 4) == [1, 1, 1, 0]
    assert chunk_sizes(5, 4) == [2, 2, 1, 0]
    assert chunk_sizes(0, 3) == [0, 0, 0]
    for n, k in itertools.product(range(12), range(1, 6)):
        pieces = [c.shape[0] for c in torch.arange(n).chunk(k)] if n else []
        assert chunk_sizes(n, k) == pieces + [0] * (k - len(pieces))


def test_chunk_spec_builds_metadata_like_torch_chunk() -> None:
    spec = ChunkShardingSpec(1, ["rank:2/cpu", "rank:0/cpu", "rank:1/cpu"])
    meta = spec.build_metadata([4, 10], TensorProperties())
    assert [(m.shard_offsets, m.shard_sizes, str(m.placement)) for m in meta.shards_metadata] == [
        ([0, 0], [4, 4], "rank:2/cpu"),
        ([0, 4], [4, 4], "rank:0/cpu"),
        ([0, 8], [4, 2], "rank:1/cpu"),
    ]
    assert ChunkShardingSpec(-1, spec.placements).build_metadata([4, 10]).shards_metadata == meta.shards_metadata
    with pytest.raises(ValueError, match="cannot shard dim 2 of a tensor of size \\[4, 10\\]"):
        ChunkShardingSpec(2, spec.placements).build_metadata([4, 10], TensorProperties())


def test_chunk_spec_rejects_bad_arguments() -> None:
    with pytest.raises(NotImplementedError, match="named dimensions"):
        ChunkShardingSpec("rows", ["rank:0/cpu"])
    with pytest.raises(TypeError, match="dim must be an int"):
        ChunkShardingSpec(1.0, ["rank:0/cpu"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one placement"):
        ChunkShardingSpec(0, [])
    with pytest.raises(TypeError, match="list of 'rank:R/DEVICE' strings"):
        ChunkShardingSpec(0, "rank:0/cpu")
    with pytest.raises(ValueError, match="invalid placement 'rank:0/cuda:x'"):
        ChunkShardingSpec(0, ["rank:0/cpu", "rank:0/cuda:x"])


def test_specs_compare_and_serialise_by_value() -> None:
    a = ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu"])
    b = ChunkShardingSpec(0, [Placement("rank:0/cpu"), torch.distributed._remote_device("rank:1/cpu")])
    assert a == b
    assert a != ChunkShardingSpec(0, ["rank:1/cpu", "rank:0/cpu"]) and a != ChunkShardingSpec(1, a.placements)
    e = EnumerableShardingSpec([ShardMetadata([0, 0], [2, 2], "rank:0/cpu"), ShardMetadata([2, 0], [2, 2], "rank:1/cpu")])
    assert e == EnumerableShardingSpec([ShardMetadata([0, 0], [2, 2], "rank:0/cpu"), ShardMetadata([2, 0], [2, 2], "rank:1/cpu")])
    assert e == spec_from_dict(e.to_dict()) and e != a
    for spec in (a, e, DevicePlacementSpec("rank:1/cpu")):  # mutable, so unhashable (as torch's dataclasses)
        with pytest.raises(TypeError, match="unhashable"):
            hash(spec)
    for spec in (a, e):
        assert spec_from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    with pytest.raises(ValueError, match="cannot rebuild a sharding spec of type 'mystery'"):
        spec_from_dict({"type": "mystery"})
    assert DevicePlacementSpec("rank:1/cpu") == DevicePlacementSpec(Placement("rank:1/cpu"))


# -- enumerable specs and validation ---------------------------------------------


def test_enumerable_spec_names_overlapping_shards() -> None:
    shards = [
        ShardMetadata([0, 0], [2, 2], "rank:0/cpu"),
        ShardMetadata([0, 2], [2, 2], "rank:1/cpu"),
        ShardMetadata([1, 1], [2, 2], "rank:2/cpu"),
    ]
    with pytest.raises(ValueError, match=r"shards 0 \(offsets=\[0, 0\] sizes=\[2, 2\] on rank:0/cpu\) and 2 .* overlap"):
        EnumerableShardingSpec(shards)


def test_enumerable_spec_checks_covering_when_metadata_is_built() -> None:
    spec = EnumerableShardingSpec([ShardMetadata([0, 0], [2, 2], "rank:0/cpu"), ShardMetadata([2, 0], [1, 2], "rank:1/cpu")])
    assert spec.build_metadata([3, 2], TensorProperties()).size == torch.Size([3, 2])
    with pytest.raises(ValueError, match=r"do not cover the tensor of size \[4, 2\]: they hold 6 of its 8"):
        spec.build_metadata([4, 2], TensorProperties())
    with pytest.raises(ValueError, match=r"shard 0 .* ends at 2 in dim 1, outside the tensor of size \[3, 1\]"):
        spec.build_metadata([3, 1], TensorProperties())
    with pytest.raises(ValueError, match="has 2 dimensions, the tensor of size \\[6\\] has 1"):
        spec.build_metadata([6], TensorProperties())


def test_enumerable_spec_rejects_mixed_ranks_and_empty() -> None:
    with pytest.raises(ValueError, match="at least one shard"):
        EnumerableShardingSpec([])
    with pytest.raises(ValueError, match="same number of dimensions"):
        EnumerableShardingSpec([ShardMetadata([0, 0], [1, 1], "rank:0/cpu"), ShardMetadata([1], [1], "rank:1/cpu")])
    with pytest.raises(TypeError, match="must be a ShardMetadata"):
        EnumerableShardingSpec([{"offsets": [0]}])  # type: ignore[list-item]


def test_empty_shards_never_overlap() -> None:
    validate_non_overlapping([ShardMetadata([0], [4], "rank:0/cpu"), ShardMetadata([2], [0], "rank:1/cpu")])


# -- inference -------------------------------------------------------------------


def _metas(spec: ShardingSpec, size: list[int]) -> list[ShardMetadata]:
    return spec.build_metadata(size, TensorProperties()).shards_metadata


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_inference_finds_chunk_specs_on_every_dim(dim: int) -> None:
    spec = ChunkShardingSpec(dim, ["rank:2/cpu", "rank:0/cpu", "rank:1/cpu"])
    metas = _metas(spec, [7, 5, 4])
    assert infer_sharding_spec(metas) == spec
    # Order of the metadata list does not matter; placement order follows the offsets.
    assert infer_sharding_spec(list(reversed(metas))) == spec


def test_inference_of_special_cases() -> None:
    whole = [ShardMetadata([0, 0], [3, 4], "rank:0/cpu")]
    assert infer_sharding_spec(whole) == ChunkShardingSpec(0, ["rank:0/cpu"])
    trailing_empty = _metas(ChunkShardingSpec(0, [f"rank:{r}/cpu" for r in range(4)]), [3, 2])
    assert infer_sharding_spec(trailing_empty) == ChunkShardingSpec(0, [f"rank:{r}/cpu" for r in range(4)])
    grid = [ShardMetadata([i, j], [2, 2], f"rank:{2 * i // 2 + j // 2}/cpu") for i in (0, 2) for j in (0, 2)]
    assert isinstance(infer_sharding_spec(grid), EnumerableShardingSpec)
    uneven = [ShardMetadata([0], [1], "rank:0/cpu"), ShardMetadata([1], [3], "rank:1/cpu")]
    assert infer_sharding_spec(uneven) == EnumerableShardingSpec(uneven)


def test_inference_agrees_with_torch_where_torch_is_right() -> None:
    from torch.distributed._shard.sharding_spec import _infer_sharding_spec_from_shards_metadata as torch_infer

    for dim, n in itertools.product([1, 2], [2, 3]):
        placements = [f"rank:{r}/cpu" for r in range(n)]
        ours = _metas(ChunkShardingSpec(dim, placements), [6, 7, 8])
        theirs = TorchChunkSpec(dim, placements).build_metadata(torch.Size([6, 7, 8]), None).shards_metadata  # type: ignore[arg-type]
        inferred = torch_infer(theirs)
        assert isinstance(inferred, TorchChunkSpec) and inferred.dim == dim
        assert infer_sharding_spec(ours) == ChunkShardingSpec(dim, [str(p) for p in inferred.placements])
    # torch infers Enumerable for a single whole shard; shardwise knows it is a chunk spec.
    assert isinstance(torch_infer([TorchShardMetadata([0, 0], [3, 4], "rank:0/cpu")]), TorchEnumSpec)


def test_chunk_metadata_matches_torch() -> None:
    for size, dim, n in itertools.product([[10, 3], [3, 5], [1, 9], [0, 4]], [0, 1], [1, 2, 3, 4]):
        placements = [f"rank:{(r + 1) % n}/cpu" for r in range(n)]
        ours = _metas(ChunkShardingSpec(dim, placements), size)
        theirs = TorchChunkSpec(dim, placements).build_metadata(torch.Size(size), None).shards_metadata  # type: ignore[arg-type]
        # Empty trailing shards start where the tensor ends here; torch puts them at split * index,
        # which can lie past the end (an offset of 6 in a dim of size 5).
        assert [(m.shard_offsets if m.numel() else None, m.shard_sizes, str(m.placement)) for m in ours] == [
            (m.shard_offsets if math.prod(m.shard_sizes) else None, m.shard_sizes, str(m.placement)) for m in theirs
        ]


# -- property tests ----------------------------------------------------------------


@st.composite
def grids(draw: st.DrawFn) -> tuple[list[int], list[ShardMetadata]]:
    """A tensor size and a random grid of shards covering it (cut points per dim)."""
    ndim = draw(st.integers(1, 3))
    size = [draw(st.integers(0, 7)) for _ in range(ndim)]
    cuts = []
    for n in size:
        points = sorted(set(draw(st.lists(st.integers(0, n), max_size=3))) | {0, n})
        cuts.append(list(zip(points[:-1], points[1:], strict=False)) or [(0, 0)])
    shards = []
    for box in itertools.product(*cuts):
        rank = draw(st.integers(0, 3))
        shards.append(ShardMetadata([lo for lo, _ in box], [hi - lo for lo, hi in box], f"rank:{rank}/cpu"))
    return size, draw(st.permutations(shards))


def _cells(md: ShardMetadata) -> set[tuple[int, ...]]:
    return set(itertools.product(*[range(o, o + s) for o, s in zip(md.shard_offsets, md.shard_sizes, strict=False)]))


@settings(max_examples=150, deadline=None)
@given(grids())
def test_grids_are_valid_and_round_trip(case: tuple[list[int], list[ShardMetadata]]) -> None:
    size, shards = case
    validate_non_overlapping(shards)
    check_covering(shards, size)
    spec = infer_sharding_spec(shards)
    rebuilt = spec.build_metadata(size, TensorProperties()).shards_metadata
    cover = {c: str(m.placement) for m in rebuilt for c in _cells(m)}
    assert cover == {c: str(m.placement) for m in shards for c in _cells(m)}
    assert len(cover) == math.prod(size)


@settings(max_examples=150, deadline=None)
@given(grids(), st.data())
def test_removing_or_growing_a_shard_is_caught(case: tuple[list[int], list[ShardMetadata]], data: st.DataObject) -> None:
    size, shards = case
    nonempty = [i for i, s in enumerate(shards) if s.numel() > 0]
    if not nonempty:
        return
    victim = data.draw(st.sampled_from(nonempty))
    with pytest.raises(ValueError, match="do not cover"):
        check_covering(shards[:victim] + shards[victim + 1 :], size)
    grown = shards[victim]
    dim = data.draw(st.integers(0, len(size) - 1))
    sizes = list(grown.shard_sizes)
    sizes[dim] += 1
    bigger = ShardMetadata(grown.shard_offsets, sizes, grown.placement)
    others = shards[:victim] + [bigger] + shards[victim + 1 :]
    with pytest.raises(ValueError, match="overlap|outside the tensor"):
        validate_non_overlapping(others)
        check_covering(others, size)


boxes = st.integers(1, 3).flatmap(
    lambda n: st.tuples(
        st.lists(st.integers(0, 6), min_size=n, max_size=n),
        st.lists(st.integers(0, 4), min_size=n, max_size=n),
        st.lists(st.integers(0, 6), min_size=n, max_size=n),
        st.lists(st.integers(0, 4), min_size=n, max_size=n),
    )
)


@settings(max_examples=300, deadline=None)
@given(boxes)
def test_intersect_matches_brute_force(case: tuple[list[int], list[int], list[int], list[int]]) -> None:
    ao, asz, bo, bsz = case
    a = _cells(ShardMetadata(ao, asz))
    b = _cells(ShardMetadata(bo, bsz))
    got = intersect(ao, asz, bo, bsz)
    if not a & b:
        assert got is None
    else:
        assert got is not None and _cells(ShardMetadata(*got)) == a & b


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=3), st.integers(0, 2), st.permutations(range(4)), st.integers(1, 4))
def test_chunk_specs_are_inferred_back(size: list[int], dim: int, ranks: list[int], n: int) -> None:
    dim = dim % len(size)
    spec = ChunkShardingSpec(dim, [f"rank:{r}/cpu" for r in ranks[:n]])
    metas = _metas(spec, size)
    check_covering(metas, size)
    inferred = infer_sharding_spec(metas)
    # The same layout comes back (a different dim only when every shard spans the tensor in the others).
    assert inferred.build_metadata(size, TensorProperties()).shards_metadata == metas or all(
        m.numel() in (0, math.prod(size)) for m in metas
    )
