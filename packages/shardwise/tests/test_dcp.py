"""``torch.distributed.checkpoint`` saves and loads ShardedTensors directly (test-gloo backend).

DCP runs its own collectives on torch's default process group, so these
tests need the torch gloo group of the test backend (not the MPI backend).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex

import shardwise
from shardwise._vocab.metadata import ShardMetadata, TensorProperties
from shardwise.sharded_tensor import Shard, ShardedTensor
from shardwise.sharding_spec import ChunkShardingSpec, EnumerableShardingSpec, ShardingSpec

from rank_helpers import HAS_TORCH_PG, outcome
from rank_helpers import run as _run
from rank_helpers import sharded_from_dense as _sharded

pytestmark = pytest.mark.skipif(not HAS_TORCH_PG, reason="DCP needs a torch process group (test-gloo backend)")

#: The saved tensors: uneven chunks (5 rows on 2-4 ranks leave a short or empty shard),
#: float64 columns, and an int tensor, plus a plain tensor and a non-tensor value.
DENSE = {
    "rows": torch.arange(5 * 3, dtype=torch.float32).reshape(5, 3),
    "cols": torch.arange(4 * 7, dtype=torch.float64).reshape(4, 7) / 7,
    "ints": torch.arange(6 * 4, dtype=torch.int64).reshape(6, 4) * 3,
}


def _places(w: int, reverse: bool = False) -> list[str]:
    order = range(w - 1, -1, -1) if reverse else range(w)
    return [f"rank:{r}/cpu" for r in order]


def _grid(w: int, rows: int, cols: int) -> EnumerableShardingSpec:
    """Four boxes of a rows x cols tensor, dealt to the ranks round-robin."""
    top, left = rows // 2, cols // 2
    boxes = [(0, 0, top, left), (0, left, top, cols - left), (top, 0, rows - top, left),
             (top, left, rows - top, cols - left)]
    return EnumerableShardingSpec(
        [ShardMetadata([r0, c0], [h, wd], f"rank:{i % w}/cpu") for i, (r0, c0, h, wd) in enumerate(boxes)]
    )


def _specs(kind: str, w: int) -> dict[str, ShardingSpec]:
    if kind == "save":
        return {"rows": ChunkShardingSpec(0, _places(w)), "cols": ChunkShardingSpec(1, _places(w, reverse=True)),
                "ints": _grid(w, 6, 4)}
    return {"rows": ChunkShardingSpec(1, _places(w, reverse=True)), "cols": _grid(w, 4, 7),
            "ints": ChunkShardingSpec(0, _places(w))}


def save_rank(path: str) -> None:
    w = shardwise.get_default_group().size
    state: dict[str, Any] = {name: _sharded(DENSE[name], spec) for name, spec in _specs("save", w).items()}
    state["plain"] = torch.full((2, 2), 7.0)
    state["step"] = 12
    dcp.save(state, checkpoint_id=path)


def load_rank(path: str) -> dict[str, bool]:
    w = shardwise.get_default_group().size
    state: dict[str, Any] = {
        name: _sharded(torch.zeros_like(DENSE[name]), spec) for name, spec in _specs("load", w).items()
    }
    state["plain"] = torch.zeros(2, 2)
    state["step"] = 0
    before = {name: [s.tensor.data_ptr() for s in state[name].local_shards()] for name in DENSE}
    dcp.load(state, checkpoint_id=path)
    found = {name: torch.equal(state[name].full_tensor(), DENSE[name]) for name in DENSE}
    # Loading wrote into the existing local shards (DCP copies into the tensors we hand it).
    found["in place"] = all(
        [s.tensor.data_ptr() for s in state[name].local_shards()] == before[name] for name in DENSE
    )
    found["plain"] = torch.equal(state["plain"], torch.full((2, 2), 7.0))
    found["step"] = state["step"] == 12
    return found


@pytest.mark.parametrize(("save_world", "load_world"), [(2, 3), (3, 2), (2, 2), (1, 4)])
def test_save_on_n_ranks_load_on_m_into_other_specs(tmp_path: Path, save_world: int, load_world: int) -> None:
    path = str(tmp_path / "ckpt")
    _run(save_rank, save_world, path)
    for found in _run(load_rank, load_world, path):
        assert all(found.values()), found


def wrong_size_rank(path: str) -> tuple[str, str]:
    w = shardwise.get_default_group().size
    bigger = _sharded(torch.zeros(6, 3), ChunkShardingSpec(0, _places(w)))
    return outcome(lambda: _load_catching(bigger, path))


def _load_catching(tensor: ShardedTensor, path: str) -> None:
    try:
        dcp.load({"rows": tensor}, checkpoint_id=path)
    except CheckpointException as exc:  # a BaseException: re-raise as an ordinary error for ``outcome``
        raise RuntimeError(str(exc)) from None


def test_load_into_another_global_size_fails_on_every_rank_naming_the_key(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    _run(save_rank, 2, path)
    for kind, message in _run(wrong_size_rank, 2, path):
        assert kind == "RuntimeError"
        assert "Size mismatch" in message and "[5, 3]" in message and "[6, 3]" in message and "rows" in message


def protocol_rank() -> dict[str, Any]:
    group = shardwise.get_default_group()
    st = _sharded(DENSE["rows"], ChunkShardingSpec(0, _places(group.size)))
    items = st.__create_write_items__("w", st)
    chunks = st.__create_chunk_list__()
    shard = st.local_shards()[0]
    got = st.__get_tensor_shard__(MetadataIndex("w", torch.Size(shard.metadata.shard_offsets)))
    missing = outcome(lambda: st.__get_tensor_shard__(MetadataIndex("w", torch.Size([99, 0]))))
    return {
        "items": [(i.index.fqn, list(i.index.offset), list(i.tensor_data.chunk.sizes), list(i.tensor_data.size),
                   i.tensor_data.properties.dtype) for i in items],
        "chunks": [(list(c.offsets), list(c.sizes)) for c in chunks],
        "alias": got.data_ptr() == shard.tensor.data_ptr() and got is shard.tensor,
        "missing": missing,
    }


def test_protocol_items_chunks_and_aliasing() -> None:
    # 5 rows on 3 ranks: chunks of 2, 2, 1.
    results = _run(protocol_rank, 3)
    for rank, (start, rows) in enumerate([(0, 2), (2, 2), (4, 1)]):
        found = results[rank]
        assert found["items"] == [("w", [start, 0], [rows, 3], [5, 3], torch.float32)]
        assert found["chunks"] == [([start, 0], [rows, 3])]
        assert found["alias"]
        kind, message = found["missing"]
        assert kind == "ValueError" and "'w'" in message and "[99, 0]" in message and f"[[{start}, 0]]" in message


def empty_shard_rank() -> tuple[int, int]:
    group = shardwise.get_default_group()
    # 2 rows on 3 ranks: rank 2's chunk is empty and is not a chunk of the checkpoint.
    st = _sharded(torch.ones(2, 3), ChunkShardingSpec(0, _places(group.size)))
    return len(st.__create_write_items__("w", st)), len(st.__create_chunk_list__())


def test_empty_shards_write_nothing() -> None:
    assert _run(empty_shard_rank, 3) == [(1, 1), (1, 1), (0, 0)]


def _nested_rows(full: torch.Tensor) -> ShardedTensor:
    """``full`` (8 x 3) as two row blocks whose shards are ShardedTensors of two row chunks each (one rank)."""
    group = shardwise.get_default_group()
    outer = EnumerableShardingSpec([ShardMetadata([0, 0], [5, 3], "rank:0/cpu"), ShardMetadata([5, 0], [3, 3], "rank:0/cpu")])
    md = outer.build_metadata(full.size(), TensorProperties(dtype=full.dtype))
    shards = [Shard(_sharded(full[m.shard_offsets[0]:m.shard_offsets[0] + m.shard_sizes[0]].contiguous(),
                             ChunkShardingSpec(0, ["rank:0/cpu", "rank:0/cpu"]), group), m)
              for m in md.shards_metadata]
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards, md, process_group=group,
                                                                      sharding_spec=outer)


def nested_rank(path: str) -> dict[str, Any]:
    full = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
    nested = _nested_rows(full)
    items = nested.__create_write_items__("w", nested)
    leaf = nested.local_shards()[1].tensor.local_shards()[1].tensor  # rows 7..7 of the outer block at row 5
    got = nested.__get_tensor_shard__(MetadataIndex("w", [7, 0]))
    dcp.save({"w": nested}, checkpoint_id=path)
    flat = _sharded(torch.zeros(8, 3), ChunkShardingSpec(1, ["rank:0/cpu"]))
    dcp.load({"w": flat}, checkpoint_id=path)
    empty = _nested_rows(torch.zeros(8, 3))
    dcp.load({"w": empty}, checkpoint_id=path)
    return {
        "items": [(list(i.index.offset), list(i.tensor_data.chunk.sizes)) for i in items],
        "alias": got is leaf,
        "flat": torch.equal(flat.full_tensor(), full),
        "nested": torch.equal(empty.full_tensor(), full),
    }


def test_nested_shards_save_and_load_at_their_global_offsets(tmp_path: Path) -> None:
    found = _run(nested_rank, 1, str(tmp_path / "ckpt"))[0]
    # Outer blocks of 5 and 3 rows, each cut by torch.chunk into 3 + 2 and 2 + 1.
    assert found["items"] == [([0, 0], [3, 3]), ([3, 0], [2, 3]), ([5, 0], [2, 3]), ([7, 0], [1, 3])]
    assert found["alias"]
    assert found["flat"] and found["nested"]
