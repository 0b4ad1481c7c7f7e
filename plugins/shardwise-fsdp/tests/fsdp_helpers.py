"""The small model the FSDP tests wrap, and one training step that moves it away from its init."""

from __future__ import annotations

from typing import Any

import torch


def small_model(seed: int) -> torch.nn.Module:
    """Linear(5, 7) -> ReLU -> Linear(7, 3), the same on every rank for a seed (7 and 3 rows: uneven chunks)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))


def one_step(model: torch.nn.Module) -> torch.nn.Module:
    """One SGD step on a batch every rank shares, so the values are not the init; returns ``model``."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.linspace(-1, 1, 20).reshape(4, 5)).pow(2).sum().backward()
    opt.step()
    return model


def tp_model(seed: int) -> torch.nn.Module:
    """Linear(5, 8) -> ReLU -> Linear(8, 3): Megatron-style column then row parallel on a 2-rank TP mesh.

    8 columns split evenly, as DTensor needs to flatten; the row-parallel
    layer's 3 rows give FSDP uneven chunks (2 + 1) and its bias is replicated.
    """
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def tensor_parallel(model: torch.nn.Module, tp_mesh: Any) -> torch.nn.Module:
    """``model`` (a :func:`tp_model`) with layer 0 column- and layer 2 row-parallel over ``tp_mesh``."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    return parallelize_module(model, tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def load_into_shardwise(model: torch.nn.Module, path: str, specs: dict[str, Any], extra: Any = None) -> dict[str, Any]:
    """Shard ``model``'s layers by ``specs`` (``{"0": spec, ...}`` for their weights), load ``path`` into it.

    Args:
        extra: Other top-level checkpoint entries to load beside ``"model"``.

    Returns:
        Every state dict value, whole.
    """
    import shardwise.checkpoint
    from shardwise import ShardedTensor, shard_parameter

    for layer, spec in specs.items():
        shard_parameter(model.get_submodule(layer), "weight", spec)
    state = {"model": model.state_dict(), **(extra or {})}
    shardwise.checkpoint.load(state, path)
    return {k: v.full_tensor() if isinstance(v, ShardedTensor) else v.detach().clone()
            for k, v in model.state_dict().items()}


def chunks(dim: int, reverse: bool = False) -> Any:
    """A ChunkShardingSpec on ``dim`` over every rank of the default group (in reverse order if asked)."""
    import shardwise
    from shardwise import ChunkShardingSpec

    ranks = range(shardwise.get_default_group().size)
    return ChunkShardingSpec(dim=dim, placements=[f"rank:{r}/cpu" for r in (reversed(ranks) if reverse else ranks)])
