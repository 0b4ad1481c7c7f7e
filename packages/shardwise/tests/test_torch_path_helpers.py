"""The helpers at torch 2.13's ``_shard`` paths that shardwise implements, against torch's results.

Chunk arithmetic, layout checks and metadata building in-process (hypothesis
where inputs range widely); ``_shard_tensor``, the reshard helpers, the op
faces and the embedding ops on 2 and 3 ranks through the harness.
"""

from __future__ import annotations

import importlib.util
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hst

import shardwise
from shardwise.sharded_tensor import ShardMetadata, ShardedTensorMetadata, TensorProperties
from shardwise.sharded_tensor import reshard as sw_reshard
from shardwise.sharded_tensor import utils as sw_utils
from shardwise.sharding_spec import ChunkShardingSpec
from shardwise.sharding_spec import _internals as sw_internals
from shardwise.sharding_spec.chunk_sharding_spec import narrow_tensor

from rank_helpers import HAS_TORCH_PG
from rank_helpers import run as _run

with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)
    import torch.distributed._shard.sharded_tensor.reshard as torch_reshard
    import torch.distributed._shard.sharded_tensor.utils as torch_st_utils
    import torch.distributed._shard.sharding_spec._internals as torch_internals
    from torch.distributed._shard._utils import narrow_tensor as torch_narrow_tensor
    from torch.distributed._shard.metadata import ShardMetadata as TorchShardMetadata
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata as TorchSTMetadata
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties as TorchProperties
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec as TorchChunk

HAS_PLUGIN = importlib.util.find_spec("shardwise_embedding") is not None


# -- chunk arithmetic, against torch (no processes) -------------------------------


@settings(max_examples=300, deadline=None)
@given(hst.integers(0, 10**6), hst.integers(1, 64), hst.integers(0, 80))
def test_chunk_sizes_equal_torchs(dim_size: int, chunks: int, idx: int) -> None:
    split = sw_internals.get_split_size(dim_size, chunks)
    assert split == torch_internals.get_split_size(dim_size, chunks)
    assert sw_internals.get_chunked_dim_size(dim_size, split, idx) == torch_internals.get_chunked_dim_size(
        dim_size, split, idx
    )
    # The same cut as torch.chunk (where it makes as many pieces).
    pieces = [sw_internals.get_chunked_dim_size(dim_size, split, i) for i in range(chunks)]
    assert sum(pieces) == dim_size


def _placements(order: list[int]) -> list[str]:
    return [f"rank:{r}/cpu" for r in order]


@settings(max_examples=200, deadline=None)
@given(hst.integers(0, 500), hst.permutations(list(range(6))), hst.integers(1, 6), hst.data())
def test_chunk_sharding_params_equal_torchs(dim_size: int, perm: list[int], world: int, data: Any) -> None:
    order = [r for r in perm if r < world]
    rank = data.draw(hst.sampled_from(order))
    ours = sw_internals.get_chunk_sharding_params(dim_size, world, ChunkShardingSpec(0, _placements(order)), rank)
    assert ours == torch_internals.get_chunk_sharding_params(dim_size, world, TorchChunk(0, _placements(order)), rank)


def test_chunk_sharding_params_refuse_a_rank_without_a_chunk() -> None:
    # torch returns (0, size of the last chunk) here; shardwise says why there is no answer.
    with pytest.raises(ValueError, match="rank 5 holds no chunk"):
        sw_internals.get_chunk_sharding_params(10, 2, ChunkShardingSpec(0, _placements([0, 1])), 5)


@settings(max_examples=150, deadline=None)
@given(
    hst.lists(hst.integers(0, 9), min_size=1, max_size=3),
    hst.permutations(list(range(4))),
    hst.data(),
)
def test_build_reshard_metadata_equals_torchs(size: list[int], order: list[int], data: Any) -> None:
    dim = data.draw(hst.integers(-len(size), len(size) - 1))
    ours, our_ranks = sw_reshard.build_reshard_metadata(torch.Size(size), ChunkShardingSpec(dim, _placements(order)), 4)
    theirs, their_ranks = torch_reshard.build_reshard_metadata(torch.Size(size), TorchChunk(dim, _placements(order)), 4)
    assert our_ranks == their_ranks
    for a, b in zip(ours, theirs, strict=True):
        assert (a.shard_offsets, a.shard_sizes, str(a.placement)) == (b.shard_offsets, b.shard_sizes, str(b.placement))
    for rank in order:
        assert sw_reshard.get_idx_from_placements(
            ChunkShardingSpec(dim, _placements(order)).placements, rank
        ) == torch_reshard.get_idx_from_placements(TorchChunk(dim, _placements(order)).placements, rank)
    with pytest.raises(RuntimeError, match="current_rank not in the placement"):
        sw_reshard.get_idx_from_placements(ChunkShardingSpec(dim, _placements(order)).placements, 9)


