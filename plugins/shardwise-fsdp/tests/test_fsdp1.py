"""FSDP1 with ShardwiseFSDPExtensions on real gloo ranks: sharded state dicts of shardwise tensors, round trips."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from fsdp_helpers import chunks, load_into_shardwise, one_step, small_model
from shardwise_fsdp import ShardwiseFSDPExtensions, install
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import StateDictType

import shardwise
import shardwise.checkpoint
from shardwise import ShardedTensor
from shardwise.testing import run_ranks


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _trained(seed: int) -> torch.nn.Module:
    """An FSDP1 model with the shardwise extension, after one training step."""
    model = FSDP(small_model(seed), device_id=torch.device("cpu"))
    install(model)
    return one_step(model)


def save_rank(path: str) -> dict[str, Any]:
    model = _trained(0)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sd = model.state_dict()
    kinds = sorted({f"{type(v).__module__}.{type(v).__name__}" for v in sd.values()})
    chunks = {k: [list(m.shard_offsets) + list(m.shard_sizes) for m in v.metadata().shards_metadata]
              for k, v in sd.items() if isinstance(v, ShardedTensor)}
    shardwise.checkpoint.save({"model": sd}, path)
    return {"kinds": kinds, "chunks": chunks, "full": _full(model)}


def load_rank(path: str) -> dict[str, torch.Tensor]:
    model = FSDP(small_model(1), device_id=torch.device("cpu"))  # other values, to be overwritten
    install(model)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sd = model.state_dict()
        state = {"model": sd}
        shardwise.checkpoint.load(state, path)
        model.load_state_dict(state["model"])
    return _full(model)


def test_sharded_state_dict_holds_shardwise_tensors_and_round_trips(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    saved = run_ranks(save_rank, 2, backend="gloo", args=(path,), timeout=120)
    assert saved[0]["kinds"] == ["shardwise.sharded_tensor.ShardedTensor"]  # not torch._shard's
    # torch.chunk on dim 0: 7 rows -> 4 + 3, 3 rows -> 2 + 1.
    assert saved[0]["chunks"]["0.weight"] == [[0, 0, 4, 5], [4, 0, 3, 5]]
    assert saved[0]["chunks"]["2.bias"] == [[0, 2], [2, 1]]
    truth = saved[0]["full"]
    for loaded in run_ranks(load_rank, 2, backend="gloo", args=(path,), timeout=120):
        assert loaded.keys() == truth.keys()
        for key in truth:
            assert torch.equal(loaded[key], truth[key]), key


def load_into_shardwise_rank(path: str) -> dict[str, torch.Tensor]:
    return load_into_shardwise(small_model(2), path, {"0": chunks(1)})


def test_an_fsdp1_checkpoint_loads_into_a_shardwise_model_on_three_ranks(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    truth = run_ranks(save_rank, 2, backend="gloo", args=(path,), timeout=120)[0]["full"]
    for loaded in run_ranks(load_into_shardwise_rank, 3, backend="gloo", args=(path,), timeout=120):
        for key in truth:
            assert torch.equal(loaded[key], truth[key]), key


def test_install_refuses_a_module_without_fsdp() -> None:
    with pytest.raises(TypeError, match="FullyShardedDataParallel"):
        install(small_model(0))
    with pytest.raises(TypeError, match="FullyShardedDataParallel"):
        install("not a module")  # type: ignore[arg-type]


def test_extension_leaves_plain_tensors_and_refuses_other_entries() -> None:
    ext = ShardwiseFSDPExtensions()
    assert ext.pre_flatten_transform(torch.ones(2))[1] is None
    with pytest.raises(TypeError, match="ShardedTensor"):
        ext.pre_load_state_dict_transform(torch.ones(2))
