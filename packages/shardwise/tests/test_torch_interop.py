"""``from_torch`` / ``to_torch`` between torch 2.13's ShardedTensor and shardwise's, and loading torch's state dicts."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, NoReturn, Optional, Sequence

import pytest
import torch
import torch.distributed as dist
import torch.distributed._shard.sharded_tensor as torch_st
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._shard.api import shard_parameter as torch_shard_parameter
from torch.distributed._shard.sharded_tensor import ShardedTensor as TorchShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata as TorchMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties as TorchProperties
from torch.distributed._shard.sharded_tensor.shard import Shard as TorchShard
from torch.distributed._shard.sharding_spec import ChunkShardingSpec as TorchChunk
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec as TorchEnumerable
from torch.distributed._shard.sharding_spec import ShardMetadata as TorchShardMetadata
from torch.distributed._shard.sharding_spec import ShardingSpec as TorchSpec

import shardwise
import shardwise.checkpoint
from shardwise import Group, from_torch, to_torch
from shardwise.sharded_tensor import ShardedTensor, ShardedTensorMetadata, TensorProperties
from shardwise.sharding_spec import ChunkShardingSpec, EnumerableShardingSpec, ShardMetadata, ShardingSpec

from rank_helpers import HAS_TORCH_PG, box, outcome, run, sharded_from_dense

pytestmark = pytest.mark.skipif(not HAS_TORCH_PG, reason="torch's ShardedTensor needs a torch process group")

R0, R1 = "rank:0/cpu", "rank:1/cpu"


def _dense(size: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    n = torch.Size(size).numel()
    if dtype == torch.bool:
        return (torch.arange(n) % 3 == 0).reshape(size)
    return torch.arange(n).reshape(size).to(dtype)


def _key(md: Any) -> tuple[Any, ...]:
    return tuple(md.shard_offsets), tuple(md.shard_sizes), str(md.placement)


def _torch_from_dense(full: torch.Tensor, spec: TorchSpec, requires_grad: bool = False) -> TorchShardedTensor:
    """torch's ShardedTensor of ``full`` by ``spec``, each rank filling its own shards (no communication)."""
    st = torch_st.empty(spec, *full.shape, dtype=full.dtype, requires_grad=requires_grad)
    with torch.no_grad():
        for shard in st.local_shards():
            shard.tensor.copy_(box(full, shard.metadata))
    return st


def _grid(torch_md: bool) -> list[Any]:
    """A 2x2 grid of a 4x6 tensor, rank 0 on the diagonal."""
    cls = TorchShardMetadata if torch_md else ShardMetadata
    return [cls([i, j], [2, 3], R0 if (i == 0) == (j == 0) else R1) for i in (0, 2) for j in (0, 3)]


def _cases() -> list[tuple[str, list[int], torch.dtype, TorchSpec, ShardingSpec]]:
    """(name, size, dtype, torch's spec, the shardwise spec it maps to)."""
    four = [R0, R1, R0, R1]
    return [
        ("chunk0 uneven", [5, 3], torch.float32, TorchChunk(0, [R0, R1]), ChunkShardingSpec(0, [R0, R1])),
        ("chunk1", [4, 5], torch.float64, TorchChunk(1, [R0, R1]), ChunkShardingSpec(1, [R0, R1])),
        # 3 rows in 4 chunks: 1, 1, 1, 0 -- rank 1's second shard is empty, two shards per rank.
        ("chunk0 empty trailing", [3, 2], torch.int64, TorchChunk(0, list(four)), ChunkShardingSpec(0, four)),
        ("chunk-1 reversed", [2, 3], torch.bfloat16, TorchChunk(-1, [R1, R0]), ChunkShardingSpec(-1, [R1, R0])),
        ("grid", [4, 6], torch.int32, TorchEnumerable(_grid(True)), EnumerableShardingSpec(_grid(False))),
        ("bool 1-D", [5], torch.bool, TorchChunk(0, [R1, R0]), ChunkShardingSpec(0, [R1, R0])),
    ]