def _both(offsets: list[int], sizes: list[int], rank: int = 0) -> tuple[ShardMetadata, TorchShardMetadata]:
    return ShardMetadata(offsets, sizes, f"rank:{rank}/cpu"), TorchShardMetadata(offsets, sizes, f"rank:{rank}/cpu")


def _outcome(fn: Any, *args: Any) -> str:
    try:
        fn(*args)
    except ValueError:
        return "ValueError"
    return "ok"


@pytest.mark.parametrize(
    ("boxes", "size"),
    [
        ([([0, 0], [2, 4]), ([2, 0], [2, 4])], [4, 4]),  # rows
        ([([0, 0], [4, 2]), ([0, 2], [4, 2])], [4, 4]),  # columns
        ([([0, 0], [3, 4]), ([2, 0], [2, 4])], [4, 4]),  # overlapping rows
        ([([0, 0], [4, 3]), ([0, 2], [4, 2])], [4, 4]),  # overlapping columns
        ([([0, 0], [2, 2]), ([0, 2], [2, 2]), ([2, 0], [2, 4])], [4, 4]),  # grid
        ([([0, 0], [2, 2]), ([1, 1], [2, 2])], [4, 4]),  # overlapping blocks
        ([([0, 0], [2, 4])], [4, 4]),  # leaves a gap
        ([([0, 0], [2, 4]), ([2, 0], [3, 4])], [4, 4]),  # sticks out
        ([([0, 0], [2, 4]), ([2, 0], [2, 4])], [4, 4, 1]),  # other number of dims
    ],
)
def test_layout_checks_agree_with_torch(boxes: list[tuple[list[int], list[int]]], size: list[int]) -> None:
    ours, theirs = zip(*(_both(o, s, i) for i, (o, s) in enumerate(boxes)), strict=True)
    assert _outcome(sw_internals.validate_non_overlapping_shards_metadata, list(ours)) == _outcome(
        torch_internals.validate_non_overlapping_shards_metadata, list(theirs)
    )
    if _outcome(torch_internals.validate_non_overlapping_shards_metadata, list(theirs)) == "ok":
        assert _outcome(sw_internals.check_tensor, list(ours), size) == _outcome(
            torch_internals.check_tensor, list(theirs), size
        )


def test_create_tensor_from_params_as_torchs() -> None:
    from torch.distributed._shard.sharded_tensor.api import _create_tensor_from_params as theirs

    from shardwise.sharded_tensor.api import _create_tensor_from_params as ours

    for props, torch_props in (
        (
            TensorProperties(dtype=torch.float64, requires_grad=True),
            TorchProperties(dtype=torch.float64, requires_grad=True),
        ),
        (TensorProperties(dtype=torch.int8), TorchProperties(dtype=torch.int8)),
    ):
        a = ours(5, 3, local_device=torch.device("cpu"), tensor_properties=props)
        b = theirs(5, 3, local_device=torch.device("cpu"), tensor_properties=torch_props)
        assert (a.shape, a.dtype, a.device, a.requires_grad, a.layout) == (
            b.shape,
            b.dtype,
            b.device,
            b.requires_grad,
            b.layout,
        )


def test_narrow_tensor_equals_torchs() -> None:
    t = torch.arange(60.0).reshape(4, 5, 3)
    for offsets, sizes in (([0, 0, 0], [4, 5, 3]), ([1, 2, 0], [2, 3, 3]), ([3, 0, 1], [1, 5, 2]), ([0, 4], [4, 1])):
        ours = narrow_tensor(t, ShardMetadata(offsets, sizes, "rank:0/cpu"))
        theirs = torch_narrow_tensor(t, TorchShardMetadata(offsets, sizes, "rank:0/cpu"))
        assert torch.equal(ours, theirs) and ours.data_ptr() == theirs.data_ptr()


