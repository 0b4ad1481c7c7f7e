"""Behaviour torch 2.13's own ``_shard`` tests rely on (integration_tests/torch_suite), one test per fix."""

from __future__ import annotations

import random
from typing import Any, Callable

import pytest
import torch
from torch import nn

import shardwise
from shardwise import shard_parameter
from shardwise._vocab import validation as _validation
from shardwise._vocab.metadata import Placement
from shardwise._vocab.validation import check_covering, validate_layout, validate_non_overlapping
from shardwise.errors import LocalShardsMismatchError
from shardwise.sharded_tensor import (
    Shard,
    ShardMetadata,
    ShardedTensor,
    ShardedTensorBase,
    ShardedTensorMetadata,
    TensorProperties,
    init_from_local_shards,
)
from shardwise.sharding_spec import ChunkShardingSpec, DevicePlacementSpec, EnumerableShardingSpec
from shardwise.sharding_spec._internals import get_chunk_sharding_params

from rank_helpers import run as _run


def _attempt(fn: Callable[[], Any]) -> tuple[str, str]:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects which error each rank saw
        return type(exc).__name__, str(exc)
    return "none", ""


# -- init_from_local_shards(..., init_rrefs=True): validation comes first -----


def rrefs_after_validation() -> dict[str, tuple[str, str]]:
    group = shardwise.get_default_group()
    r = group.rank
    md = ShardMetadata([r * 2, 0], [2, 2], f"rank:{r}/cpu")
    overlap = ShardMetadata([0, 0], [3, 2], f"rank:{r}/cpu")  # rows 0..2 on both ranks
    return {
        "empty": _attempt(lambda: init_from_local_shards([], [4, 2], init_rrefs=True)),
        "overlap": _attempt(
            lambda: init_from_local_shards([Shard(torch.ones(3, 2), overlap)], [4, 2], init_rrefs=True)
        ),
        "gaps": _attempt(lambda: init_from_local_shards([Shard(torch.ones(2, 2), md)], [5, 2], init_rrefs=True)),
        "valid": _attempt(lambda: init_from_local_shards([Shard(torch.ones(2, 2), md)], [4, 2], init_rrefs=True)),
    }


def test_init_from_local_shards_validates_before_refusing_init_rrefs() -> None:
    for seen in _run(rrefs_after_validation, 2):
        assert seen["empty"][0] == "ValueError" and "have no local shards on all ranks" in seen["empty"][1], seen
        assert seen["overlap"][0] == "ValueError" and "overlap" in seen["overlap"][1], seen
        assert seen["gaps"][0] == "ValueError" and "does not match tensor volume" in seen["gaps"][1], seen
        assert seen["valid"][0] == "NotImplementedError" and "init_rrefs=True" in seen["valid"][1], seen


# -- specs are mutable (torch's are plain dataclasses) ------------------------


def test_chunk_spec_assignment_is_checked_and_normalised() -> None:
    ranks = [f"rank:{r}/cpu" for r in range(4)]
    spec = ChunkShardingSpec(dim=0, placements=ranks)
    assert get_chunk_sharding_params(21, 4, spec, 1) == (6, 6)
    ranks[1], ranks[2] = ranks[2], ranks[1]
    ranks[0], ranks[3] = ranks[3], ranks[0]
    spec.placements = ranks  # type: ignore[assignment]  # as torch's test does
    assert spec.placements == tuple(Placement(p) for p in ranks)
    assert get_chunk_sharding_params(21, 4, spec, 1) == (12, 6)
    assert get_chunk_sharding_params(21, 4, spec, 3) == (0, 6)
    spec.dim = 1
    assert spec == ChunkShardingSpec(1, ranks)
    with pytest.raises(ValueError, match="invalid placement 'rank:0/cuda:x'"):
        spec.placements = ["rank:0/cuda:x"]  # type: ignore[assignment]
    with pytest.raises(ValueError, match="at least one placement"):
        spec.placements = []  # type: ignore[assignment]
    with pytest.raises(ValueError, match="Sharding dim needs to be an integer"):
        spec.dim = 1.5  # type: ignore[assignment]
    with pytest.raises(NotImplementedError, match="named dimensions"):
        spec.dim = "rows"  # type: ignore[assignment]
    assert spec == ChunkShardingSpec(1, ranks)  # a refused assignment leaves the spec as it was
    with pytest.raises(TypeError, match="unhashable"):
        hash(spec)