def _torch_gathered(st: TorchShardedTensor, rank: int) -> Optional[torch.Tensor]:
    """torch's own ``gather`` to rank 0 (every rank calls it)."""
    out = torch.empty(st.size(), dtype=st.dtype) if rank == 0 else None
    st.gather(0, out)
    return out


def round_trips_from_torch() -> int:
    """torch -> shardwise -> torch for every case: same storage, metadata, spec, data."""
    rank = dist.get_rank()
    checked = 0
    for name, size, dtype, tspec, expected_spec in _cases():
        full = _dense(size, dtype)
        theirs = _torch_from_dense(full, tspec)
        ours = from_torch(theirs)
        assert isinstance(ours, ShardedTensor) and not isinstance(ours, TorchShardedTensor), name
        assert ours.size() == torch.Size(size) and ours.dtype == dtype, name
        assert [_key(m) for m in ours.metadata().shards_metadata] == [
            _key(m) for m in theirs.metadata().shards_metadata
        ], name
        tp = theirs.metadata().tensor_properties
        assert ours.metadata().tensor_properties == TensorProperties(
            tp.dtype, tp.layout, tp.requires_grad, tp.memory_format, tp.pin_memory
        ), name
        assert ours.sharding_spec() == expected_spec, (name, ours.sharding_spec())
        assert ours.process_group.pg is theirs._process_group, name
        pairs = list(zip(ours.local_shards(), theirs.local_shards(), strict=True))
        assert len(pairs) == {"chunk0 empty trailing": 2, "grid": 2}.get(name, 1), name
        for mine, theirs_shard in pairs:
            assert mine.tensor is theirs_shard.tensor, name
            assert mine.tensor.data_ptr() == theirs_shard.tensor.data_ptr(), name
            assert _key(mine.metadata) == _key(theirs_shard.metadata), name
        # shardwise's own collectives on the converted tensor.
        assert torch.equal(ours.full_tensor(), full), name
        out = torch.empty(size, dtype=dtype) if rank == 1 else None
        ours.gather(1, out)
        assert out is None or torch.equal(out, full), name

        # An in-place change through shardwise's shards is what torch's gather sees.
        changed = full.logical_not() if dtype == torch.bool else full * 2 + 1
        with torch.no_grad():
            for shard in ours.local_shards():
                shard.tensor.copy_(box(changed, shard.metadata))
        gathered = _torch_gathered(theirs, rank)
        assert gathered is None or torch.equal(gathered, changed), name

        back = to_torch(ours)
        assert isinstance(back, TorchShardedTensor) and not isinstance(back, ShardedTensor), name
        assert type(back.sharding_spec()) is type(tspec) and back.sharding_spec() == theirs.sharding_spec(), name
        assert [_key(m) for m in back.metadata().shards_metadata] == [
            _key(m) for m in theirs.metadata().shards_metadata
        ], name
        assert back.metadata().size == theirs.metadata().size, name
        assert back.metadata().tensor_properties == theirs.metadata().tensor_properties, name
        assert back._process_group is theirs._process_group, name
        for a, b in zip(back.local_shards(), theirs.local_shards(), strict=True):
            assert a.tensor is b.tensor, name
        # torch's own gather on the round-tripped tensor (a collective on torch's group).
        gathered = _torch_gathered(back, rank)
        assert gathered is None or torch.equal(gathered, changed), name

        # No collective: rank 0 alone converts back and forth (a collective would wait for rank 1 until
        # the group's timeout), then both meet again.
        if rank == 0:
            for _ in range(3):
                back = to_torch(from_torch(back))
            assert all(a.tensor is b.tensor for a, b in zip(back.local_shards(), theirs.local_shards(), strict=True))
        dist.barrier()
        checked += 1
    return checked


