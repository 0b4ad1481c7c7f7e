"""FSDP1's SHARDED_STATE_DICT without shardwise's extension (torch's own ShardedTensors) into a shardwise model."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from fsdp_helpers import chunks, one_step, small_model
from torch.distributed._shard.sharded_tensor import ShardedTensor as TorchShardedTensor
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import StateDictType

import shardwise
from shardwise import ShardedTensor, ShardingPlan
from shardwise.testing import run_ranks


def _whole(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: v.full_tensor() if isinstance(v, ShardedTensor) else v.detach().clone() for k, v in model.state_dict().items()
    }


def torch_sharded_state_dict_rank(path: str) -> list[str]:
    model = one_step(FSDP(small_model(0), device_id=torch.device("cpu")))  # no install(): torch's tensors
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        truth = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sd = model.state_dict()
    assert all(isinstance(v, TorchShardedTensor) for v in sd.values()), {k: type(v) for k, v in sd.items()}
    file = Path(path) / f"fsdp1_{dist.get_rank()}.pt"
    torch.save(sd, file)

    loaded = []
    for source in ("in memory", "torch.load"):
        state = sd if source == "in memory" else torch.load(file, weights_only=False)
        # Every parameter sharded by shardwise, none as FSDP cut it (dim-0 chunks in rank order).
        target = small_model(2)
        plan = {"0.weight": chunks(1), "0.bias": chunks(0, reverse=True), "2.weight": chunks(1, reverse=True),
                "2.bias": chunks(0, reverse=True)}
        shardwise.shard_module(target, ShardingPlan(plan=plan))
        target.load_state_dict(state)
        got = _whole(target)
        assert got.keys() == truth.keys()
        for key, value in truth.items():
            assert torch.equal(got[key], value), (source, key)
        loaded.append(source)
    return loaded


def test_an_fsdp1_sharded_state_dict_of_torch_tensors_loads_into_a_shardwise_model(tmp_path: Path) -> None:
    results = run_ranks(torch_sharded_state_dict_rank, 2, backend="gloo", args=(str(tmp_path),), timeout=120)
    assert results == [["in memory", "torch.load"]] * 2
