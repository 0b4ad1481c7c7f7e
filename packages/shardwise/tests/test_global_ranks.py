"""Placement ranks are global ranks, and ranks outside a subgroup may make the same calls (torch 2.13's meaning).

With ``pg = new_group([1, 2])`` on 3 ranks, ``rank:1``/``rank:2`` put shards
on global ranks 1 and 2 (torch's reading), a placement on global rank 0 is
refused on the members with torch's wording, and rank 0 — which gets
``GroupMember.NON_GROUP_MEMBER`` from ``new_group`` — may make the same
calls and gets tensors with no local shards and the global metadata. The
results are compared with torch's own ``_shard`` run in the same ranks on
the same group where torch gets them right.
"""

from __future__ import annotations

import io
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardwise
from shardwise import checkpoint, sharded_tensor
from shardwise.sharded_tensor import Shard, ShardMetadata
from shardwise.sharding_spec import ChunkShardingSpec
from shardwise.testing import current_rank_dir
from shardwise.torch_group import wrap_process_group

from rank_helpers import HAS_TORCH_PG, outcome, run

pytestmark = pytest.mark.skipif(not HAS_TORCH_PG, reason="needs torch process groups (new_group) next to the backend")

FULL = torch.arange(24.0).view(4, 6)


def _desc(st: Any) -> dict[str, Any]:
    return {
        "local": [(s.metadata.shard_offsets, s.metadata.shard_sizes, str(s.metadata.placement)) for s in st.local_shards()],
        "metadata": [(m.shard_offsets, m.shard_sizes, str(m.placement)) for m in st.metadata().shards_metadata],
        "size": list(st.size()),
    }


def _values(st: Any) -> list[tuple[list[int], bool]]:
    """Each local shard's offsets and whether it holds FULL's values there."""
    out = []
    for s in st.local_shards():
        o, n = s.metadata.shard_offsets, s.metadata.shard_sizes
        out.append((o, torch.equal(s.tensor, FULL[o[0] : o[0] + n[0], o[1] : o[1] + n[1]])))
    return out