def _rows(sizes: list[int], ranks: list[int], cols: int = 3) -> tuple[ShardedTensorMetadata, TorchSTMetadata]:
    """Row shards listed in the given rank order, offsets laid out in list order (before recalc fixes them)."""
    ours, theirs, offset = [], [], 0
    for n, r in zip(sizes, ranks, strict=True):
        a, b = _both([offset, 0], [n, cols], r)
        ours.append(a)
        theirs.append(b)
        offset += n
    size = [offset, cols]
    return (
        ShardedTensorMetadata(ours, torch.Size(size), TensorProperties()),
        TorchSTMetadata(theirs, torch.Size(size), TorchProperties()),
    )


def _boxes(md: Any) -> list[tuple[list[int], list[int], str]]:
    return [(list(s.shard_offsets), list(s.shard_sizes), str(s.placement)) for s in md.shards_metadata]


@settings(max_examples=100, deadline=None)
@given(hst.lists(hst.integers(1, 5), min_size=1, max_size=4), hst.data())
def test_build_global_metadata_equals_torchs(sizes: list[int], data: Any) -> None:
    # One rank's shards per entry, in rank order (as torch's callers gather them), and a rank without any.
    ours_md, theirs_md = _rows(sizes, list(range(len(sizes))))
    gathered_ours: list[Any] = [None]
    gathered_theirs: list[Any] = [None]
    for a, b in zip(ours_md.shards_metadata, theirs_md.shards_metadata, strict=True):
        gathered_ours.append(ShardedTensorMetadata([a], ours_md.size, TensorProperties()))
        gathered_theirs.append(TorchSTMetadata([b], theirs_md.size, TorchProperties()))
    recalc = data.draw(hst.booleans())
    ours = sw_utils.build_global_metadata(gathered_ours, recalc)
    theirs = torch_st_utils.build_global_metadata(gathered_theirs, recalc)
    assert _boxes(ours) == _boxes(theirs) and list(ours.size) == list(theirs.size)
    assert gathered_ours[1].shards_metadata[0] is not ours.shards_metadata[0]  # the inputs are not modified


def test_build_global_metadata_errors_as_torchs() -> None:
    a = ShardedTensorMetadata([ShardMetadata([0, 0], [2, 3], "rank:0/cpu")], torch.Size([4, 3]), TensorProperties())
    b = ShardedTensorMetadata([ShardMetadata([2, 0], [2, 3], "rank:1/cpu")], torch.Size([5, 3]), TensorProperties())
    with pytest.raises(ValueError, match="global_size property does not match from different ranks"):
        sw_utils.build_global_metadata([a, b])
    with pytest.raises(ValueError, match="ShardedTensor have no local shards on all ranks"):
        sw_utils.build_global_metadata([None, None])
    with pytest.raises(ValueError, match="overlap"):
        sw_utils.build_global_metadata([a, a])


def test_recalc_in_rank_order_equals_torch_and_fixes_other_orders() -> None:
    ours, theirs = _rows([1, 2, 3], [0, 1, 2])
    sw_utils.recalc_global_sharded_tensor_metadata(ours, 0)
    torch_st_utils.recalc_global_sharded_tensor_metadata(theirs, 0)
    assert _boxes(ours) == _boxes(theirs) and list(ours.size) == list(theirs.size) == [6, 3]
    # Listed out of rank order: each shard goes where its rank puts it (torch gives shard i the
    # i-th offset in rank order, so rank 0's 1 row would start at 0 but rank 2's 3 rows at 1).
    ours, _ = _rows([3, 1, 2], [2, 0, 1])
    sw_utils.recalc_global_sharded_tensor_metadata(ours, 0)
    assert _boxes(ours) == [
        ([3, 0], [3, 3], "rank:2/cpu"),
        ([0, 0], [1, 3], "rank:0/cpu"),
        ([1, 0], [2, 3], "rank:1/cpu"),
    ]
    sw_utils.validate_non_overlapping_shards_metadata(ours.shards_metadata)


# -- op registry helpers (no processes) ------------------------------------------------


