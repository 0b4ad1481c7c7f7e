"""2-D FSDP1 + tensor parallel on a 2 x 2 mesh of gloo ranks, with ShardwiseFSDPExtensions.

Ranks 0..3 sit on the mesh ``[[0, 1], [2, 3]]`` (dims ``dp``, ``tp``): the
tensor-parallel groups are {0, 1} and {2, 3}, the FSDP groups {0, 2} and
{1, 3}. So rank ``r`` holds TP shard ``r % 2`` and, of it, FSDP chunk ``r // 2``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.fsdp.fully_sharded_data_parallel as fsdp_impl
from fsdp_helpers import chunks, load_into_shardwise, one_step, tensor_parallel, tp_model
from shardwise_fsdp import ShardwiseFSDPExtensions, install, install_on_wrap
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import StateDictType

import shardwise
import shardwise.checkpoint
from shardwise import ShardedTensor
from shardwise.testing import run_ranks


def _mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _wrapped(seed: int) -> torch.nn.Module:
    """tp_model(seed), tensor parallel over ``tp`` and FSDP1 over the ``dp`` process group."""
    mesh = _mesh()
    model = tensor_parallel(tp_model(seed), mesh["tp"])
    with install_on_wrap():
        return FSDP(model, process_group=mesh["dp"].get_group(), device_id=torch.device("cpu"), use_orig_params=True)


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                for k, v in model.state_dict().items()}


def _boxes(st: ShardedTensor) -> list[list[int]]:
    return [list(m.shard_offsets) + list(m.shard_sizes) for m in st.metadata().shards_metadata]


def save_rank(path: str) -> dict[str, Any]:
    model = one_step(_wrapped(0))
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sd = model.state_dict()
    found: dict[str, Any] = {}
    for key, value in sd.items():
        local = value.local_shards()
        inner = local[0].tensor if isinstance(local[0].tensor, ShardedTensor) else None
        unwrapped, shards = ShardwiseFSDPExtensions().pre_load_state_dict_transform(value)
        found[key] = {
            "outer": _boxes(value),
            "outer_group": value.process_group.size,
            "inner": None if inner is None else _boxes(inner),
            "unwrapped": unwrapped is (inner if inner is not None else value),
            "shards": [list(s.tensor.shape) for s in shards],
            "chunks": [list(c.offsets) + list(c.sizes) for c in value.__create_chunk_list__()],
            "whole": value.full_tensor(),
        }
    shardwise.checkpoint.save({"model": sd}, path)
    return {"state": found, "full": _full(model)}


def load_rank(path: str) -> dict[str, torch.Tensor]:
    model = _wrapped(1)  # other values, to be overwritten
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict()}
        shardwise.checkpoint.load(state, path)
        model.load_state_dict(state["model"])
    return _full(model)


def load_into_shardwise_rank(path: str) -> dict[str, torch.Tensor]:
    return load_into_shardwise(tp_model(2), path, {"0": chunks(1), "2": chunks(0, reverse=True)})


def test_fsdp_over_tensor_parallel_nests_state_dicts_that_round_trip(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    saved = run_ranks(save_rank, 4, backend="gloo", args=(path,), timeout=180)
    truth = saved[0]["full"]
    # The same step on the unsharded model gives the same values (up to the TP sums' order).
    dense = one_step(tp_model(0)).state_dict()
    for key in truth:
        torch.testing.assert_close(truth[key], dense[key], rtol=1e-5, atol=1e-6)
    for rank, found in enumerate(saved):
        state, (dp, tp) = found["state"], divmod(rank, 2)
        # Column-parallel weight: TP halves of 8 rows over the TP group, FSDP chunks of 4 rows inside.
        weight = state["0.weight"]
        assert weight["outer"] == [[0, 0, 4, 5], [4, 0, 4, 5]] and weight["outer_group"] == 2
        assert weight["inner"] == [[0, 0, 2, 5], [2, 0, 2, 5]]
        assert weight["chunks"] == [[4 * tp + 2 * dp, 0, 2, 5]]
        # Row-parallel weight: TP halves of 8 columns, FSDP chunks 2 + 1 of its 3 rows.
        row = state["2.weight"]
        assert row["outer"] == [[0, 0, 3, 4], [0, 4, 3, 4]]
        assert row["inner"] == [[0, 0, 2, 4], [2, 0, 1, 4]]
        assert row["chunks"] == [[2 * dp, 4 * tp, 2 - dp, 4]]
        assert row["unwrapped"] and row["shards"] == [[2 - dp, 4]]
        # The replicated bias is chunked as a plain tensor over the FSDP group.
        bias = state["2.bias"]
        assert bias["inner"] is None and bias["outer"] == [[0, 2], [2, 1]] and bias["unwrapped"]
        for key, value in state.items():
            assert torch.equal(value["whole"], truth[key]), (rank, key)
    for loaded in run_ranks(load_rank, 4, backend="gloo", args=(path,), timeout=180):
        assert loaded.keys() == truth.keys()
        for key in truth:
            assert torch.equal(loaded[key], truth[key]), key
    for loaded in run_ranks(load_into_shardwise_rank, 3, backend="gloo", args=(path,), timeout=180):
        for key in truth:
            assert torch.equal(loaded[key], truth[key]), key


def device_mesh_rank(path: str) -> dict[str, Any]:
    """FSDP1 given the ``dp`` mesh (DTensor state dicts), then ShardwiseFSDPExtensions installed."""
    import torch.distributed.checkpoint as dcp

    def build(seed: int) -> tuple[torch.nn.Module, Any]:
        mesh = _mesh()
        model = FSDP(tensor_parallel(tp_model(seed), mesh["tp"]), device_mesh=mesh["dp"],
                     device_id=torch.device("cpu"), use_orig_params=True)
        return model, install(model)

    model, ext = build(0)
    one_step(model)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sd = model.state_dict()
        placements = {k: [str(p) for p in v.placements] for k, v in sd.items()}
        dcp.save(sd, checkpoint_id=path)
    fresh, _ = build(1)
    with FSDP.state_dict_type(fresh, StateDictType.SHARDED_STATE_DICT):
        sd = fresh.state_dict()
        dcp.load(sd, checkpoint_id=path)
        fresh.load_state_dict(sd)
    truth, got = _full(model), _full(fresh)
    return {"tp": ext.tensor_parallel, "placements": placements, "equal": {k: torch.equal(got[k], truth[k]) for k in truth}}


def test_fsdp_given_a_tensor_parallel_mesh_keeps_dtensor_state_dicts(tmp_path: Path) -> None:
    for found in run_ranks(device_mesh_rank, 4, backend="gloo", args=(str(tmp_path / "ckpt"),), timeout=180):
        assert found["tp"] is True
        assert found["placements"]["2.weight"] == ["S(0)", "S(1)"]
        assert found["placements"]["2.bias"] == ["S(0)", "R"]
        assert all(found["equal"].values()), found["equal"]


def refusals_rank() -> dict[str, str]:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard

    ext, pg = ShardwiseFSDPExtensions(), torch.distributed.group.WORLD
    found = {}
    flat = DTensor.from_local(torch.ones(2, 2), init_device_mesh("cpu", (2,)), [Partial()], run_check=False)
    square = DTensor.from_local(torch.ones(2, 2), init_device_mesh("cpu", (1, 2)), [Partial()] * 2, run_check=False)
    # Ranks listed backwards: DTensor's chunk order there is not the group's rank order.
    backwards = DTensor.from_local(torch.ones(2, 2), DeviceMesh("cpu", torch.tensor([1, 0])), [Shard(0)],
                                   run_check=False)
    for name, tensor in {"partial": flat, "2-D mesh": square, "backwards": backwards}.items():
        try:
            ext.chunk_tensor(tensor, torch.distributed.get_rank(), 2, 0, pg)
            found[name] = "no error"
        except ValueError as e:
            found[name] = str(e)
    return found


def test_chunk_tensor_refuses_partial_multi_dim_and_unordered_parameters() -> None:
    for found in run_ranks(refusals_rank, 2, backend="gloo", timeout=120):
        assert "Partial" in found["partial"] and "redistribute" in found["partial"]
        assert "2-D mesh" in found["2-D mesh"] and "1-D tensor-parallel mesh" in found["2-D mesh"]
        assert "ascending" in found["backwards"], found["backwards"]


def test_install_on_wrap_restores_fsdp_on_exit_even_after_an_error() -> None:
    original = fsdp_impl._init_extension
    with pytest.raises(RuntimeError, match="boom"):
        with install_on_wrap() as ext:
            assert isinstance(ext, ShardwiseFSDPExtensions)
            assert fsdp_impl._init_extension is not original
            raise RuntimeError("boom")
    assert fsdp_impl._init_extension is original