def _try(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - the test compares every rank's outcome
        return (type(exc).__name__, str(exc))


def _subgroup_calls() -> dict[str, Any]:
    import torch.distributed._shard.sharded_tensor as torch_st
    from torch.distributed._shard import _shard_tensor as torch_shard_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec as TorchSpec

    warnings.simplefilter("ignore")  # torch's deprecation warnings
    me = dist.get_rank()
    pg = dist.new_group([1, 2])
    member = me in (1, 2)
    out: dict[str, Any] = {}
    if member:
        group = wrap_process_group(pg)
        out["group"] = (list(group.ranks), group.global_rank, group.rank, outcome(lambda: group.group_rank(0)))
    sub = shardwise.get_default_group().new_group([1, 2])
    out["new_group"] = None if sub is None else (list(sub.ranks), sub.global_rank)

    spec = ChunkShardingSpec(0, ["rank:1/cpu", "rank:2/cpu"])
    ones = sharded_tensor.ones(spec, 4, 6, process_group=pg)
    out["ones"] = _desc(ones)
    saved = io.BytesIO()
    torch.save(ones, saved)
    saved.seek(0)
    with shardwise.load_with_process_group(pg):
        out["loaded"] = _desc(torch.load(saved))
    rebuilt = sharded_tensor.ShardedTensor._init_from_local_shards_and_global_metadata(
        ones.local_shards(), ones.metadata(), process_group=pg
    )
    out["from_global"] = _desc(rebuilt)
    out["torch_ones"] = _desc(torch_st.ones(TorchSpec(0, ["rank:1/cpu", "rank:2/cpu"]), 4, 6, process_group=pg))
    out["outside"] = outcome(lambda: sharded_tensor.empty(ChunkShardingSpec(0, ["rank:0/cpu", "rank:2/cpu"]), 4, 6,
                                                          process_group=pg))
    out["torch_outside"] = outcome(lambda: torch_st.empty(TorchSpec(0, ["rank:0/cpu", "rank:2/cpu"]), 4, 6,
                                                          process_group=pg))

    # src_rank is a rank of the group (0: global rank 1), as in torch.
    reversed_spec = ChunkShardingSpec(0, ["rank:2/cpu", "rank:1/cpu"])
    st = shardwise.shard_tensor(FULL.clone(), reversed_spec, src_rank=0, process_group=pg)
    out["shard_tensor"] = (_desc(st), _values(st))
    if member:
        theirs = torch_shard_tensor(FULL.clone(), TorchSpec(0, ["rank:2/cpu", "rank:1/cpu"]), 0, pg)
        out["torch_shard_tensor"] = (_desc(theirs), _values(theirs))

    def local_shards() -> Any:
        shards = []
        if member:
            rows = 2 * (me - 1)
            shards = [Shard(FULL[rows : rows + 2].clone(), ShardMetadata([rows, 0], [2, 6], f"rank:{me}/cpu"))]
        return shards

    out["from_shards"] = _try(lambda: _desc(sharded_tensor.init_from_local_shards(local_shards(), 4, 6,
                                                                                  process_group=pg)))
    from torch.distributed._shard.metadata import ShardMetadata as TorchShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard as TorchShard

    torch_local = [TorchShard(s.tensor, TorchShardMetadata(s.metadata.shard_offsets, s.metadata.shard_sizes,
                                                           str(s.metadata.placement))) for s in local_shards()]
    out["torch_from_shards"] = _try(lambda: _desc(torch_st.init_from_local_shards(torch_local, 4, 6,
                                                                                  process_group=pg)))

    # dst is a rank of the group (1: global rank 2).
    gathered = torch.zeros(4, 6) if me == 2 else None
    st.gather(dst=1, out=gathered)
    out["gather"] = None if gathered is None else torch.equal(gathered, FULL)
    out["full_tensor"] = _try(lambda: torch.equal(st.full_tensor(), FULL))

    st.reshard(ChunkShardingSpec(1, ["rank:2/cpu", "rank:1/cpu"]))
    out["reshard"] = (_desc(st), _values(st))
    if member:
        # A checkpoint of the subgroup's tensor loads into another layout on the same subgroup.
        path = str(current_rank_dir() / "checkpoint")
        checkpoint.save({"w": st}, path, process_group=pg)
        loaded = sharded_tensor.zeros(spec, 4, 6, process_group=pg)
        checkpoint.load({"w": loaded}, path, process_group=pg)
        out["checkpoint"] = (_desc(loaded), _values(loaded))

    model = nn.Linear(6, 4, bias=False)
    with torch.no_grad():
        model.weight.copy_(FULL)
    shardwise.shard_parameter(model, "weight", spec, process_group=pg)
    out["shard_parameter"] = (_desc(model.weight), _values(model.weight))
    return out


def test_placements_name_global_ranks_and_non_members_get_no_shards() -> None:
    results = run(_subgroup_calls, 3)
    halves = [([0, 0], [2, 6], "rank:1/cpu"), ([2, 0], [2, 6], "rank:2/cpu")]
    for me, seen in enumerate(results):
        member = me in (1, 2)
        mine = [halves[me - 1]] if member else []
        if member:
            ranks, global_rank, group_rank, not_member = seen["group"]
            assert (ranks, global_rank, group_rank) == ([1, 2], me, me - 1)
            assert not_member[0] == "ValueError"
            assert "Global rank 0 does not exist in input process group: [1, 2]" in not_member[1]
            assert seen["new_group"] == ([1, 2], me)
        else:
            assert seen["new_group"] is None
        # Creation: shards on global ranks 1 and 2; rank 0 holds none but knows the layout, as in torch.
        assert seen["ones"] == {"local": mine, "metadata": halves, "size": [4, 6]}, me
        assert seen["torch_ones"] == seen["ones"] == seen["loaded"] == seen["from_global"], me
        # A placement outside the group: refused on the members with torch's wording.
        if member:
            assert seen["outside"][0] == seen["torch_outside"][0] == "ValueError", me
            assert seen["torch_outside"][1] in seen["outside"][1], me
        else:
            assert seen["outside"] == ("ok", "")
        # shard_tensor from group rank 0 (global 1) by placements [2, 1].
        swapped = [([0, 0], [2, 6], "rank:2/cpu"), ([2, 0], [2, 6], "rank:1/cpu")]
        desc, values = seen["shard_tensor"]
        assert desc["metadata"] == swapped and desc["local"] == [s for s in swapped if s[2] == f"rank:{me}/cpu"]
        assert all(ok for _, ok in values), me
        if member:
            assert seen["torch_shard_tensor"] == seen["shard_tensor"], me
        # init_from_local_shards: the members build the tensor; the rank outside cannot (torch: the same error).
        if member:
            assert seen["from_shards"] == {"local": mine, "metadata": halves, "size": [4, 6]}, me
            assert seen["torch_from_shards"] == seen["from_shards"], me
        else:
            assert seen["from_shards"][0] == seen["torch_from_shards"][0] == "ValueError"
            assert seen["torch_from_shards"][1] in seen["from_shards"][1]
        assert seen["gather"] == (True if me == 2 else None)
        if member:
            assert seen["full_tensor"] is True
        else:
            assert seen["full_tensor"][0] == "ValueError" and "outside the tensor's process group" in seen["full_tensor"][1]
        # reshard: columns [0:3) to global rank 2, [3:6) to global rank 1; metadata in rank order, as torch lists it.
        desc, values = seen["reshard"]
        assert desc["metadata"] == [([0, 3], [4, 3], "rank:1/cpu"), ([0, 0], [4, 3], "rank:2/cpu")], me
        assert [v[0] for v in values] == ([[0, 3]] if me == 1 else [[0, 0]] if me == 2 else [])
        assert all(ok for _, ok in values)
        if member:
            desc, values = seen["checkpoint"]
            assert desc["local"] == mine and all(ok for _, ok in values), me
        desc, values = seen["shard_parameter"]
        assert desc == {"local": mine, "metadata": halves, "size": [4, 6]} and all(ok for _, ok in values), me


def _reshard_order(size: list[int], old: list[int], dim: int, new: list[int]) -> dict[str, Any]:
    from torch.distributed._shard.sharded_tensor.reshard import build_reshard_metadata
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec as TorchSpec

    full = torch.arange(float(size[0] * size[1])).view(size)
    st = shardwise.shard_tensor(full, ChunkShardingSpec(0, [f"rank:{r}/cpu" for r in old]))
    target = [f"rank:{r}/cpu" for r in new]
    st.reshard(ChunkShardingSpec(dim, target))
    theirs, _ = build_reshard_metadata(torch.Size(size), TorchSpec(dim, list(target)), dist.get_world_size())
    ok = all(torch.equal(s.tensor, full[tuple(slice(o, o + n) for o, n in zip(s.metadata.shard_offsets,
                                                                                s.metadata.shard_sizes,
                                                                                strict=True))])
             for s in st.local_shards())
    return {
        "ours": [(m.shard_offsets, m.shard_sizes, str(m.placement)) for m in st.metadata().shards_metadata],
        "torch": [(m.shard_offsets, m.shard_sizes, str(m.placement)) for m in theirs],
        "values": ok,
    }


@pytest.mark.parametrize("dim", [0, 1])
def test_reshard_lists_shards_in_rank_order_as_torch(dim: int) -> None:
    for seen in run(_reshard_order, 3, [6, 6], [0, 1, 2], dim, [2, 0, 1]):
        assert seen["values"]
        assert seen["ours"] == seen["torch"]
        assert [p for *_, p in seen["ours"]] == ["rank:0/cpu", "rank:1/cpu", "rank:2/cpu"]


class _Solo(shardwise.Group):
    """A one-rank group whose backend knows nothing of global ranks unless told (``ranks=``)."""

    def __init__(self, ranks: Any = None) -> None:
        super().__init__(backend="solo", rank=0, size=1, device=torch.device("cpu"), ranks=ranks)

    def _barrier(self) -> None:
        pass

    def _broadcast(self, buf: torch.Tensor, src: int) -> None:
        pass

    def _all_reduce(self, buf: torch.Tensor, op: str) -> None:
        pass

    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor, counts: Any) -> None:
        out.copy_(inp)

    def _reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, counts: Any, op: str) -> None:
        out.copy_(inp)

    def _all_to_all(self, out: torch.Tensor, out_counts: Any, inp: torch.Tensor, in_counts: Any) -> None:
        out.copy_(inp)

    def _new_group(self, ranks: Any) -> shardwise.Group:
        return _Solo()


