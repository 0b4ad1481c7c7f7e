"""``shard_tensor`` / ``ShardingSpec.shard`` on real ranks, against dense slices and torch 2.13."""

from __future__ import annotations

import itertools

import pytest
import torch

import shardwise
from shardwise._tensor.scatter import shard_tensor
from shardwise.sharded_tensor import ShardMetadata, ShardedTensor, TensorProperties
from shardwise.sharding_spec import ChunkShardingSpec, EnumerableShardingSpec, ShardingSpec, chunk_sizes

from rank_helpers import HAS_TORCH_PG, check_errors
from rank_helpers import box as _box
from rank_helpers import outcome as _outcome
from rank_helpers import run as _run


def _dense(size: list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    values = torch.arange(1, 1 + torch.Size(size).numel(), dtype=torch.float64).reshape(size)
    if dtype == torch.bool:
        return values.remainder(3) == 0
    if dtype.is_complex:
        return torch.complex(values, values / 2).to(dtype)
    return values.to(dtype)


def _place(ranks: list[int]) -> list[str]:
    return [f"rank:{r}/cpu" for r in ranks]


def specs(size: list[int], w: int) -> dict[str, ShardingSpec]:
    """Chunk specs on each dim (rank order, permuted, repeated with empty shards) and Enumerable grids."""
    ranks = list(range(w))
    rotated = ranks[1:] + ranks[:1]
    rows, cols = size
    grid = [
        ShardMetadata([i0, j0], [i1 - i0, j1 - j0], f"rank:{(k * 2 + 1) % w}/cpu")
        for k, ((i0, i1), (j0, j1)) in enumerate(itertools.product([(0, 2), (2, rows)], [(0, 1), (1, 3), (3, cols)]))
    ]
    return {
        "chunk0": ChunkShardingSpec(0, _place(ranks)),
        "chunk0_permuted": ChunkShardingSpec(0, _place(rotated)),
        "chunk1_reversed": ChunkShardingSpec(1, _place(ranks[::-1])),
        "chunk_neg_repeated": ChunkShardingSpec(-1, _place([*ranks, 0, w - 1, 0])),
        "grid": EnumerableShardingSpec(grid),
        "grid_with_empty": EnumerableShardingSpec([*grid, ShardMetadata([0, 0], [0, 0], f"rank:{w - 1}/cpu")]),
        "one_rank": EnumerableShardingSpec([ShardMetadata([0, 0], size, f"rank:{w - 1}/cpu")]),
    }


def check(
    st: ShardedTensor, dense: torch.Tensor, spec: ShardingSpec, requires_grad: bool, source: torch.Tensor
) -> None:
    g = shardwise.get_default_group()
    md = spec.build_metadata(dense.shape, TensorProperties(dtype=dense.dtype))
    assert isinstance(st, ShardedTensor) and st.sharding_spec() == spec and st.size() == dense.shape
    assert st.metadata().shards_metadata == md.shards_metadata
    tp = st.metadata().tensor_properties
    assert tp.dtype == dense.dtype and tp.requires_grad == requires_grad and st.requires_grad == requires_grad
    mine = [s for s in md.shards_metadata if s.rank == g.rank]
    assert [s.metadata for s in st.local_shards()] == mine
    for shard in st.local_shards():
        t = shard.tensor
        assert t.is_leaf and t.requires_grad == requires_grad and t.is_contiguous() and t.dtype == dense.dtype
        assert torch.equal(t.detach(), _box(dense, shard.metadata)), (spec, shard.metadata, t)
        # A new tensor, never a view of the caller's.
        if t.numel() and source.numel():
            assert t.untyped_storage().data_ptr() != source.untyped_storage().data_ptr()


def battery() -> int:
    g = shardwise.get_default_group()
    w, r = g.size, g.rank
    done = 0
    size = [7, 5]
    dense = _dense(size)
    for src, grad in ((0, True), (w - 1, False)):
        for name, spec in specs(size, w).items():
            # Only src's tensor is read: the others pass a placeholder (or garbage of the right size).
            mine = dense.clone().requires_grad_(grad) if r == src else (torch.empty(0) if name != "grid" else -dense)
            st = shard_tensor(mine, spec, src_rank=src)
            check(st, dense, spec, grad, mine)
            st = spec.shard(mine, src_rank=src, process_group=g)
            check(st, dense, spec, grad, mine)
            done += 2
    for dtype in (torch.bool, torch.complex128, torch.bfloat16, torch.int8, torch.uint16, torch.float64):
        typed = _dense(size, dtype)
        for spec in (specs(size, w)["chunk1_reversed"], specs(size, w)["grid"]):
            check(shard_tensor(typed, spec, src_rank=w - 1), typed, spec, False, typed)
            done += 1
    # A 0-d tensor (Enumerable, one shard) and a tensor with no elements.
    scalar = torch.tensor(2.5)
    spec0 = EnumerableShardingSpec([ShardMetadata([], [], f"rank:{w - 1}/cpu")])
    check(shard_tensor(scalar, spec0, 0), scalar, spec0, False, scalar)
    empty = torch.zeros(0, 4)
    spec_e = ChunkShardingSpec(0, _place(list(range(w))))
    check(shard_tensor(empty, spec_e), empty, spec_e, False, empty)
    # The default process group, and a torch ProcessGroup.
    st = shard_tensor(dense, spec_e, process_group=torch.distributed.group.WORLD)
    check(st, dense, spec_e, False, dense)
    return done + 3 + compare_with_torch()


def torch_cases(w: int) -> list[tuple[list[int], int, list[int]]]:
    """(size, dim, placement order) cases torch 2.13 gets right: no empty shard (torch narrows past the end)."""
    ranks = list(range(w))
    cases = itertools.product([[7, 5], [8, 7]], [0, 1, -1], [ranks, ranks[1:] + ranks[:1], ranks[::-1]])
    return [(size, dim, order) for size, dim, order in cases if 0 not in chunk_sizes(size[dim], w)]


def compare_with_torch() -> int:
    """torch 2.13's _shard_tensor on the same input, where it works (chunk specs, one shard per rank)."""
    from torch.distributed._shard.api import _shard_tensor as torch_shard
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec as TorchChunk

    if not torch.distributed.is_initialized():
        return 0  # torch's _shard needs a torch process group; the mpi backend has none
    w = shardwise.get_default_group().size
    compared = 0
    for size, dim, order in torch_cases(w):
        dense = _dense(size, torch.float64).requires_grad_(dim == 1)
        theirs = torch_shard(dense, TorchChunk(dim, _place(order)), src_rank=w - 1)
        ours = shard_tensor(dense, ChunkShardingSpec(dim, _place(order)), src_rank=w - 1)
        (a,), (b,) = ours.local_shards(), theirs.local_shards()
        assert torch.equal(a.tensor.detach(), b.tensor.detach()) and a.tensor.requires_grad == b.tensor.requires_grad
        assert a.metadata.shard_offsets == b.metadata.shard_offsets and a.metadata.shard_sizes == b.metadata.shard_sizes
        assert [str(m.placement) for m in ours.metadata().shards_metadata] == [
            str(m.placement) for m in theirs.metadata().shards_metadata
        ]
        compared += 1
    return compared


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_shard_tensor_every_spec(world_size: int) -> None:
    compared = len(torch_cases(world_size)) if HAS_TORCH_PG else 0
    assert compared >= 9 or not HAS_TORCH_PG
    assert _run(battery, world_size) == [2 * 2 * 7 + 6 * 2 + 3 + compared] * world_size


def bad_inputs() -> dict[str, tuple[str, str]]:
    g = shardwise.get_default_group()
    w, r = g.size, g.rank
    dense = _dense([7, 5])
    spec = ChunkShardingSpec(0, _place(list(range(w))))
    other = ChunkShardingSpec(1, _place(list(range(w))))
    sharded = shard_tensor(dense, spec)
    seen = {
        "spec_mismatch": _outcome(lambda: shard_tensor(dense, other if r == 2 else spec)),
        "src_mismatch": _outcome(lambda: shard_tensor(dense, spec, src_rank=1 if r == 1 else 0)),
        "non_contiguous_src": _outcome(lambda: shard_tensor(dense.t() if r == 1 else dense, spec, src_rank=1)),
        "src_outside": _outcome(lambda: shard_tensor(dense, spec, src_rank=w)),
        "other_size": _outcome(
            lambda: shard_tensor(dense, EnumerableShardingSpec([ShardMetadata([0, 0], [8, 5], "rank:0/cpu")]))
        ),
        "chunk_0d": _outcome(lambda: shard_tensor(torch.tensor(1.0), spec)),
        "outside_group": _outcome(lambda: shard_tensor(dense, ChunkShardingSpec(0, _place([0, 7])))),
        "not_a_tensor": _outcome(lambda: shard_tensor([1.0] if r == 0 else dense, spec)),  # type: ignore[arg-type]
        "sharded_input": _outcome(lambda: shard_tensor(sharded if r == 2 else dense, spec)),
        "not_a_spec": _outcome(lambda: shard_tensor(dense, "rank:0/cpu" if r == 1 else spec)),  # type: ignore[arg-type]
    }
    # The group is still in step.
    check(shard_tensor(dense, other, src_rank=2), dense, other, False, dense)
    return seen


# On every rank: (error type, fragment).
EXPECTED_ALL = {
    "spec_mismatch": ("ValueError", "ranks disagree on the sharding spec: rank 0 passed ChunkShardingSpec(dim=0"),
    "src_mismatch": ("ValueError", "ranks disagree on the src_rank: rank 0 passed 0, rank 1 passed 1"),
    "src_outside": ("ValueError", "src_rank=3 is not a rank of the group (size 3, ranks 0..2)"),
    "other_size": ("ValueError", "cannot shard a tensor of size [7, 5] with EnumerableShardingSpec"),
    "chunk_0d": ("ValueError", "cannot shard a tensor of size [] with ChunkShardingSpec(dim=0"),
    "outside_group": ("ValueError", "is placed on rank 7, but the group has 3 rank(s)"),
}
# (culprit, error type, fragment); the other ranks raise PeerError naming the culprit.
EXPECTED_ONE = {
    "non_contiguous_src": (1, "ValueError", "input tensor on rank 1 is not a contiguous Tensor"),
    "not_a_tensor": (0, "TypeError", "shard_tensor takes a plain torch.Tensor, got list"),
    "sharded_input": (2, "TypeError", "got a ShardedTensor (use reshard to change its spec)"),
    "not_a_spec": (1, "TypeError", "sharding_spec must be a ShardingSpec, got str"),
}


def test_bad_input_raises_on_every_rank() -> None:
    results = _run(bad_inputs, 3)
    check_errors(results, EXPECTED_ALL, EXPECTED_ONE)
    for seen in results:
        assert "runs alone" not in seen["outside_group"][1]  # three ranks: the placement is simply wrong
        assert "rank 2 passed ChunkShardingSpec(dim=1" in seen["spec_mismatch"][1]
        assert "ends at 8 in dim 0, outside the tensor of size [7, 5]" in seen["other_size"][1]


def placed_on_a_second_rank() -> dict[str, tuple[str, str]]:
    group = shardwise.get_default_group()
    two = ChunkShardingSpec(0, _place([0, 1]))
    seen = {"alone": _outcome(lambda: shard_tensor(torch.zeros(4, 2), two))}
    sub = group.new_group([0])
    if sub is not None:  # a subgroup of one inside a larger job: no launcher is missing
        seen["subgroup"] = _outcome(lambda: shard_tensor(torch.zeros(4, 2), two, process_group=sub))
    return seen


def test_a_program_for_more_ranks_run_alone_is_told_to_use_a_launcher() -> None:
    (alone,) = _run(placed_on_a_second_rank, 1)
    kind, message = alone["alone"]
    assert kind == "ValueError" and "this process runs alone (rank 0 of 1)" in message, message
    assert "torchrun --nproc-per-node N" in message and "mpiexec -n N" in message, message
    assert message.endswith("Global rank 1 does not exist in input process group: [0]"), message  # torch's words
    first, _ = _run(placed_on_a_second_rank, 2)
    assert first["subgroup"][0] == "ValueError" and "runs alone" not in first["subgroup"][1], first