def round_trips_from_shardwise() -> int:
    """shardwise -> torch -> shardwise: torch's ops write into shardwise's storage, and back."""
    group = shardwise.get_default_group()
    checked = 0
    for name, size, dtype, tspec, spec in _cases():
        full = _dense(size, dtype)
        ours = sharded_from_dense(full, spec, group)
        theirs = to_torch(ours)
        assert isinstance(theirs, TorchShardedTensor), name
        assert theirs.sharding_spec() == tspec, (name, theirs.sharding_spec())
        assert theirs._process_group is group.pg, name
        for a, b in zip(ours.local_shards(), theirs.local_shards(), strict=True):
            assert a.tensor is b.tensor and a.tensor.data_ptr() == b.tensor.data_ptr(), name
        gathered = _torch_gathered(theirs, group.rank)
        assert gathered is None or torch.equal(gathered, full), name
        if dtype.is_floating_point:
            # torch's sharded init op fills the local shards in place: shardwise sees it.
            torch.nn.init.constant_(theirs, 3.0)
            assert torch.equal(ours.full_tensor(), torch.full(size, 3.0, dtype=dtype)), name
        again = from_torch(theirs)
        assert again.sharding_spec() == spec, name
        assert all(a.tensor is b.tensor for a, b in zip(again.local_shards(), ours.local_shards(), strict=True)), name
        checked += 1

    # Tensor properties: requires_grad survives both ways, on the wrapper and the shards.
    theirs = torch_st.zeros(TorchChunk(0, [R0, R1]), 4, 2, dtype=torch.float64, requires_grad=True)
    ours = from_torch(theirs)
    assert ours.requires_grad and ours.metadata().tensor_properties.requires_grad
    assert ours.local_tensor() is theirs.local_tensor() and ours.local_tensor().requires_grad
    back = to_torch(ours)
    assert back.metadata().tensor_properties.requires_grad and back.local_tensor() is theirs.local_tensor()
    return checked


def test_torch_to_shardwise_to_torch_shares_storage_and_metadata() -> None:
    assert run(round_trips_from_torch, 2) == [len(_cases())] * 2


def test_shardwise_to_torch_to_shardwise_shares_storage_and_metadata() -> None:
    assert run(round_trips_from_shardwise, 2) == [len(_cases())] * 2


# -- specs without a counterpart, groups without a torch ProcessGroup, bad input ---------------------


class UserTorchSpec(TorchSpec):
    """A user's torch spec: dim-0 chunks on ranks 0 and 1."""

    def build_metadata(self, tensor_sizes: torch.Size, tensor_properties: TorchProperties) -> TorchMetadata:
        return TorchChunk(0, [R0, R1]).build_metadata(tensor_sizes, tensor_properties)

    def shard(self, tensor: torch.Tensor, src_rank: int = 0, process_group: Any = None) -> NoReturn:
        raise NotImplementedError


class UserShardwiseSpec(ShardingSpec):
    """A user's shardwise spec: dim-0 chunks on ranks 0 and 1."""

    def build_metadata(
        self, tensor_sizes: Sequence[int], tensor_properties: TensorProperties
    ) -> ShardedTensorMetadata:
        return ChunkShardingSpec(0, [R0, R1]).build_metadata(tensor_sizes, tensor_properties)


class NoTorchGroup(Group):
    """A shardwise group with no torch ProcessGroup under it (as the MPI backend's); it moves no data."""

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(backend="fake-mpi", rank=rank, size=size, device=torch.device("cpu"), verify=False)

    def _refuse(self, *args: Any) -> NoReturn:
        raise RuntimeError("NoTorchGroup runs no collectives")

    _barrier = _broadcast = _all_reduce = _all_gather = _reduce_scatter = _all_to_all = _new_group = _refuse


