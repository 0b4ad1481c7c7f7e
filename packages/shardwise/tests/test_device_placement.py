"""A placement on a device its rank cannot use: a ValueError on every rank before any data moves.

Issue 17, defect 2: ``rank:R/cuda:R`` on a CPU-only host reached the user
as torch's ``AssertionError: Torch not compiled with CUDA enabled`` from the
buffer allocator, after the handshake, while the peers waited in the data
exchange ("a peer has probably died"). Now the rank that cannot use the
device raises :class:`~shardwise._vocab.placement.PlacementError` (a
``ValueError``) naming the placement and why, and its peers raise
:class:`~shardwise.errors.PeerError`, from every entry point that makes
local shards on a placement's device.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import pytest
import torch
from torch import nn

import shardwise
from shardwise import shard_parameter
from shardwise._tensor.scatter import shard_tensor
from shardwise._vocab.placement import Placement, PlacementError, unusable_reason
from shardwise.sharded_tensor import (
    ShardMetadata,
    ShardedTensor,
    ShardedTensorMetadata,
    TensorProperties,
    empty,
    ones,
    rand,
    zeros,
)
from shardwise.sharding_spec import ChunkShardingSpec, EnumerableShardingSpec, ShardingSpec

from rank_helpers import check_errors
from rank_helpers import outcome as _outcome
from rank_helpers import run as _run


def _no_such_cuda() -> str:
    """A CUDA device this host does not have: ``cuda:0`` without CUDA, else one past the last GPU."""
    return f"cuda:{torch.cuda.device_count()}"


# -- the one check: can this process use a device ---------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_cpu_and_meta_are_always_usable(device: str) -> None:
    assert unusable_reason(torch.device(device)) is None
    Placement(f"rank:0/{device}").check_usable()


@pytest.mark.skipif(torch.backends.cuda.is_built(), reason="needs a torch built without CUDA")
def test_cuda_on_a_cpu_build_names_the_placement_and_torchs_reason() -> None:
    reason = unusable_reason(torch.device("cuda:1"))
    assert reason is not None and "was built without CUDA (Torch not compiled with CUDA enabled)" in reason
    with pytest.raises(ValueError) as info:
        Placement("rank:1/cuda:1").check_usable()
    assert isinstance(info.value, PlacementError) and isinstance(info.value, RuntimeError)
    assert str(info.value).startswith("placement 'rank:1/cuda:1' names device cuda:1, which rank 1 cannot use: ")
    assert "e.g. 'rank:1/cpu'" in str(info.value)


def test_cuda_index_past_the_device_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert unusable_reason(torch.device("cuda:1")) is None
    assert unusable_reason(torch.device("cuda")) is None  # the current device
    reason = unusable_reason(torch.device("cuda:2"))
    assert reason is not None and "sees 2 cuda device(s) (cuda:0..cuda:1)" in reason
    assert "CUDA_VISIBLE_DEVICES (invalid device ordinal)" in reason


def test_cuda_built_but_no_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    reason = unusable_reason(torch.device("cuda:0"))
    assert reason is not None and "torch.cuda.is_available() is False" in reason


def test_a_type_without_a_module_is_probed() -> None:
    # hpu needs Habana's plugin, which is not installed here; torch can then make no tensor on it.
    if hasattr(torch, "hpu"):
        pytest.skip("an hpu backend is installed")
    reason = unusable_reason(torch.device("hpu"))
    assert reason is not None and reason.startswith("torch cannot make a tensor on hpu in this process")


# -- every entry point, on real ranks ---------------------------------------------------------------------------

ROWS, COLS = 6, 4


class _RowHalves(ShardingSpec):
    """A user's spec class: two row halves on the given placements (its placements are known only from metadata)."""

    def __init__(self, placements: Sequence[str]) -> None:
        self.placements = list(placements)

    def __repr__(self) -> str:  # what ranks compare (ShardingSpec.to_dict)
        return f"_RowHalves({self.placements})"

    def build_metadata(
        self, tensor_sizes: Sequence[int], tensor_properties: Optional[TensorProperties] = None
    ) -> ShardedTensorMetadata:
        rows, cols = tensor_sizes
        half = rows // 2
        shards = [
            ShardMetadata([0, 0], [half, cols], self.placements[0]),
            ShardMetadata([half, 0], [rows - half, cols], self.placements[1]),
        ]
        return ShardedTensorMetadata(shards, torch.Size(tensor_sizes), tensor_properties or TensorProperties())


def _linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(COLS, ROWS)