def test_enumerable_and_device_specs_are_mutable_and_checked() -> None:
    top = ShardMetadata([0, 0], [2, 2], "rank:0/cpu")
    bottom = ShardMetadata([2, 0], [2, 2], "rank:1/cpu")
    spec = EnumerableShardingSpec([top])
    spec.shards = (top, bottom)  # type: ignore[assignment]
    assert spec.shards == [top, bottom]
    assert [s.shard_offsets for s in spec.build_metadata([4, 2]).shards_metadata] == [[0, 0], [2, 0]]
    with pytest.raises(ValueError, match="overlap"):
        spec.shards = [top, ShardMetadata([1, 0], [2, 2], "rank:1/cpu")]
    with pytest.raises(ValueError, match="Empty shard list provided"):
        spec.shards = []
    assert spec.shards == [top, bottom]
    with pytest.raises(TypeError, match="unhashable"):
        hash(spec)
    device = DevicePlacementSpec("rank:0/cpu")
    device.device = "rank:1/cpu"  # type: ignore[assignment]
    assert device.device == Placement("rank:1/cpu") and device == DevicePlacementSpec("rank:1/cpu")
    with pytest.raises(TypeError, match="unhashable"):
        hash(device)


# -- ShardedTensorBase's form: no group, no rank checks -----------------------


def base_keeps_every_shard() -> dict[str, Any]:
    w = shardwise.get_default_group().size
    shards_md = [ShardMetadata([r * 2, 0], [2, 3], f"rank:{r}/cpu") for r in range(w)]
    metadata = ShardedTensorMetadata(shards_md, torch.Size([2 * w, 3]), TensorProperties())
    shards = [Shard(torch.full((2, 3), float(r)), md) for r, md in enumerate(shards_md)]
    st = ShardedTensorBase._init_from_local_shards_and_global_metadata(shards, sharded_tensor_metadata=metadata)
    return {
        "local": [s.tensor[0, 0].item() for s in st.local_shards()],
        "types": [type(st).__name__, isinstance(st, ShardedTensorBase), issubclass(ShardedTensor, ShardedTensorBase)],
        "group": st._process_group is None,
        # Constructing the base still builds a ShardedTensor, as when ShardedTensorBase was an alias of it.
        "constructed": type(
            ShardedTensorBase(ChunkShardingSpec(0, [f"rank:{r}/cpu" for r in range(w)]), 4, 3)
        ).__name__,
        # ShardedTensor's own form still checks the shards against this rank's placements.
        "st_form": _attempt(lambda: ShardedTensor._init_from_local_shards_and_global_metadata(shards, metadata)),
    }


def test_sharded_tensor_base_form_does_no_cross_rank_checks() -> None:
    for seen in _run(base_keeps_every_shard, 2):
        assert seen["local"] == [0.0, 1.0], seen
        assert seen["types"] == ["ShardedTensor", True, True] and seen["group"], seen
        assert seen["constructed"] == "ShardedTensor", seen
        assert seen["st_form"][0] == LocalShardsMismatchError.__name__, seen


# -- shard_parameter on a plain tensor attribute ------------------------------