def bad_input_rank() -> dict[str, tuple[str, str]]:
    group = shardwise.get_default_group()
    full = torch.arange(8.0).reshape(4, 2)
    theirs = _torch_from_dense(full, TorchChunk(0, [R0, R1]))
    ours = from_torch(theirs)
    md = TorchChunk(0, [R0, R1]).build_metadata(torch.Size([4, 2]), TorchProperties(dtype=torch.float32))
    mine = [TorchShard(box(full, m).clone(), m) for m in md.shards_metadata if m.placement.rank() == group.rank]
    theirs_user = TorchShardedTensor._init_from_local_shards_and_global_metadata(
        mine, md, sharding_spec=UserTorchSpec()
    )
    ours_user = sharded_from_dense(full, UserShardwiseSpec(), group)
    # A spec that does not produce the shards (shardwise does not check; torch would rebuild its
    # metadata from it): the shards win.
    ours_odd = ShardedTensor._init_from_local_shards_and_global_metadata(
        list(ours.local_shards()), ours.metadata(), process_group=group, sharding_spec=ChunkShardingSpec(1, [R1, R0])
    )
    ours_fake = sharded_from_dense(full, ChunkShardingSpec(0, [R0, R1]), NoTorchGroup(group.rank, group.size))
    # Every rank creates it; rank 1 gets torch's NON_GROUP_MEMBER marker, not a ProcessGroup.
    first_only = dist.new_group([0])

    def spec_of(make: Callable[[], Any], expected: Any) -> Callable[[], None]:
        def check() -> None:
            spec = make().sharding_spec()
            assert spec == expected, spec

        return check

    def fake_to_world() -> None:
        back = to_torch(ours_fake, process_group=dist.group.WORLD)
        assert back.local_tensor() is ours_fake.local_tensor()
        assert torch.equal(from_torch(back).full_tensor(), full)

    return {
        "from_torch plain": outcome(lambda: from_torch(full)),  # type: ignore[arg-type]
        "from_torch shardwise": outcome(lambda: from_torch(ours)),  # type: ignore[arg-type]
        "to_torch plain": outcome(lambda: to_torch(full)),  # type: ignore[arg-type]
        "to_torch torch": outcome(lambda: to_torch(theirs)),  # type: ignore[arg-type]
        "from_torch user spec": outcome(lambda: from_torch(theirs_user)),
        "from_torch user spec inferred": outcome(
            spec_of(lambda: from_torch(theirs_user, sharding_spec="infer"), ChunkShardingSpec(0, [R0, R1]))
        ),
        "from_torch user spec given": outcome(
            spec_of(
                lambda: from_torch(theirs_user, sharding_spec=EnumerableShardingSpec(_two_rows())),
                EnumerableShardingSpec(_two_rows()),
            )
        ),
        "to_torch odd recorded spec": outcome(spec_of(lambda: to_torch(ours_odd), TorchChunk(0, [R0, R1]))),
        "from_torch wrong spec": outcome(lambda: from_torch(theirs, sharding_spec=ChunkShardingSpec(1, [R0, R1]))),
        "from_torch torch spec": outcome(lambda: from_torch(theirs, sharding_spec=TorchChunk(0, [R0, R1]))),  # type: ignore[arg-type]
        "from_torch spec word": outcome(lambda: from_torch(theirs, sharding_spec="guess")),  # type: ignore[arg-type]
        "to_torch user spec": outcome(lambda: to_torch(ours_user)),
        "to_torch user spec inferred": outcome(
            spec_of(lambda: to_torch(ours_user, sharding_spec="infer"), TorchChunk(0, [R0, R1]))
        ),
        "to_torch wrong spec": outcome(lambda: to_torch(ours, sharding_spec=TorchChunk(0, [R1, R0]))),
        "to_torch no torch group": outcome(lambda: to_torch(ours_fake)),
        "to_torch no torch group, world given": outcome(fake_to_world),
        "to_torch other ranks": outcome(lambda: to_torch(ours, process_group=first_only)),
        "to_torch not a group": outcome(lambda: to_torch(ours, process_group=group)),  # type: ignore[arg-type]
    }


def _two_rows() -> list[ShardMetadata]:
    return [ShardMetadata([0, 0], [2, 2], R0), ShardMetadata([2, 0], [2, 2], R1)]


