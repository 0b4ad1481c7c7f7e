"""FSDP2 (fully_shard) state dicts to shardwise and back, on real gloo ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from fsdp_helpers import chunks, load_into_shardwise, one_step, small_model
from shardwise_fsdp import state_dict_from_dtensors, state_dict_to_dtensors
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import shardwise
import shardwise.checkpoint
from shardwise.testing import run_ranks


def _fsdp2_trained() -> torch.nn.Module:
    """An FSDP2 model after one training step."""
    model = small_model(0)
    fully_shard(model)
    return one_step(model)


def save_rank(path: str) -> dict[str, Any]:
    model = _fsdp2_trained()
    sd = model.state_dict()
    converted = state_dict_from_dtensors(sd)
    shared = all(
        converted[k].local_shards()[0].tensor.data_ptr() == sd[k].to_local().data_ptr()
        for k in sd
        if converted[k].local_shards() and sd[k].to_local().numel()
    )
    shardwise.checkpoint.save({"model": converted, "step": 1}, path)
    return {"full": {k: v.full_tensor() for k, v in sd.items()}, "shared": shared,
            "types": sorted({type(v).__name__ for v in converted.values()})}


def load_rank(path: str) -> dict[str, torch.Tensor]:
    # small_model(1): other values, to be overwritten.
    return load_into_shardwise(small_model(1), path, {"0": chunks(1), "2": chunks(0)}, extra={"step": 0})


def test_an_fsdp2_checkpoint_loads_into_a_shardwise_model_on_another_world_size(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    saved = run_ranks(save_rank, 2, backend="gloo", args=(path,), timeout=120)
    assert all(s["shared"] for s in saved) and saved[0]["types"] == ["ShardedTensor"]
    truth = saved[0]["full"]
    for loaded in run_ranks(load_rank, 3, backend="gloo", args=(path,), timeout=120):
        assert loaded.keys() == truth.keys()
        for key in truth:
            assert torch.equal(loaded[key], truth[key]), key


def round_trip_rank() -> dict[str, Any]:
    model = _fsdp2_trained()
    sd = model.state_dict()
    mesh = model[0].weight.device_mesh
    back = state_dict_to_dtensors(state_dict_from_dtensors(sd), device_mesh=mesh)
    found = {
        "dtensors": all(isinstance(v, DTensor) for v in back.values()),
        "placements": all(back[k].placements == sd[k].placements for k in sd),
        "values": all(torch.equal(back[k].full_tensor(), sd[k].full_tensor()) for k in sd),
        "shared": all(back[k].to_local().data_ptr() == sd[k].to_local().data_ptr()
                      for k in sd if sd[k].to_local().numel()),
    }
    fresh = small_model(2)
    fully_shard(fresh)
    fresh.load_state_dict(back)
    found["loaded"] = all(torch.equal(fresh.state_dict()[k].full_tensor(), sd[k].full_tensor()) for k in sd)
    return found


def test_fsdp2_state_dict_round_trips_through_shardwise() -> None:
    for found in run_ranks(round_trip_rank, 2, backend="gloo", timeout=120):
        assert all(found.values()), found