def test_decorator_func_checks_the_signature_and_registers() -> None:
    from shardwise.op_registry_utils import _decorator_func

    table: dict[Any, Any] = {}
    with pytest.raises(TypeError, match=r"expects signature: \(types, args, kwargs, process_group\)"):
        _decorator_func(lambda types, args: None, torch.add, table)
    assert table == {}

    def impl(types: Any, args: Any, kwargs: Any, process_group: Any) -> str:
        return "called"

    wrapper = _decorator_func(impl, torch.add, table)
    assert table[torch.add] is wrapper and wrapper.__name__ == "impl"
    # The common checks run first: no ShardedTensor among the arguments.
    with pytest.raises(TypeError, match="called without any distributed tensor"):
        wrapper((), (torch.ones(1),), {}, None)
    with pytest.raises(ValueError, match="No input for 'add'"):
        wrapper((), (), {}, None)


def test_register_default_op_runs_torchs_own() -> None:
    from shardwise.common_op_utils import _register_default_op

    table: dict[Any, Any] = {}

    def decorator(op: Any) -> Any:
        def register(impl: Any) -> Any:
            table[op] = impl
            return impl

        return register

    _register_default_op(torch.Tensor.size, decorator)
    assert table[torch.Tensor.size]((), (torch.ones(2, 3),), None) == torch.Size([2, 3])
    assert table[torch.Tensor.size]((), (torch.ones(2, 3),), {"dim": 1}) == 3


# -- on 2 ranks ------------------------------------------------------------------------


def _dense(rows: int, cols: int) -> torch.Tensor:
    return torch.arange(rows * cols, dtype=torch.float64).reshape(rows, cols)


def _torch_group() -> Any:
    return torch.distributed.group.WORLD if torch.distributed.is_initialized() else None


def _shard_tensor_and_hooks() -> int:
    from shardwise.api import _get_current_process_group, _shard_tensor, load_with_process_group

    g = shardwise.get_default_group()
    w, r = g.size, g.rank
    done = 0
    dense = _dense(7, 4)
    for dim, order in ((0, list(range(w))), (1, list(range(w))[::-1])):
        st = _shard_tensor(dense, ChunkShardingSpec(dim, _placements(order)), src_rank=w - 1, process_group=None)
        (shard,) = st.local_shards()
        assert torch.equal(shard.tensor, narrow_tensor(dense, shard.metadata))
        tg = _torch_group()
        if tg is not None:
            from torch.distributed._shard.api import _shard_tensor as torch_shard_tensor

            theirs = torch_shard_tensor(dense, TorchChunk(dim, _placements(order)), src_rank=w - 1, process_group=tg)
            (their_shard,) = theirs.local_shards()
            assert torch.equal(shard.tensor, their_shard.tensor)
            assert shard.metadata.shard_offsets == their_shard.metadata.shard_offsets
            done += 1
        done += 1
    assert _get_current_process_group() is g
    with load_with_process_group(g):
        assert _get_current_process_group() is g
    assert r in range(w)
    return done


def _reshard_helpers() -> int:
    """torch's reshard helpers: the chunks each rank gets equal the dense tensor's and torch's own."""
    g = shardwise.get_default_group()
    w, r = g.size, g.rank
    done = 0
    dense = _dense(5, 6).requires_grad_(True)
    order, reordered = list(range(w)), list(range(w))[::-1]
    for dim in (0, 1):
        old = ChunkShardingSpec(dim, _placements(order))
        mine = old.build_metadata(dense.shape, TensorProperties()).shards_metadata[r]
        local = narrow_tensor(dense, mine)
        # Same dim, other order: reshuffle.
        new = ChunkShardingSpec(dim, _placements(reordered))
        (shard,), metas = sw_reshard.reshuffle_local_shard(local, dense.shape, old, new, None)
        assert torch.equal(shard.tensor, narrow_tensor(dense, shard.metadata))
        assert [m.placement.rank() for m in metas] == list(range(w))
        # Another dim: reshard; gradients flow back to this rank's chunk of the input.
        other = ChunkShardingSpec(1 - dim, _placements(reordered))
        (moved,), _ = sw_reshard.reshard_local_shard(local, dense.shape, old, other, g)
        assert torch.equal(moved.tensor, narrow_tensor(dense, moved.metadata))
        moved.tensor.sum().backward()
        assert torch.equal(
            dense.grad[tuple(slice(o, o + n) for o, n in zip(mine.shard_offsets, mine.shard_sizes, strict=True))],
            torch.ones(mine.shard_sizes, dtype=dense.dtype),
        )
        dense.grad = None
        tg = _torch_group()
        if tg is not None:
            (theirs,), _ = torch_reshard.reshuffle_local_shard(
                local.detach(),
                dense.shape,
                TorchChunk(dim, _placements(order)),
                TorchChunk(dim, _placements(reordered)),
                tg,
            )
            assert torch.equal(shard.tensor.detach(), theirs.tensor)
            done += 1
        done += 1
    return done