def test_bad_input_raises_the_same_clear_error_on_every_rank() -> None:
    expected = {
        "from_torch plain": ("TypeError", "from_torch takes a torch.distributed._shard.sharded_tensor.ShardedTensor"),
        "from_torch shardwise": ("TypeError", "it is already shardwise's; to_torch converts the other way"),
        "to_torch plain": ("TypeError", "to_torch takes a shardwise ShardedTensor, got torch.Tensor"),
        "to_torch torch": ("TypeError", "it is already torch's; from_torch converts the other way"),
        "from_torch user spec": ("TypeError", "UserTorchSpec, a spec class with no counterpart"),
        "from_torch user spec inferred": ("ok", ""),
        "from_torch user spec given": ("ok", ""),
        "to_torch odd recorded spec": ("ok", ""),
        "from_torch wrong spec": ("ValueError", "does not produce the tensor's shards"),
        "from_torch torch spec": ("TypeError", "sharding_spec must be a shardwise.sharding_spec.ShardingSpec"),
        "from_torch spec word": ("TypeError", "'infer' or None, got str"),
        "to_torch user spec": ("TypeError", "UserShardwiseSpec, a spec class with no counterpart"),
        "to_torch user spec inferred": ("ok", ""),
        "to_torch wrong spec": ("ValueError", "does not produce the tensor's shards"),
        "to_torch no torch group": ("TypeError", "'fake-mpi' backend (NoTorchGroup), which has no torch ProcessGroup"),
        "to_torch no torch group, world given": ("ok", ""),
        "to_torch not a group": ("TypeError", "process_group must be a torch.distributed.ProcessGroup or None"),
    }
    other_ranks = [
        ("ValueError", "process_group holds the global ranks [0], but the tensor's group holds [0, 1]"),
        ("TypeError", "process_group must be a torch.distributed.ProcessGroup or None, got int"),
    ]
    results = run(bad_input_rank, 2)
    for rank, seen in enumerate(results):
        assert seen.keys() == {*expected, "to_torch other ranks"}
        for case, (kind, fragment) in [*expected.items(), ("to_torch other ranks", other_ranks[rank])]:
            assert seen[case][0] == kind and fragment in seen[case][1], (rank, case, seen[case])


# -- torch's state dicts into shardwise-sharded models -------------------------------------------------


def _small_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))


def _whole(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: v.full_tensor() if isinstance(v, ShardedTensor) else v.detach().clone() for k, v in model.state_dict().items()
    }


def _shardwise_layouts() -> dict[str, dict[str, ShardingSpec]]:
    """Specs for the weights of layers 0 and 2: torch's own layout, and others."""
    grid = EnumerableShardingSpec(
        [ShardMetadata([i, j], [n, m], R0 if i == 0 else R1) for i, n in ((0, 2), (2, 1)) for j, m in ((0, 4), (4, 3))]
    )
    return {
        "same": {"0": ChunkShardingSpec(0, [R0, R1]), "2": ChunkShardingSpec(1, [R1, R0])},
        "reversed": {"0": ChunkShardingSpec(0, [R1, R0]), "2": ChunkShardingSpec(1, [R0, R1])},
        "other dims": {"0": ChunkShardingSpec(1, [R0, R1]), "2": grid},
    }


def _sharded_model(specs: dict[str, ShardingSpec]) -> nn.Module:
    model = _small_model(1)  # other values, to be overwritten
    for layer, spec in specs.items():
        shardwise.shard_parameter(model.get_submodule(layer), "weight", spec)
    return model


