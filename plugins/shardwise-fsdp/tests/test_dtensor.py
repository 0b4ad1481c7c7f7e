"""to_dtensor / from_dtensor on real gloo ranks: values, layouts, shared storage, round trips, bad input."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from shardwise_fsdp import from_dtensor, to_dtensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import shardwise
from shardwise import ChunkShardingSpec, EnumerableShardingSpec, ShardMetadata
from shardwise.testing import run_ranks


def _run(fn: Any, world: int, *args: Any) -> list[Any]:
    return run_ranks(fn, world, backend="gloo", args=args, timeout=120)


def _dense(rows: int, cols: int) -> torch.Tensor:
    return torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) / 7


def _outcome(fn: Any) -> tuple[str, str]:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the tests inspect every rank's error
        return type(exc).__name__, str(exc)
    return "ok", ""


def one_d_rank(rows: int, cols: int, dim: int) -> dict[str, Any]:
    size = shardwise.get_default_group().size
    mesh = init_device_mesh("cpu", (size,))
    full = _dense(rows, cols)
    dt = distribute_tensor(full, mesh, [Shard(dim)])
    st = from_dtensor(dt)
    local = st.local_shards()
    back = to_dtensor(st)
    return {
        "equal": torch.equal(st.full_tensor(), full),
        "spec": (type(st.sharding_spec()).__name__, st.sharding_spec().dim),
        "shared": [s.tensor.data_ptr() for s in local] == [dt.to_local().data_ptr()] if local else True,
        "back equal": torch.equal(back.full_tensor(), full) and back.placements == (Shard(dim),),
        "back shared": back.to_local().data_ptr() == dt.to_local().data_ptr() if dt.to_local().numel() else True,
    }


@pytest.mark.parametrize(("world", "rows", "cols", "dim"), [(2, 5, 3, 0), (3, 4, 7, 1), (4, 3, 2, 0), (2, 6, 4, 1)])
def test_one_d_shard_round_trips_without_copies(world: int, rows: int, cols: int, dim: int) -> None:
    for found in _run(one_d_rank, world, rows, cols, dim):
        assert found["spec"] == ("ChunkShardingSpec", dim)
        assert found["equal"] and found["shared"] and found["back equal"] and found["back shared"], found


def two_d_rank(placements: str) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2))
    full = _dense(5, 7)
    chosen = {"shard-shard": [Shard(0), Shard(1)], "shard-replicate": [Shard(1), Replicate()]}[placements]
    dt = distribute_tensor(full, mesh, chosen)
    st = from_dtensor(dt)
    boxes = sorted((m.shard_offsets, m.shard_sizes, m.rank) for m in st.metadata().shards_metadata)
    found: dict[str, Any] = {"equal": torch.equal(st.full_tensor(), full), "boxes": boxes,
                             "spec": type(st.sharding_spec()).__name__}
    local = st.local_shards()
    found["shared"] = all(s.tensor.data_ptr() == dt.to_local().data_ptr() for s in local)
    found["holds"] = len(local)
    if placements == "shard-shard":
        back = to_dtensor(st)
        found["back"] = (torch.equal(back.full_tensor(), full), back.placements == (Shard(0), Shard(1)),
                         back.device_mesh.mesh.tolist(), back.to_local().data_ptr() == dt.to_local().data_ptr())
    return found


def test_two_d_mesh_shards_become_a_grid_and_back() -> None:
    results = _run(two_d_rank, 4, "shard-shard")
    for found in results:
        assert found["equal"] and found["shared"] and found["spec"] == "EnumerableShardingSpec"
        assert found["boxes"] == [([0, 0], [3, 4], 0), ([0, 4], [3, 3], 1), ([3, 0], [2, 4], 2), ([3, 4], [2, 3], 3)]
        assert found["back"] == (True, True, [[0, 1], [2, 3]], True)


def test_replicated_mesh_dim_has_one_owner_per_box() -> None:
    results = _run(two_d_rank, 4, "shard-replicate")
    # Mesh [[0, 1], [2, 3]], Shard(1) on mesh dim 0: ranks 0/1 hold columns 0..3, ranks 2/3 columns 4..6;
    # the copies on mesh dim 1 (ranks 1 and 3) own nothing.
    for found in results:
        assert found["equal"] and found["boxes"] == [([0, 0], [5, 4], 0), ([0, 4], [5, 3], 2)]
    assert [f["holds"] for f in results] == [1, 0, 1, 0]


def permuted_rank(rows: int, order: str) -> dict[str, Any]:
    size = shardwise.get_default_group().size
    full = _dense(rows, 5)
    ranks = {"reversed": list(reversed(range(size))), "swapped": [1, 0, *range(2, size)],
             "ascending": list(range(size))}[order]
    st = shardwise.shard_tensor(full, ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in ranks]),
                                src_rank=0)
    kind, message = _outcome(lambda: to_dtensor(st))
    if kind != "ok":
        return {"error": (kind, message)}
    dt = to_dtensor(st)
    local = st.local_shards()[0].tensor
    again = from_dtensor(dt)
    return {
        "mesh": dt.device_mesh.mesh.tolist(),
        "equal": torch.equal(dt.full_tensor(), full),
        "shared": dt.to_local().data_ptr() == local.data_ptr() if local.numel() else True,
        "rows here": dt.to_local().shape[0],
        "again": torch.equal(again.full_tensor(), full) and again.sharding_spec() == st.sharding_spec(),
    }


def test_placements_out_of_rank_order_are_refused() -> None:
    """torch 2.13's DTensor reads such layouts inconsistently; refuse rather than corrupt."""
    for rows, order in ((4, "reversed"), (3, "reversed"), (5, "swapped")):
        for found in _run(permuted_rank, 4, rows, order):
            kind, message = found["error"]
            assert kind == "ValueError" and "ascending" in message and "process-group rank" in message


