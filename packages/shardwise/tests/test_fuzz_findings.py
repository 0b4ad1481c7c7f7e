"""What ``integration_tests/test_fuzz.py`` found: arguments that escaped as undocumented errors, or slipped through.

Each test pins one finding: the exception a caller now gets (the one the
docstring names) where an ``OverflowError``, ``KeyError``,
``AttributeError`` or ``IndexError`` escaped before, or a check that was
missing or inconsistent.
"""

from __future__ import annotations

import pytest
import torch

import shardwise
from shardwise._vocab.metadata import check_covering, intersect, validate_non_overlapping
from shardwise.sharded_tensor import ShardMetadata, ShardedTensorMetadata, TensorProperties
from shardwise.sharding_spec import (
    ChunkShardingSpec,
    EnumerableShardingSpec,
    chunk_sizes,
    infer_sharding_spec,
    spec_from_dict,
)

from rank_helpers import run as _run


@pytest.mark.parametrize("value", [float("inf"), float("nan"), "1", None, [1], True])
def test_non_integer_offsets_are_type_errors(value: object) -> None:
    # int(float("inf")) raises OverflowError, which escaped.
    with pytest.raises(TypeError, match="shard_offsets must be integers"):
        ShardMetadata([value], [1])
    with pytest.raises(TypeError, match="shard_sizes must be a sequence of integers"):
        ShardMetadata([0], 5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("size", "error", "message"),
    [
        ([-3], ValueError, "must not be negative"),  # was accepted: metadata of size [-3]
        ([2.5], TypeError, "must be integers"),  # was truncated to 2
        ([float("inf")], TypeError, "must be integers"),  # was OverflowError
        (["x"], TypeError, "must be integers"),
        (5, TypeError, "sequence of integers"),
    ],
)
def test_build_metadata_checks_the_tensor_size(size: object, error: type[Exception], message: str) -> None:
    chunk = ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu"])
    enumerable = EnumerableShardingSpec([ShardMetadata([0], [2], "rank:0/cpu")])
    for spec in (chunk, enumerable):
        with pytest.raises(error, match=message):
            spec.build_metadata(size, TensorProperties())  # type: ignore[arg-type]


def test_chunk_sizes_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="dim_size must not be negative"):
        chunk_sizes(-3, 2)  # was [0, 0]
    with pytest.raises(TypeError, match="dim_size must be an int"):
        chunk_sizes(3.5, 2)  # type: ignore[arg-type]  # was [2, 1.5]
    with pytest.raises(TypeError, match="chunks must be an int"):
        chunk_sizes(3, None)  # type: ignore[arg-type]
    assert chunk_sizes(0, 3) == [0, 0, 0]


def test_tensor_metadata_refuses_negative_sizes() -> None:
    with pytest.raises(ValueError, match="size must not be negative"):
        ShardedTensorMetadata([], torch.Size([2, -1]))


@pytest.mark.parametrize(
    "data",
    [
        {},
        {"type": "chunk"},
        {"type": "chunk", "placements": ["rank:0/cpu"]},
        {"type": "chunk", "dim": "rows", "placements": ["rank:0/cpu"]},
        {"type": "enumerable"},
        {"type": "enumerable", "shards": [{}]},
        {"type": "enumerable", "shards": {"offsets": [0]}},
        [],
        None,
    ],
)
def test_malformed_spec_dicts_are_value_errors(data: object) -> None:
    # KeyError / AttributeError / NotImplementedError escaped for these.
    with pytest.raises(ValueError):
        spec_from_dict(data)  # type: ignore[arg-type]


