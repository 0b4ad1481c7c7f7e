"""The shared test helpers upstream imports from ``torch.testing._internal.distributed._shard``, ported.

torch's own copies import ``torch.distributed._shard`` directly and place
shards on ``cuda:R``; these go through :mod:`suite_target` and place shards
on ``cpu`` (``rank:R/cpu``), the only change.
"""

from __future__ import annotations

import copy
import random
from typing import Any, Optional

import torch
import torch.nn as nn
from suite_target import load

sharded_tensor = load("sharded_tensor")
ChunkShardingSpec, EnumerableShardingSpec, ShardMetadata = load(
    "sharding_spec", "ChunkShardingSpec", "EnumerableShardingSpec", "ShardMetadata"
)
get_chunked_dim_size, get_split_size = load("sharding_spec._internals", "get_chunked_dim_size", "get_split_size")

__all__ = [
    "DEVICE",
    "MyShardedModel1",
    "MyShardedModel2",
    "PLACEMENTS",
    "SimpleMegatronLM",
    "_chunk_sharding_specs_list_for_test",
    "clone_module_parameter",
    "generate_chunk_sharding_specs_for_test",
    "generate_enumerable_sharding_specs_for_test",
    "generate_local_weight_sharding_params_for_test",
]

#: Where upstream's ``cuda:R`` goes in the CPU port.
DEVICE = torch.device("cpu")

# ---------------------------------------------------------------- _test_st_common

PLACEMENTS = [
    "rank:0/cpu",
    "rank:1/cpu",
    "rank:2/cpu",
    "rank:3/cpu",
]

DEFAULT_GPU_NUM = 4


def _chunk_sharding_specs_list_for_test(sharding_dims: list[int], seed: int = 0) -> list[Any]:
    # Upstream shuffles its module-level list in place (each call continues
    # from the previous order); kept, so the specs match upstream's exactly.
    spec_list = []
    for i in range(len(sharding_dims)):
        random.Random(seed + i).shuffle(PLACEMENTS)
        spec_list.append(ChunkShardingSpec(dim=sharding_dims[i], placements=copy.deepcopy(PLACEMENTS)))
    return spec_list


class MyShardedModel2(torch.nn.Module):
    def __init__(self, spec: Any = None, group: Any = None, init_rrefs: bool = True) -> None:
        super().__init__()
        if spec is not None:
            self.sharded_tensor2 = sharded_tensor.rand(spec, 10, 20, process_group=group, init_rrefs=init_rrefs)
        else:
            self.sharded_tensor2 = None
        self.random_tensor2 = torch.nn.Parameter(torch.rand(2, 2))


class MyShardedModel1(torch.nn.Module):
    def __init__(self, spec: Any = None, group: Any = None, init_rrefs: bool = True) -> None:
        super().__init__()
        if spec is not None:
            self.sharded_tensor1 = sharded_tensor.rand(spec, 10, 20, process_group=group, init_rrefs=init_rrefs)
        else:
            self.sharded_tensor1 = None
        self.random_tensor1 = torch.nn.Parameter(torch.rand(2, 2))
        self.submodule = MyShardedModel2(spec, group, init_rrefs)


# ---------------------------------------------------------------- _test_ops_common


def generate_chunk_sharding_specs_for_test(sharding_dim: int) -> list[Any]:
    return [
        ChunkShardingSpec(dim=sharding_dim, placements=["rank:0/cpu", "rank:1/cpu", "rank:2/cpu", "rank:3/cpu"]),
        # Test different ordering. (Case 1)
        ChunkShardingSpec(dim=sharding_dim, placements=["rank:2/cpu", "rank:3/cpu", "rank:0/cpu", "rank:1/cpu"]),
        # Test different ordering. (Case 2)
        ChunkShardingSpec(dim=sharding_dim, placements=["rank:3/cpu", "rank:0/cpu", "rank:1/cpu", "rank:2/cpu"]),
    ]


def generate_enumerable_sharding_specs_for_test() -> list[Any]:
    return [
        EnumerableShardingSpec(
            [
                ShardMetadata(shard_offsets=[0, 0], shard_sizes=[5, 5], placement="rank:0/cpu"),
                ShardMetadata(shard_offsets=[5, 0], shard_sizes=[5, 5], placement="rank:1/cpu"),
                ShardMetadata(shard_offsets=[0, 5], shard_sizes=[5, 5], placement="rank:2/cpu"),
                ShardMetadata(shard_offsets=[5, 5], shard_sizes=[5, 5], placement="rank:3/cpu"),
            ]
        )
    ]


def generate_local_weight_sharding_params_for_test(
    local_weight: torch.Tensor, sharded_dim: int, gpu_num: int, spec: Any, rank: int
) -> tuple[int, int]:
    """Start and length along ``sharded_dim`` of ``rank``'s chunk of ``local_weight`` under ``spec``."""
    sharding_dim_size = local_weight.size(sharded_dim)
    split_size = get_split_size(sharding_dim_size, gpu_num)
    current_offsets = 0
    start_pos = current_offsets
    for idx, placement in enumerate(spec.placements):
        chunk_size = get_chunked_dim_size(sharding_dim_size, split_size, idx)
        if rank == placement.rank():
            start_pos = current_offsets
            break
        current_offsets += chunk_size
    return start_pos, chunk_size


def clone_module_parameter(module: nn.Module, param_name: str) -> nn.Parameter:
    tensor = getattr(module, param_name)
    return torch.nn.Parameter(tensor.detach().clone())


# ---------------------------------------------------------------- test_common


class SimpleMegatronLM(nn.Module):
    def __init__(self, linear_size: Any, rank: Optional[int] = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(*linear_size[0], dtype=dtype)
        self.gelu = nn.GELU()
        self.fc2 = nn.Linear(*linear_size[1], dtype=dtype)
        if rank is not None:
            # upstream: .cuda(rank)
            self.fc1.to(DEVICE)
            self.fc2.to(DEVICE)

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.gelu(self.fc1(inp)))
