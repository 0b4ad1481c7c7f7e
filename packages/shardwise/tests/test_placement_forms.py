"""Placements in every form torch 2.13's ``_remote_device`` accepts, with torch's meaning.

``"cpu"``, ``"cuda:0"``, ``torch.device(...)`` (a device, no rank), ``"rank:0"``
(a rank on the CPU) and ``"worker/DEVICE"`` (an RPC worker name) parse as
they do in torch; a bad device raises an error that is both the
``ValueError`` shardwise raised and the ``RuntimeError`` torch raises. A
sharded tensor whose spec places shards on no rank has no local shards
anywhere, as in torch; moving data to such shards is refused on every rank.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed import _remote_device
from torch.distributed._shard.metadata import ShardMetadata as TorchShardMetadata
from torch.distributed._shard.sharding_spec import ChunkShardingSpec as TorchChunkShardingSpec

import shardwise
from shardwise import sharded_tensor
from shardwise._vocab.metadata import Placement
from shardwise.errors import PlacementError  # public: the docs name it (it lived in a private module)
from shardwise.sharding_spec import ChunkShardingSpec, DevicePlacementSpec, ShardMetadata

from rank_helpers import HAS_TORCH_PG, outcome, run

FORMS: list[Any] = [
    "rank:0/cpu",
    "rank:3/cuda:1",
    "rank:2",
    "cpu",
    "cuda",
    "cuda:0",
    torch.device("cpu"),
    torch.device("cuda", 1),
    "trainer0/cpu",
    "trainer0",
    "ps0/cuda:0",
]


@pytest.mark.parametrize("form", FORMS, ids=str)
def test_each_form_means_what_torch_means(form: Any) -> None:
    ours, theirs = Placement(form), _remote_device(form)
    assert (ours.rank(), ours.device(), ours.worker_name()) == (theirs.rank(), theirs.device(), theirs.worker_name())
    assert str(ours) == repr(theirs)
    assert ours == theirs and ours == Placement(str(ours)) and Placement(theirs) == ours
    assert ShardMetadata([0], [1], form).placement == ours


def test_specs_and_shard_metadata_accept_every_form() -> None:
    forms = [torch.device("cpu"), "cuda:0", "rank:1", "rank:0/cpu"]
    spec = ChunkShardingSpec(0, forms)
    torch_spec = TorchChunkShardingSpec(0, list(forms))
    assert [(p.rank(), p.device()) for p in spec.placements] == [(p.rank(), p.device()) for p in torch_spec.placements]
    assert [p.rank() for p in spec.placements] == [None, None, 1, 0]
    assert DevicePlacementSpec("cuda:1").device.rank() is None
    assert DevicePlacementSpec(torch.device("cpu")).device.device() == torch.device("cpu")
    assert DevicePlacementSpec("rank:2").device == "rank:2/cpu"
    assert ShardMetadata([0], [2], "cpu").rank is None
    assert ShardMetadata([0], [2], "rank:1").rank == TorchShardMetadata([0], [2], "rank:1").placement.rank() == 1


@pytest.mark.parametrize("bad", ["rank:0/foo", "rank:0/cuda:x", "rank:1/"])
def test_an_invalid_device_raises_runtime_error_as_in_torch(bad: str) -> None:
    with pytest.raises(RuntimeError) as theirs:
        _remote_device(bad)
    with pytest.raises(RuntimeError) as ours:
        ChunkShardingSpec(0, ["rank:0/cpu", bad])
    assert isinstance(ours.value, ValueError) and isinstance(ours.value, PlacementError)
    assert str(theirs.value) in str(ours.value)
    for make in (lambda: ShardMetadata([0], [1], bad), lambda: DevicePlacementSpec(bad)):
        with pytest.raises(RuntimeError, match="is not a torch device"):
            make()


@pytest.mark.parametrize("bad", ["random:0", "rank:x/cpu", "a/b/c", "/cpu"])
def test_unparsable_placements_carry_torchs_wording(bad: str) -> None:
    with pytest.raises(ValueError, match="Could not parse remote_device") as theirs:
        _remote_device(bad)
    with pytest.raises(ValueError) as ours:
        Placement(bad)
    assert str(theirs.value) in str(ours.value)


def test_a_placement_of_another_type_is_a_type_error_as_in_torch() -> None:
    with pytest.raises(TypeError, match="Invalid type for remote_device"):
        _remote_device(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Invalid type for remote_device") as ours:
        Placement(3)
    assert isinstance(ours.value, ValueError)


# -- rank-less placements in sharded tensors (2 ranks) -----------------------------------------------------------


def _shards(st: Any) -> dict[str, Any]:
    return {
        "local": [(s.metadata.shard_offsets, s.metadata.shard_sizes, str(s.metadata.placement)) for s in st.local_shards()],
        "metadata": [(m.shard_offsets, m.shard_sizes, str(m.placement)) for m in st.metadata().shards_metadata],
    }


def _rankless() -> dict[str, Any]:
    spec = ChunkShardingSpec(0, ["cpu", "cpu"])
    out: dict[str, Any] = {"ones": _shards(sharded_tensor.ones(spec, 4, 2))}
    if HAS_TORCH_PG:
        import torch.distributed._shard.sharded_tensor as torch_st

        out["torch_ones"] = _shards(torch_st.ones(TorchChunkShardingSpec(0, ["cpu", "cpu"]), 4, 2))
    mixed = sharded_tensor.zeros(ChunkShardingSpec(0, ["rank:1/cpu", "cpu"]), 4, 2)
    out["mixed"] = _shards(mixed)
    out["shard_tensor"] = outcome(lambda: shardwise.shard_tensor(torch.ones(4, 2), spec))
    out["reshard"] = outcome(lambda: mixed.reshard(spec))
    out["gather"] = outcome(lambda: mixed.gather(0, torch.empty(4, 2) if shardwise.get_default_group().rank == 0 else None))
    out["full_tensor"] = outcome(mixed.full_tensor)
    out["moved"] = _shards(torch.empty_like(sharded_tensor.ones(spec, 4, 2), device="cpu"))
    worker = ChunkShardingSpec(0, ["trainer0/cpu", "rank:0/cpu"])  # parsed as torch does; a tensor needs RPC
    out["worker"] = outcome(lambda: sharded_tensor.empty(worker, 4, 2))
    try:
        sharded_tensor.empty(worker, 4, 2)
    except RuntimeError as exc:
        out["worker_is_runtime_error"] = isinstance(exc, ValueError)
    return out


def test_rankless_placements_give_shards_no_rank_holds() -> None:
    results = run(_rankless, 2)
    for rank, seen in enumerate(results):
        meta = [([0, 0], [2, 2], "cpu"), ([2, 0], [2, 2], "cpu")]
        assert seen["ones"] == {"local": [], "metadata": meta}, rank
        if "torch_ones" in seen:
            assert seen["torch_ones"] == seen["ones"]
        assert seen["moved"] == seen["ones"]
        first = ([0, 0], [2, 2], "rank:1/cpu")
        assert seen["mixed"] == {"local": [first] if rank == 1 else [], "metadata": [first, ([2, 0], [2, 2], "cpu")]}
        assert seen["worker"][0] == "PlacementError" and "RPC framework needs to be initialized" in seen["worker"][1]
        assert seen["worker_is_runtime_error"] is True
        for case in ("shard_tensor", "reshard", "gather", "full_tensor"):
            kind, message = seen[case]
            assert kind == "ValueError" and "which names no rank" in message, (rank, case, seen[case])
