"""State-dict hooks of modules with ShardedTensor parameters.

``state_dict_hook`` and ``pre_load_state_dict_hook`` are torch 2.13's names
(re-exported by ``shardwise.sharded_tensor``). Beyond torch, a dense state
dict loads into a module with ShardedTensor parameters (each rank copies its
shards' slices; :func:`ensure_dense_load_hook` installs the hook that
``shard_parameter`` registers), and so does a state dict of torch 2.13's own
ShardedTensors (``torch.save``, FSDP1's ``SHARDED_STATE_DICT``): each is
converted and resharded to the parameter's layout.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardwise._tensor.sharded_tensor import ShardedTensor
from shardwise._tensor.torch_interop import is_torch_sharded_tensor, load_torch_sharded_tensor
from shardwise._vocab.metadata import ShardedTensorMetadata, TensorProperties
from shardwise._vocab.shard import Shard

__all__ = ["ensure_dense_load_hook", "pre_load_state_dict_hook", "state_dict_hook"]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def state_dict_hook(module: nn.Module, destination: Any, prefix: str, local_metadata: Any) -> None:
    """Add the ShardedTensor attributes of ``module`` and its submodules to its state dict.

    ShardedTensor *parameters* are in the state dict anyway; this covers
    ShardedTensors set as plain attributes. Register it with
    ``module._register_state_dict_hook(state_dict_hook)``.
    """
    for sub_name, sub in module.named_modules():
        for attr_name, attr in vars(sub).items():
            if isinstance(attr, ShardedTensor):
                destination[_join(prefix + sub_name, attr_name)] = attr


def pre_load_state_dict_hook(
    module: nn.Module,
    state_dict: Any,
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """Set ShardedTensor attributes of ``module`` and its submodules from the state dict.

    The counterpart of :func:`state_dict_hook`. The entries it takes are
    removed from the (copied) state dict, so ``strict=True`` does not
    report them as unexpected (torch 2.13 left them, which needed
    ``strict=False``). Register it with
    ``module.register_load_state_dict_pre_hook(pre_load_state_dict_hook)``.
    """
    for sub_name, sub in module.named_modules():
        for attr_name in list(vars(sub)):
            key = _join(prefix + sub_name, attr_name)
            if isinstance(state_dict.get(key), ShardedTensor):
                setattr(sub, attr_name, state_dict.pop(key))


def _as_sharded_like(dense: torch.Tensor, like: ShardedTensor) -> ShardedTensor:
    """``dense`` cut into ``like``'s layout, from this rank's slices (no communication)."""
    shards = []
    for shard in like.local_shards():
        md = shard.metadata
        index = tuple(slice(o, o + s) for o, s in zip(md.shard_offsets, md.shard_sizes, strict=True))
        piece = dense.detach()[index].to(device=shard.tensor.device).contiguous()
        shards.append(Shard(piece, md))
    props = TensorProperties(dtype=dense.dtype, layout=torch.strided, requires_grad=False)
    metadata = ShardedTensorMetadata(list(like.metadata().shards_metadata), like.size(), props)
    return ShardedTensor._create(like.sharding_spec(), metadata, shards, like.process_group)


def _load_dense_into_sharded(module: nn.Module, state_dict: Any, prefix: str, *args: Any) -> None:
    """Load pre-hook: a dense entry for a ShardedTensor parameter becomes that layout's slices.

    An entry that is torch 2.13's own ShardedTensor (``torch.save`` of torch's
    state dicts, FSDP1's ``SHARDED_STATE_DICT``) is converted and, when its
    shards are laid out otherwise, resharded to the parameter's layout.
    """
    for name, param in module._parameters.items():
        value = state_dict.get(prefix + name)
        if isinstance(param, ShardedTensor) and is_torch_sharded_tensor(value):
            # A size mismatch is left for torch's own "size mismatch" report.
            if list(value.metadata().size) == list(param.shape):
                state_dict[prefix + name] = load_torch_sharded_tensor(value, param)
        elif (
            isinstance(param, ShardedTensor)
            and isinstance(value, torch.Tensor)
            and not isinstance(value, ShardedTensor)
            and value.shape == param.shape
        ):
            state_dict[prefix + name] = _as_sharded_like(value, param)


def ensure_dense_load_hook(module: nn.Module) -> None:
    hooks = module._load_state_dict_pre_hooks.values()
    if not any(getattr(h, "hook", None) is _load_dense_into_sharded for h in hooks):
        module.register_load_state_dict_pre_hook(_load_dense_into_sharded)