def bad_devices() -> dict[str, Any]:
    """Each entry point with rank 1's shard on a CUDA device it lacks (the same spec on every rank)."""
    r = shardwise.get_default_group().rank
    cuda = _no_such_cuda()
    dense = torch.arange(float(ROWS * COLS)).view(ROWS, COLS)
    places = ["rank:0/cpu", f"rank:1/{cuda}"]
    chunk = ChunkShardingSpec(0, places)
    enumerable = EnumerableShardingSpec(
        [ShardMetadata([0, 0], [3, COLS], places[0]), ShardMetadata([3, 0], [3, COLS], places[1])]
    )
    everywhere = ChunkShardingSpec(0, [f"rank:0/{cuda}", f"rank:1/{cuda}"])
    on_cpu = ChunkShardingSpec(1, ["rank:0/cpu", "rank:1/cpu"])
    sharded = shard_tensor(dense, on_cpu)
    seen = {
        "shard_chunk": _outcome(lambda: shard_tensor(dense, chunk)),
        "shard_enumerable": _outcome(lambda: shard_tensor(dense, enumerable)),
        "shard_user_spec": _outcome(lambda: shard_tensor(dense, _RowHalves(places))),
        "spec_shard": _outcome(lambda: chunk.shard(dense)),
        "shardwise_shard_tensor": _outcome(lambda: shardwise._shard_tensor(dense, chunk)),
        "empty": _outcome(lambda: empty(chunk, ROWS, COLS)),
        "zeros": _outcome(lambda: zeros(enumerable, ROWS, COLS)),
        "ones": _outcome(lambda: ones(chunk, ROWS, COLS)),
        "rand": _outcome(lambda: rand(chunk, ROWS, COLS)),
        "constructor": _outcome(lambda: ShardedTensor(chunk, ROWS, COLS)),
        "reshard": _outcome(lambda: sharded.reshard(chunk)),
        "shard_parameter": _outcome(lambda: shard_parameter(_linear(), "weight", chunk)),
        "shard_everywhere": _outcome(lambda: shard_tensor(dense, everywhere)),
        "zeros_everywhere": _outcome(lambda: zeros(everywhere, ROWS, COLS)),
    }
    # Nothing moved and the ranks are in step: the tensor resharded before is intact, and a reshard works.
    assert torch.equal(sharded.full_tensor(), dense)
    back = sharded.reshard(ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu"]))
    assert torch.equal(back.local_shards()[0].tensor, dense[3 * r : 3 * r + 3])
    return seen


NO_CUDA = "placement 'rank:{r}/cuda:{n}' names device cuda:{n}, which rank {r} cannot use: "


def test_every_entry_point_refuses_an_unusable_device_before_data_moves() -> None:
    results = _run(bad_devices, 2)
    n = torch.cuda.device_count()
    mine = NO_CUDA.format(r=1, n=n)
    ops = {
        "shard_chunk": "shard_tensor",
        "shard_enumerable": "shard_tensor",
        "shard_user_spec": "shard_tensor",
        "spec_shard": "shard_tensor",
        "shardwise_shard_tensor": "shard_tensor",
        "empty": "ShardedTensor",
        "zeros": "ShardedTensor",
        "ones": "ShardedTensor",
        "rand": "ShardedTensor",
        "constructor": "ShardedTensor",
        "reshard": "reshard",
        "shard_parameter": "shard_tensor",
    }
    at_fault = {case: (1, "PlacementError", mine) for case in ops}
    check_errors(results, {}, at_fault, peer_says="rank {culprit} (ValueError) rejected its arguments")
    for case, op in ops.items():
        peer = results[0][case][1]
        assert peer.startswith(f"{op}: rank 1 (ValueError) rejected its arguments, so no data was sent"), (case, peer)
        assert mine in peer, (case, peer)  # the peer sees the culprit's reason too
    for rank, seen in enumerate(results):
        for case in ("shard_everywhere", "zeros_everywhere"):
            assert seen[case][0] == "PlacementError", (rank, case, seen[case])
            assert NO_CUDA.format(r=rank, n=n) in seen[case][1], (rank, case, seen[case])


def cpu_creation_needs_no_peer() -> str:
    """CPU-only creation stays free of communication (torch's creation functions communicate not at all)."""
    group = shardwise.get_default_group()
    if group.rank == 0:
        # Rank 1 makes no call: an agreement here would wait for it until the group's timeout.
        st = zeros(ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu"]), ROWS, COLS)
        assert st.local_shards()[0].tensor.shape == (3, COLS)
    group.barrier()
    return "ok"


def test_cpu_creation_does_not_communicate() -> None:
    assert _run(cpu_creation_needs_no_peer, 2) == ["ok", "ok"]