def test_malformed_metadata_dicts_are_value_errors() -> None:
    md = ChunkShardingSpec(0, ["rank:0/cpu"]).build_metadata([2, 3], TensorProperties())
    good = md.to_dict()
    assert ShardedTensorMetadata.from_dict(good).to_dict() == good
    for key in good:
        with pytest.raises(ValueError, match=key):
            ShardedTensorMetadata.from_dict({k: v for k, v in good.items() if k != key})
    for key in good["tensor_properties"]:
        with pytest.raises(ValueError, match=key):
            TensorProperties.from_dict({k: v for k, v in good["tensor_properties"].items() if k != key})
    with pytest.raises(ValueError, match="memory_format"):
        TensorProperties.from_dict({**good["tensor_properties"], "memory_format": []})
    with pytest.raises(ValueError, match="offsets"):
        ShardMetadata.from_dict({"sizes": [1]})
    with pytest.raises(ValueError, match="must be a dict"):
        ShardMetadata.from_dict([0, 1])  # type: ignore[arg-type]


def test_shards_of_different_dimensions_are_value_errors() -> None:
    flat, square = ShardMetadata([0], [2], "rank:0/cpu"), ShardMetadata([0, 0], [1, 1], "rank:0/cpu")
    scalar = ShardMetadata([], [], "rank:0/cpu")
    # The 0-d shard second raised IndexError; the 2-d one was reported as an overlap.
    for shards in ([flat, scalar], [flat, square], [scalar, flat]):
        with pytest.raises(ValueError, match="different numbers of dimensions"):
            validate_non_overlapping(shards)
    # intersect zipped the shorter box away.
    with pytest.raises(ValueError, match="different dimensions"):
        intersect([0], [2], [0, 0], [1, 1])


def test_inferred_chunk_specs_fit_the_tensor_size() -> None:
    # An empty shard tiles any tensor without elements, but a chunk spec would cut that tensor otherwise.
    shards = [ShardMetadata([0, 0], [0, 0], "rank:0/cpu")]
    assert isinstance(infer_sharding_spec(shards), ChunkShardingSpec)
    assert isinstance(infer_sharding_spec(shards, [0, 0]), ChunkShardingSpec)
    assert isinstance(infer_sharding_spec(shards, [0, 3]), EnumerableShardingSpec)
    rows = ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu"]).build_metadata([5, 2], TensorProperties())
    assert infer_sharding_spec(rows.shards_metadata, [5, 2]) == ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu"])


def test_infer_sharding_spec_names_entries_that_are_not_shard_metadata() -> None:
    with pytest.raises(TypeError, match="shard 1 must be a ShardMetadata"):
        infer_sharding_spec([ShardMetadata([0], [1], "rank:0/cpu"), 3])  # type: ignore[list-item]


def test_empty_shards_may_sit_anywhere() -> None:
    # Empty along dim 0 but "sticking out" along dim 1 was refused, while the same
    # shard sticking out along dim 0 was accepted: an empty shard holds nothing either way.
    whole = ShardMetadata([0, 0], [3, 2], "rank:0/cpu")
    for offsets, sizes in [([0, 5], [0, 2]), ([5, 0], [0, 2]), ([4, 4], [1, 0])]:
        check_covering([whole, ShardMetadata(offsets, sizes, "rank:1/cpu")], [3, 2])
    with pytest.raises(ValueError, match="outside the tensor"):
        check_covering([whole, ShardMetadata([0, 2], [3, 1], "rank:1/cpu")], [3, 2])


def _full_tensor_with_an_empty_shard_past_the_end() -> list[bool]:
    spec = EnumerableShardingSpec(
        [ShardMetadata([0, 0], [3, 2], "rank:0/cpu"), ShardMetadata([5, 0], [0, 2], "rank:0/cpu")]
    )
    dense = torch.arange(6.0).reshape(3, 2)
    st = shardwise.shard_tensor(dense.clone(), spec)
    empty = shardwise.shard_tensor(torch.empty(0, 2), EnumerableShardingSpec([ShardMetadata([4, 0], [0, 2], "rank:0/cpu")]))
    # narrow() refused the empty shard's offsets: IndexError from full_tensor.
    return [torch.equal(st.full_tensor(), dense), empty.full_tensor().shape == (0, 2)]


def test_full_tensor_with_an_empty_shard_past_the_end() -> None:
    assert _run(_full_tensor_with_an_empty_shard_past_the_end, 1) == [[True, True]]