def torch_state_dicts_rank(path: str) -> list[str]:
    rank = dist.get_rank()
    truth = _whole(_small_model(0))
    torch_model = _small_model(0)
    torch_shard_parameter(torch_model[0], "weight", TorchChunk(0, [R0, R1]))
    torch_shard_parameter(torch_model[2], "weight", TorchChunk(1, [R1, R0]))
    sd = torch_model.state_dict()
    assert isinstance(sd["0.weight"], TorchShardedTensor) and isinstance(sd["2.weight"], TorchShardedTensor)
    file = Path(path) / f"torch_sd_{rank}.pt"
    torch.save(sd, file)
    dcp.save({"model": sd}, checkpoint_id=str(Path(path) / "dcp"))

    loaded_ok = []
    for name, specs in _shardwise_layouts().items():
        # torch.save: pickled torch ShardedTensors, unpickled into torch's default process group.
        loaded = torch.load(file, weights_only=False)
        assert isinstance(loaded["0.weight"], TorchShardedTensor)
        before = {k: [s.tensor.clone() for s in v.local_shards()] for k, v in loaded.items() if k.endswith("weight")}
        model = _sharded_model(specs)
        model.load_state_dict(loaded)
        got = _whole(model)
        for key, value in truth.items():
            assert torch.equal(got[key], value), (name, key)
        for key, shards in before.items():  # the state dict's torch tensors are left as they were
            assert isinstance(loaded[key], TorchShardedTensor)
            assert all(torch.equal(a, b.tensor) for a, b in zip(shards, loaded[key].local_shards(), strict=True))
        loaded_ok.append(f"torch.save {name}")

        # A DCP checkpoint torch saved with its ShardedTensors, read by shardwise.checkpoint and by dcp.load.
        for reader in ("shardwise", "dcp"):
            model = _sharded_model(specs)
            state = {"model": model.state_dict()}
            if reader == "shardwise":
                shardwise.checkpoint.load(state, str(Path(path) / "dcp"))
            else:
                dcp.load(state, checkpoint_id=str(Path(path) / "dcp"))
            model.load_state_dict(state["model"])
            got = _whole(model)
            for key, value in truth.items():
                assert torch.equal(got[key], value), (reader, name, key)
            loaded_ok.append(f"{reader} dcp {name}")
    return loaded_ok


def test_torch_state_dicts_load_into_a_shardwise_sharded_model(tmp_path: Path) -> None:
    results = run(torch_state_dicts_rank, 2, str(tmp_path))
    assert results[0] == results[1] and len(results[0]) == 9


# -- a subgroup: placements are global ranks in both libraries ---------------------------------------------


def subgroup_rank() -> list[Any]:
    rank = dist.get_rank()
    sub = dist.new_group([1, 2])  # every rank calls it; rank 0 gets NON_GROUP_MEMBER
    full = _dense([5, 2], torch.float32)
    spec = TorchChunk(0, ["rank:2/cpu", "rank:1/cpu"])
    theirs = torch_st.empty(spec, 5, 2, process_group=sub)
    with torch.no_grad():
        for shard in theirs.local_shards():
            shard.tensor.copy_(box(full, shard.metadata))
    ours = from_torch(theirs)
    assert all(a.tensor is b.tensor for a, b in zip(ours.local_shards(), theirs.local_shards(), strict=True))
    back = to_torch(ours)
    # The subgroup on its members, torch's NON_GROUP_MEMBER marker (an int) on rank 0.
    assert back._process_group is theirs._process_group if rank else back._process_group == theirs._process_group
    assert all(a.tensor is b.tensor for a, b in zip(back.local_shards(), theirs.local_shards(), strict=True))
    seen: list[Any] = [[s.metadata.shard_offsets for s in ours.local_shards()]]
    if rank != 0:
        assert list(ours.process_group.ranks) == [1, 2]
        assert torch.equal(ours.full_tensor(), full)
    # shardwise -> torch on the subgroup (torch's own gather cannot run there: it indexes a list of the
    # group's size by global rank), read back through from_torch.
    mine = shardwise.sharded_tensor.zeros(ChunkShardingSpec(0, ["rank:1/cpu", "rank:2/cpu"]), 3, 2, process_group=sub)
    with torch.no_grad():
        for shard in mine.local_shards():
            shard.tensor.copy_(box(full[:3], shard.metadata))
    as_torch = to_torch(mine)
    assert all(a.tensor is b.tensor for a, b in zip(as_torch.local_shards(), mine.local_shards(), strict=True))
    assert [_key(m) for m in as_torch.metadata().shards_metadata] == [_key(m) for m in mine.metadata().shards_metadata]
    if rank != 0:
        assert as_torch._process_group is sub
        assert torch.equal(from_torch(as_torch).full_tensor(), full[:3])
    seen.append([s.metadata.shard_offsets for s in as_torch.local_shards()])
    return seen


def test_a_subgroup_converts_with_global_placements_and_no_shards_outside() -> None:
    # rank:2 holds rows 0..2 of the first tensor and rank:1 rows 0..1 of the second: global ranks in both.
    assert run(subgroup_rank, 3) == [[[], []], [[[3, 0]], [[0, 0]]], [[[0, 0]], [[2, 0]]]]