def _metadata_from_local_shards() -> int:
    from shardwise.sharded_tensor import Shard

    g = shardwise.get_default_group()
    r = g.rank
    shard = Shard(torch.ones(2, 3), ShardMetadata([2 * r, 0], [2, 3], f"rank:{r}/cpu"))
    md = sw_utils.build_metadata_from_local_shards([shard], torch.Size([2 * g.size, 3]), r, None)
    assert md.shards_metadata == [shard.metadata] and md.tensor_properties.dtype == torch.float32
    errors = []
    for shards, rank in (
        ([shard], r + 1),
        ([Shard(torch.ones(2, 3), ShardMetadata([0, 0], [2, 3], f"rank:{g.size + 3}/cpu"))], r),
        ([shard, Shard(torch.ones(2, 3, dtype=torch.float64), ShardMetadata([0, 0], [2, 3], f"rank:{r}/cpu"))], r),
    ):
        with pytest.raises(ValueError) as info:
            sw_utils.build_metadata_from_local_shards(shards, torch.Size([2 * g.size, 3]), rank, g)
        errors.append(str(info.value))
    assert "does not match with the rank in its process group" in errors[0]
    assert "does not exist in input process group" in errors[1]
    assert "dtype property need to be the same" in errors[2]
    assert sw_utils._parse_and_validate_remote_device(g, ShardMetadata([0], [1], f"rank:{r}/cpu").placement) == (
        r,
        torch.device("cpu"),
    )
    with pytest.raises(ValueError, match="remote device is None"):
        sw_utils._parse_and_validate_remote_device(None, ShardMetadata([0], [1]).placement)
    with pytest.raises(ValueError, match=r"Global rank 7 does not exist in input process group: \[0, 1\]"):
        sw_utils._parse_and_validate_remote_device(g, "rank:7/cpu")
    with pytest.raises(AssertionError, match="must have local shards"):
        sw_utils.build_metadata_from_local_shards([], torch.Size([2, 3]), r, g)
    gathered = [
        ShardedTensorMetadata([ShardMetadata([2 * q, 0], [2, 3], f"rank:{q}/cpu")], md.size, md.tensor_properties)
        for q in range(g.size)
    ]
    whole = sw_utils.build_global_metadata(gathered)
    assert [m.rank for m in whole.shards_metadata] == list(range(g.size))
    return 1


