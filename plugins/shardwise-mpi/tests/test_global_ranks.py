"""MPI groups know their members' global ranks (ranks in ``MPI.COMM_WORLD``), which placements name.

Run under a real ``mpiexec`` on 3 ranks: a sub-group of ranks 1 and 2, and
one whose communicator numbers them the other way round (group rank 0 is
world rank 2), each hold a ShardedTensor placed by world ranks; the shards
land on those world ranks and the data moves right.
"""

from __future__ import annotations

from typing import Any

import torch
from mpi_launch import needs_mpiexec

import shardwise
from shardwise import sharded_tensor
from shardwise.sharding_spec import ChunkShardingSpec
from shardwise.testing import run_ranks

pytestmark = needs_mpiexec


def _subgroups() -> dict[str, Any]:
    from shardwise_mpi._group import MpiGroup

    world = shardwise.get_default_group()
    sub = world.new_group([1, 2])
    out: dict[str, Any] = {"world": (list(world.ranks), world.global_rank)}
    if sub is None:
        return out
    backwards = MpiGroup(sub.comm.Split(0, -sub.rank))
    full = torch.arange(12.0).view(4, 3)
    for name, group in (("sub", sub), ("backwards", backwards)):
        st = shardwise.shard_tensor(full, ChunkShardingSpec(0, ["rank:2/cpu", "rank:1/cpu"]), 0, group)
        rows = [s.metadata.shard_offsets[0] for s in st.local_shards()]
        values = all(torch.equal(s.tensor, full[s.metadata.shard_offsets[0]:][:2]) for s in st.local_shards())
        st.reshard(ChunkShardingSpec(1, ["rank:1/cpu", "rank:2/cpu"]))
        ones = sharded_tensor.ones(ChunkShardingSpec(0, ["rank:1/cpu", "rank:2/cpu"]), 4, 3, process_group=group)
        out[name] = {
            "ranks": (list(group.ranks), group.global_rank, group.rank),
            "rows": rows,
            "values": values,
            "full": torch.equal(st.full_tensor(), full),
            "cols": [s.metadata.shard_offsets[1] for s in st.local_shards()],
            "ones": [s.metadata.shard_offsets[0] for s in ones.local_shards()],
        }
    backwards.destroy()
    return out


def test_mpi_groups_translate_placements_to_world_ranks() -> None:
    results = run_ranks(_subgroups, 3, backend="mpi", launcher="mpiexec", timeout=120)
    for me, seen in enumerate(results):
        assert seen["world"] == ([0, 1, 2], me)
        if me == 0:
            assert set(seen) == {"world"}
            continue
        assert seen["sub"]["ranks"] == ([1, 2], me, me - 1)
        assert seen["backwards"]["ranks"] == ([2, 1], me, 2 - me)
        for name in ("sub", "backwards"):
            case = seen[name]
            assert case["rows"] == ([0] if me == 2 else [2]), (me, name)
            assert case["values"] and case["full"], (me, name)
            assert case["cols"] == ([0] if me == 1 else [2]), (me, name)
            assert case["ones"] == ([0] if me == 1 else [2]), (me, name)