def test_uneven_chunks_with_an_empty_one() -> None:
    # 3 rows on 4 ranks: chunks of 1, 1, 1, 0.
    for rank, found in enumerate(_run(permuted_rank, 4, 3, "ascending")):
        assert found["mesh"] == [0, 1, 2, 3] and found["equal"] and found["shared"] and found["again"], found
        assert found["rows here"] == (0 if rank == 3 else 1)


def reversed_mesh_rank() -> tuple[str, str]:
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh("cpu", torch.tensor([1, 0]))
    dt = DTensor.from_local(torch.ones(2, 2), mesh, [Shard(0)], run_check=False)
    return _outcome(lambda: from_dtensor(dt))


def test_from_dtensor_refuses_a_mesh_out_of_rank_order() -> None:
    for kind, message in _run(reversed_mesh_rank, 2):
        assert kind == "ValueError" and "[1, 0]" in message and "ascending" in message


def grid_rank() -> dict[str, Any]:
    full = _dense(4, 6)
    # Ranks down the columns first: the mesh [[0, 2], [1, 3]] (ascending along both mesh dims).
    boxes = [([2, 3], [2, 3], 3), ([0, 3], [2, 3], 2), ([2, 0], [2, 3], 1), ([0, 0], [2, 3], 0)]
    spec = EnumerableShardingSpec([ShardMetadata(o, s, f"rank:{r}/cpu") for o, s, r in boxes])
    st = shardwise.shard_tensor(full, spec, src_rank=0)
    dt = to_dtensor(st)
    return {"mesh": dt.device_mesh.mesh.tolist(), "placements": dt.placements,
            "equal": torch.equal(dt.full_tensor(), full),
            "shared": dt.to_local().data_ptr() == st.local_shards()[0].tensor.data_ptr()}


def test_enumerable_grid_becomes_a_two_d_mesh() -> None:
    for found in _run(grid_rank, 4):
        assert found["mesh"] == [[0, 2], [1, 3]] and found["placements"] == (Shard(0), Shard(1))
        assert found["equal"] and found["shared"]


def whole_rank() -> dict[str, Any]:
    full = _dense(3, 3)
    st = shardwise.shard_tensor(full, EnumerableShardingSpec([ShardMetadata([0, 0], [3, 3], "rank:1/cpu")]),
                                src_rank=0)
    dt = to_dtensor(st)
    return {"placements": dt.placements, "local": torch.equal(dt.to_local(), full)}


def test_one_whole_shard_becomes_replicated() -> None:
    for found in _run(whole_rank, 2):
        assert found["placements"] == (Replicate(),) and found["local"]


def bad_rank() -> dict[str, tuple[str, str]]:
    size = shardwise.get_default_group().size
    mesh = init_device_mesh("cpu", (size,))
    partial = DTensor.from_local(torch.ones(2, 2), mesh, [Partial()], run_check=False)
    # Two rows cut 1 + 3: not torch.chunk's 2 + 2 -> no DTensor placement.
    uneven = EnumerableShardingSpec([ShardMetadata([0, 0], [1, 2], "rank:0/cpu"),
                                     ShardMetadata([1, 0], [3, 2], "rank:1/cpu")])
    st = shardwise.shard_tensor(torch.ones(4, 2), uneven, src_rank=0)
    return {
        "partial": _outcome(lambda: from_dtensor(partial)),
        "not a grid": _outcome(lambda: to_dtensor(st)),
        "not a dtensor": _outcome(lambda: from_dtensor(torch.ones(2))),  # type: ignore[arg-type]
    }


def test_bad_input() -> None:
    for found in _run(bad_rank, 2):
        kind, message = found["partial"]
        assert kind == "ValueError" and "Partial" in message and "reduce it first" in message
        kind, message = found["not a grid"]
        assert kind == "ValueError" and "EnumerableShardingSpec" in message and "torch.chunk" in message
        assert found["not a dtensor"][0] == "TypeError"
