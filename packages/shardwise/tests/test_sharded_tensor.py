"""ShardedTensor construction, validation across ranks, and op dispatch."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import shardwise
from shardwise.errors import OpNotFoundError, PeerError
from shardwise.sharded_tensor import (
    Shard,
    ShardMetadata,
    ShardedTensor,
    ShardedTensorMetadata,
    TensorProperties,
    custom_sharded_op_impl,
    empty,
    init_from_local_shards,
)
from shardwise.sharding_spec import ChunkShardingSpec, EnumerableShardingSpec, custom_sharding_spec_op

from rank_helpers import TEST_BACKEND
from rank_helpers import outcome as _outcome
from rank_helpers import run as _run


def _dense(size: list[int]) -> torch.Tensor:
    return torch.arange(float(torch.Size(size).numel())).reshape(size)


def _slice(full: torch.Tensor, md: ShardMetadata) -> torch.Tensor:
    out = full
    for d, (o, s) in enumerate(zip(md.shard_offsets, md.shard_sizes, strict=False)):
        out = out.narrow(d, o, s)
    return out.contiguous()


def construction() -> dict[str, Any]:
    g = shardwise.get_default_group()
    r = g.rank
    spec = ChunkShardingSpec(0, ["rank:2/cpu", "rank:0/cpu", "rank:1/cpu"])
    st = empty(spec, 7, 4, dtype=torch.float64, requires_grad=True)
    assert isinstance(st, torch.Tensor) and isinstance(st, ShardedTensor)
    assert st.shape == torch.Size([7, 4]) and st.size() == torch.Size([7, 4]) and st.size(-1) == 4 and st.dim() == 2
    assert st.ndim == 2 and st.dtype == torch.float64 and st.device == torch.device("cpu") and st.requires_grad
    assert st.sharding_spec() == spec and st.metadata().size == torch.Size([7, 4])
    (shard,) = st.local_shards()
    expected_rows = {2: (0, 3), 0: (3, 3), 1: (6, 1)}[r]
    assert (shard.metadata.shard_offsets[0], shard.metadata.shard_sizes[0]) == expected_rows
    assert st.local_tensor() is shard.tensor and shard.tensor.requires_grad and shard.tensor.is_leaf
    assert st.is_contiguous() and "ShardedTensor(size=[7, 4]" in repr(st)
    with pytest.raises(IndexError, match="dimension 2 out of range"):
        st.size(2)

    # A chunk spec with more placements than rows leaves empty shards; one with fewer leaves ranks without.
    small = empty(ChunkShardingSpec(1, ["rank:0/cpu", "rank:1/cpu", "rank:2/cpu"]), 2, 2)
    assert [list(s.tensor.shape) for s in small.local_shards()] == [[2, 1] if r < 2 else [2, 0]]
    two = empty(ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu"]), 4)
    assert len(two.local_shards()) == (0 if r == 2 else 1)

    # Several shards on one rank: local_shards has both, local_tensor refuses.
    grid = EnumerableShardingSpec(
        [ShardMetadata([i, j], [2, 2], f"rank:{(i + j) // 2 % 3}/cpu") for i in (0, 2) for j in (0, 2)]
    )
    st_grid = empty(grid, 4, 4)
    owned = [s for s in grid.shards if s.rank == r]
    assert [s.metadata for s in st_grid.local_shards()] == owned
    errors = {}
    errors["two_local"] = _outcome(st_grid.local_tensor) if len(owned) != 1 else ("skip", "")
    errors["outside_group"] = _outcome(lambda: empty(ChunkShardingSpec(0, ["rank:0/cpu", "rank:3/cpu"]), 4))
    errors["bad_size"] = _outcome(lambda: empty(grid, 4, 5))
    errors["rrefs"] = _outcome(lambda: empty(spec, 3, init_rrefs=True))

    # _init_from_local_tensor / _init_from_local_shards_and_global_metadata: no communication.
    full = _dense([7, 4])
    meta = spec.build_metadata([7, 4], TensorProperties())
    mine = next(m for m in meta.shards_metadata if m.rank == r)
    from_local = ShardedTensor._init_from_local_tensor(_slice(full, mine), spec, 7, 4)
    assert torch.equal(from_local.local_tensor(), _slice(full, mine)) and from_local.sharding_spec() == spec
    from_meta = ShardedTensor._init_from_local_shards_and_global_metadata([Shard(_slice(full, mine), mine)], meta)
    assert from_meta.sharding_spec() == spec
    errors["meta_missing_shard"] = _outcome(
        lambda: ShardedTensor._init_from_local_shards_and_global_metadata([], meta)
    )
    errors["local_tensor_wrong_size"] = _outcome(
        lambda: ShardedTensor._init_from_local_tensor(torch.zeros(5, 4), spec, 7, 4)
    )
    return errors


def test_construction_and_local_errors() -> None:
    results = _run(construction, 3)
    for r, errors in enumerate(results):
        assert errors["outside_group"][0] == "ValueError" and "placed on rank 3, but the group has 3 rank(s)" in errors["outside_group"][1]
        assert errors["bad_size"][0] == "ValueError" and "do not cover" in errors["bad_size"][1]
        assert errors["rrefs"][0] == "NotImplementedError"
        assert errors["meta_missing_shard"][0] == "LocalShardsMismatchError"  # a ValueError and a RuntimeError
        assert f"rank {r} passed 0 local shard(s), but the global metadata places 1" in errors["meta_missing_shard"][1]
        assert errors["local_tensor_wrong_size"][0] == "ValueError"
        if errors["two_local"][0] != "skip":
            assert errors["two_local"][0] == "NotImplementedError" and "needs exactly one local shard" in errors["two_local"][1]
    assert sum(errors["two_local"][0] == "NotImplementedError" for errors in results) >= 1


def from_local_shards() -> dict[str, Any]:
    g = shardwise.get_default_group()
    r, w = g.rank, g.size
    full = _dense([6, 4])
    out: dict[str, Any] = {}

    def shards_for(metas: list[ShardMetadata], source: torch.Tensor = full) -> list[Shard]:
        return [Shard(_slice(source, m), m) for m in metas if m.rank == r]

    # Row chunks, placements permuted: inferred as the chunk spec, even on dim 0.
    chunk = ChunkShardingSpec(0, [f"rank:{(p + 1) % w}/cpu" for p in range(w)])
    metas = chunk.build_metadata([6, 4], TensorProperties()).shards_metadata
    st = init_from_local_shards(shards_for(metas), 6, 4)
    # Metadata lists shards rank by rank (the order ranks reported them in).
    assert st.sharding_spec() == chunk and sorted(st.metadata().shards_metadata, key=str) == sorted(metas, key=str)
    # A 2x2 grid: inferred as Enumerable.
    grid_metas = [ShardMetadata([i, j], [3, 2], f"rank:{(2 * (i // 3) + j // 2) % w}/cpu") for i in (0, 3) for j in (0, 2)]
    st = init_from_local_shards(shards_for(grid_metas), [6, 4])
    assert isinstance(st.sharding_spec(), EnumerableShardingSpec) and len(st.local_shards()) == sum(m.rank == r for m in grid_metas)
    assert all(torch.equal(s.tensor, _slice(full, s.metadata)) for s in st.local_shards())

    # Bad input: every rank must raise, none may hang. Each case is one collective.
    overlap = [ShardMetadata([0, 0], [4, 4], "rank:0/cpu"), ShardMetadata([3, 0], [3, 4], f"rank:{w - 1}/cpu")]
    out["overlap"] = _outcome(lambda: init_from_local_shards(shards_for(overlap), 6, 4))
    gap = [ShardMetadata([0, 0], [2, 4], "rank:0/cpu"), ShardMetadata([3, 0], [3, 4], f"rank:{w - 1}/cpu")]
    out["not_covering"] = _outcome(lambda: init_from_local_shards(shards_for(gap), 6, 4))
    out["size_mismatch"] = _outcome(lambda: init_from_local_shards(shards_for(metas), 6 + (r == 1), 4))
    out["dtype_mismatch"] = _outcome(
        lambda: init_from_local_shards(shards_for(metas, full.double() if r == 1 else full), 6, 4)
    )
    # Rank 1 passes a shard that says it lives on rank 0.
    other = ShardMetadata([0, 0], [6, 4], "rank:0/cpu")
    out["other_rank"] = _outcome(lambda: init_from_local_shards([Shard(full, other)] if r in (0, 1) else [], 6, 4))
    outside = ShardMetadata([0, 0], [6, 4], f"rank:{w}/cpu")
    out["outside_group"] = _outcome(lambda: init_from_local_shards([Shard(full, outside)] if r == 0 else [], 6, 4))
    row = ShardMetadata([0, 0], [4, 6], "rank:0/cpu")
    out["non_contiguous"] = _outcome(
        lambda: init_from_local_shards([Shard(full.t(), row)] if r == 0 else [], 4, 6)
    )
    out["not_a_shard"] = _outcome(lambda: init_from_local_shards([full] if r == w - 1 else [], 6, 4))  # type: ignore[list-item]
    out["nobody"] = _outcome(lambda: init_from_local_shards([], 6, 4))
    # The group is still in step after all those failures.
    assert g.exchange(r) == list(range(w))
    return out


def test_init_from_local_shards_validates_on_every_rank() -> None:
    results = _run(from_local_shards, 2)
    w = len(results)
    for r, out in enumerate(results):
        assert out["overlap"][0] == "ValueError" and "overlap" in out["overlap"][1]
        assert out["not_covering"][0] == "ValueError" and "do not cover the tensor of size [6, 4]" in out["not_covering"][1]
        assert out["size_mismatch"][0] == "ValueError" and "ranks disagree on the global size" in out["size_mismatch"][1]
        assert out["dtype_mismatch"][0] == "ValueError" and "ranks disagree on the tensor properties" in out["dtype_mismatch"][1]
        assert out["nobody"][0] == "ValueError" and "no rank passed a local shard" in out["nobody"][1]
        # Local faults: the rank at fault raises the real error, its peers a PeerError naming it.
        for case, culprit, text in (
            ("other_rank", 1, "placed on rank:0/cpu, but it was passed on rank 1"),
            ("outside_group", 0, f"placed on rank {w}, but the group has {w} rank(s)"),
            ("non_contiguous", 0, "is not contiguous"),
            ("not_a_shard", w - 1, "must be a Shard"),
        ):
            kind, message = out[case]
            if r == culprit:
                assert kind in ("ValueError", "TypeError") and text in message, (case, out[case])
            else:
                assert kind == PeerError.__name__ and f"rank {culprit}" in message, (case, out[case])


def dispatch() -> dict[str, Any]:
    g = shardwise.get_default_group()
    r = g.rank
    spec = ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu"])
    full = _dense([4, 3])
    meta = spec.build_metadata([4, 3], TensorProperties())
    mine = next(m for m in meta.shards_metadata if m.rank == r)
    st = ShardedTensor._init_from_local_shards_and_global_metadata([Shard(_slice(full, mine), mine)], meta)
    out: dict[str, Any] = {}
    out["matmul"] = _outcome(lambda: torch.matmul(st, st))
    out["embedding"] = _outcome(lambda: F.embedding(torch.tensor([0]), st))

    seen: list[Any] = []

    @custom_sharded_op_impl(torch.matmul)
    def my_matmul(types: Any, args: Any, kwargs: Any, process_group: Any) -> str:
        seen.append(process_group)
        return "custom matmul"

    assert torch.matmul(st, st) == "custom matmul" and seen == [g]

    # softmax along the unsharded dim runs on the local shard; along the sharded dim it is refused.
    from shardwise._tensor.custom_ops import register_sharded_op_on_local_tensor

    def only_unsharded(st_: ShardedTensor, dim: int, **kwargs: Any) -> None:
        if dim % st_.dim() == st_.sharding_spec().dim:  # type: ignore[attr-defined]
            raise ValueError("softmax along the sharded dim needs the whole row")

    register_sharded_op_on_local_tensor(F.softmax, extra_check=only_unsharded)
    soft = F.softmax(st, 1)
    assert isinstance(soft, ShardedTensor) and torch.allclose(soft.local_tensor(), F.softmax(_slice(full, mine), 1))
    out["softmax_sharded_dim"] = _outcome(lambda: F.softmax(st, 0))

    @custom_sharding_spec_op(EnumerableShardingSpec, torch.matmul)
    def enum_matmul(types: Any, args: Any, kwargs: Any, process_group: Any) -> str:
        return "enumerable matmul"

    # The generic override still serves ChunkShardingSpec; the spec-specific one wins for Enumerable.
    enum_st = ShardedTensor._init_from_local_shards_and_global_metadata(
        [Shard(_slice(full, mine), mine)], meta, sharding_spec=EnumerableShardingSpec(meta.shards_metadata)
    )
    assert torch.matmul(st, st) == "custom matmul" and torch.matmul(enum_st, enum_st) == "enumerable matmul"
    return out


#: Whether ranks load shardwise-embedding: the test backend switches entry-point
#: autoloading off, other backends (tox env mpi) load every installed plugin.
EMBEDDING_PLUGIN_LOADS = TEST_BACKEND != "test-gloo" and importlib.util.find_spec("shardwise_embedding") is not None


def test_dispatch_and_custom_ops() -> None:
    for out in _run(dispatch, 2):
        assert out["matmul"][0] == OpNotFoundError.__name__
        assert "no sharded implementation of torch.matmul for ChunkShardingSpec" in out["matmul"][1]
        if EMBEDDING_PLUGIN_LOADS:
            assert out["embedding"] == ("ok", ""), out["embedding"]
        else:
            assert out["embedding"][0] == OpNotFoundError.__name__, out["embedding"]
            assert "pip install shardwise-embedding" in out["embedding"][1]
        assert out["softmax_sharded_dim"] == ("ValueError", "softmax along the sharded dim needs the whole row")


def test_op_not_found_is_also_not_implemented_error() -> None:
    # torch 2.13 raised RuntimeError for unsupported ops; code catching that keeps working.
    assert issubclass(OpNotFoundError, NotImplementedError) and issubclass(OpNotFoundError, RuntimeError)
    assert issubclass(OpNotFoundError, LookupError)


def test_custom_op_decorators_do_not_build_the_plugin_manager() -> None:
    from shardwise._registry import manager as _registry
    from shardwise._tensor import custom_ops as _custom_ops

    _registry.reset()

    def impl(types: Any, args: Any, kwargs: Any, process_group: Any) -> None:
        return None

    try:
        custom_sharded_op_impl(torch.kron)(impl)
        assert _registry._current is None
        from shardwise import plugins

        record = plugins.find_op(torch.kron, ChunkShardingSpec)
        assert record.impl is impl and record.override
    finally:
        from shardwise.sharding_spec import ShardingSpec

        _custom_ops._remove(torch.kron, ShardingSpec)
    assert plugins.find_op_or_none(torch.kron, ChunkShardingSpec) is None


def test_custom_sharding_spec_op_needs_a_spec_class() -> None:
    with pytest.raises(TypeError, match="needs a ShardingSpec subclass"):
        custom_sharding_spec_op(int, torch.add)


def test_metadata_of_tensor_matches_spec() -> None:
    spec = ChunkShardingSpec(1, ["rank:0/cpu", "rank:1/cpu"])
    meta = spec.build_metadata([2, 5], TensorProperties(dtype=torch.int64))
    assert isinstance(meta, ShardedTensorMetadata) and meta.tensor_properties.dtype == torch.int64
    assert [m.shard_sizes for m in meta.shards_metadata] == [[2, 3], [2, 2]]