def plain_attribute() -> dict[str, tuple[str, str]]:
    w = shardwise.get_default_group().size
    spec = ChunkShardingSpec(0, [f"rank:{r}/cpu" for r in range(w)])
    fc = nn.Linear(4, 4)
    del fc.bias
    fc.bias = torch.rand(4, 4).t()  # a plain attribute, as torch's test_shard_parameter_errors sets
    seen = {"noncontig": _attempt(lambda: shard_parameter(fc, "bias", spec))}
    fc.bias = torch.rand(4)
    seen["plain"] = _attempt(lambda: shard_parameter(fc, "bias", spec))
    return seen


def test_shard_parameter_plain_attribute_checks_as_torch() -> None:
    for seen in _run(plain_attribute, 2):
        assert seen["noncontig"][0] == "ValueError" and "bias is not a contiguous Tensor" in seen["noncontig"][1], seen
        assert seen["plain"][0] == "KeyError" and "attribute 'bias' already exists" in seen["plain"][1], seen


# -- metadata validation: the public checks take the direct path --------------


def _boxes(layout: str, n: int) -> tuple[list[ShardMetadata], list[int]]:
    if layout == "rows":
        return [ShardMetadata([i, 0], [1, 4], "rank:0/cpu") for i in range(n)], [n, 4]
    if layout == "chunk":
        spec = ChunkShardingSpec(1, [f"rank:{i}/cpu" for i in range(n)])
        return list(spec.build_metadata([4, 3 * n - 1]).shards_metadata), [4, 3 * n - 1]
    k = round(n ** (1 / 3))
    cells = [ShardMetadata([i, j, m], [1, 1, 1], "rank:0/cpu") for i in range(k) for j in range(k) for m in range(k)]
    return cells, [k, k, k]


@pytest.mark.parametrize("layout", ["rows", "chunk", "grid3d"])
@pytest.mark.parametrize("n", [8, 64, 1000])
def test_public_checks_build_no_columns(monkeypatch: pytest.MonkeyPatch, layout: str, n: int) -> None:
    # Building per-dim columns first cost more than torch 2.13's whole check below a few hundred shards.
    def refuse(*_: Any) -> None:
        raise AssertionError("columns built")

    monkeypatch.setattr(_validation, "_Columns", refuse)
    shards, size = _boxes(layout, n)
    random.Random(n).shuffle(shards)
    validate_non_overlapping(shards)
    check_covering(shards, size)
    validate_layout(shards, size)
    EnumerableShardingSpec(shards).build_metadata(size)


def test_direct_path_errors() -> None:
    rows = [ShardMetadata([i, 0], [2, 4], "rank:0/cpu") for i in range(0, 8, 2)]
    with pytest.raises(ValueError, match=r"Shards overlap: shards 1 \(offsets=\[2, 0\].*and 4 \(offsets=\[3, 0\]"):
        validate_non_overlapping([*rows, ShardMetadata([3, 0], [1, 4], "rank:0/cpu")])
    # Empty shards hold nothing: inside another shard they overlap nothing, anywhere.
    validate_non_overlapping([*rows, ShardMetadata([3, 0], [0, 4], "rank:0/cpu"), ShardMetadata([1, 1], [2, 0])])
    chunks = [ShardMetadata([0, 0], [3, 4]), ShardMetadata([3, 0], [3, 4]), ShardMetadata([5, 0], [2, 4])]
    with pytest.raises(ValueError, match=r"shards 1 .* and 2 .* overlap"):
        validate_non_overlapping(chunks)
    with pytest.raises(ValueError, match="Found inconsistent ranks for shards"):
        validate_non_overlapping([*rows, ShardMetadata([8], [2])])
    with pytest.raises(ValueError, match="exceeds tensor dim: 7"):
        check_covering(rows, [7, 4])
    with pytest.raises(ValueError, match="Rank of tensor is 3, but shards rank is 2"):
        check_covering(rows, [8, 4, 1])
    with pytest.raises(ValueError, match="does not match tensor volume: 36"):
        check_covering(rows, [9, 4])
    check_covering([*rows, ShardMetadata([9, 9], [0, 4])], [8, 4])  # an empty shard may sit outside