def test_groups_translate_between_global_and_group_ranks() -> None:
    world = _Solo()
    assert world.ranks == (0,) and world.global_rank == 0 and world.global_to_group() is None
    assert world.group_rank(0) == 0
    with pytest.raises(ValueError, match=r"Global rank 1 does not exist in input process group: \[0\]"):
        world.group_rank(1)
    sub = _Solo(ranks=[5])
    assert sub.ranks == (5,) and sub.global_rank == 5 and sub.global_to_group() == {5: 0} and sub.group_rank(5) == 0
    assert "ranks=[5]" in repr(sub)
    with pytest.raises(ValueError, match=r"global rank 0 is not a member of this group \(global ranks \[5\]"):
        sub.group_rank(0)
    # A backend that numbers a new group only within itself: its members' global ranks come from the parent.
    nested = sub.new_group([0])
    assert nested is not None and nested.ranks == (5,) and nested.global_rank == 5
    with pytest.raises(ValueError, match="distinct non-negative global ranks"):
        _Solo(ranks=[1, 2])


def test_resolve_group_takes_torchs_non_group_member() -> None:
    from shardwise import resolve_group

    group = resolve_group(dist.GroupMember.NON_GROUP_MEMBER)
    assert not group.is_member and group.rank == -1 and group.ranks == ()
    with pytest.raises(RuntimeError, match="not a member of the process group"):
        group.barrier()
    with pytest.raises(TypeError, match="NON_GROUP_MEMBER"):
        resolve_group(-7)