def _op_faces() -> int:
    """sharded_tensor.equal/allclose/uniform_ ..., _common._register_sharded_op_on_local_tensor, the embedding ops."""
    import shardwise.sharded_tensor as st_mod
    from shardwise._tensor import custom_ops as _custom_ops
    from shardwise.common_op_utils import _basic_validation
    from shardwise.sharding_spec.chunk_sharding_spec_ops._common import _register_sharded_op_on_local_tensor

    g = shardwise.get_default_group()
    w = g.size
    spec = ChunkShardingSpec(0, _placements(list(range(w))))
    dense = _dense(2 * w, 3).float()
    a = shardwise.shard_tensor(dense, spec)
    b = shardwise.shard_tensor(dense, spec)
    c = shardwise.shard_tensor(dense + 1, spec)
    assert st_mod.equal((), (a, b), {}, g) is True and st_mod.equal((), (a, c), None, g) is False
    assert st_mod.allclose((), (a, c), {"atol": 2.0}, g) is True
    st_mod.constant_((), (), {"tensor": a, "val": 5.0})
    assert torch.equal(a.local_tensor(), torch.full_like(a.local_tensor(), 5.0))
    st_mod.uniform_((), (), {"tensor": c, "a": 2.0, "b": 3.0})
    assert bool(((c.local_tensor() >= 2.0) & (c.local_tensor() < 3.0)).all())
    _basic_validation(torch.add, (a, b))
    other = shardwise.shard_tensor(dense, spec, process_group=g.new_group(list(range(w))))
    with pytest.raises(RuntimeError, match="same ProcessGroup"):
        _basic_validation(torch.add, (a, [other]))
    # The registered op runs on the local tensor (torch.Tensor.t is not otherwise registered for sharded tensors).
    calls = []

    def check(*args: Any, **kwargs: Any) -> None:
        calls.append(len(args))

    try:
        _register_sharded_op_on_local_tensor(torch.Tensor.neg_, extra_check=check)
        out = b.neg_()
        assert torch.equal(out.local_tensor(), -narrow_tensor(dense, b.local_shards()[0].metadata)) and calls == [1]
    finally:
        _custom_ops._remove(torch.Tensor.neg_, ChunkShardingSpec)
    done = 1
    if HAS_PLUGIN:
        import torch.nn.functional as F

        from shardwise.sharding_spec.chunk_sharding_spec_ops.embedding import sharded_embedding
        from shardwise.sharding_spec.chunk_sharding_spec_ops.embedding_bag import sharded_embedding_bag

        weight = shardwise.shard_tensor(dense, spec)
        ids = (torch.tensor([[0, 2 * w - 1], [1, 1]]) + g.rank) % (2 * w)
        assert torch.equal(sharded_embedding((), (ids, weight), {}, None), F.embedding(ids, dense))
        assert torch.equal(st_mod.sharded_embedding((), (ids,), {"weight": weight}, g), F.embedding(ids, dense))
        bags = sharded_embedding_bag(
            (), (ids.flatten(), weight), {"offsets": torch.tensor([0, 1]), "mode": "sum"}, None
        )
        assert torch.allclose(bags, F.embedding_bag(ids.flatten(), dense, torch.tensor([0, 1]), mode="sum"))
        done += 1
    return done


def ranks_battery() -> list[int]:
    return [_shard_tensor_and_hooks(), _reshard_helpers(), _metadata_from_local_shards(), _op_faces()]


def test_helpers_on_two_ranks() -> None:
    compared = 2 if HAS_TORCH_PG else 0
    expected = [2 + compared, 2 + compared, 1, 1 + int(HAS_PLUGIN)]
    assert _run(ranks_battery, 2) == [expected, expected]


def _cycles_and_subgroups() -> int:
    """Placement orders that are not their own inverse, and a subgroup whose placements name global ranks."""
    g = shardwise.get_default_group()
    w, r = g.size, g.rank
    dense = _dense(6, 7)
    done = 0
    order, rotated = list(range(w)), list(range(1, w)) + [0]
    for dim in (0, 1):
        old = ChunkShardingSpec(dim, _placements(rotated))
        local = narrow_tensor(
            dense, old.build_metadata(dense.shape, TensorProperties()).shards_metadata[rotated.index(r)]
        )
        # torch 2.13 receives from the rank it sends to, right only for swaps; a rotation needs the true source.
        (shard,), _ = sw_reshard.reshuffle_local_shard(
            local, dense.shape, old, ChunkShardingSpec(dim, _placements(order)), g
        )
        assert torch.equal(shard.tensor, narrow_tensor(dense, shard.metadata))
        (moved,), _ = sw_reshard.reshard_local_shard(
            local, dense.shape, old, ChunkShardingSpec(1 - dim, _placements(rotated[::-1])), g
        )
        assert torch.equal(moved.tensor, narrow_tensor(dense, moved.metadata))
        done += 2
    sub = g.new_group([1, 2])
    if sub is not None:
        # Placements name global ranks 1 and 2; this group numbers them 0 and 1.
        spec, other = ChunkShardingSpec(0, _placements([1, 2])), ChunkShardingSpec(1, _placements([2, 1]))
        local = narrow_tensor(dense, spec.build_metadata(dense.shape, TensorProperties()).shards_metadata[r - 1])
        (moved,), metas = sw_reshard.reshard_local_shard(local, dense.shape, spec, other, sub)
        assert torch.equal(moved.tensor, narrow_tensor(dense, moved.metadata)) and moved.metadata.rank == r
        assert [m.rank for m in metas] == [1, 2]
        done += 1
    return done


def test_reshard_helpers_on_three_ranks() -> None:
    assert _run(_cycles_and_subgroups, 3) == [4, 5, 5]
