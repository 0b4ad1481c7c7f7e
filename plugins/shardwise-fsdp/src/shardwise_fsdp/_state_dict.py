"""Whole state dicts between FSDP2 (DTensor parameters) and shardwise (ShardedTensor parameters).

``fully_shard`` models keep every parameter as a DTensor sharded on dim 0
over the mesh, and their ``state_dict()`` holds those DTensors. Converting
each one with :func:`~shardwise_fsdp.from_dtensor` gives a state dict of
ShardedTensors (sharing storage with the model) that
``shardwise.checkpoint.save`` writes and that loads into a shardwise-sharded
model on any number of ranks and any spec; the reverse turns a shardwise
model's state dict into DTensors an FSDP2 model's ``load_state_dict`` takes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Optional

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from shardwise import ShardedTensor
from shardwise_fsdp._dtensor import from_dtensor, to_dtensor

__all__ = ["state_dict_from_dtensors", "state_dict_to_dtensors"]


def _map(value: Any, convert: Callable[[Any], Any], kind: type) -> Any:
    if isinstance(value, kind):
        return convert(value)
    if isinstance(value, Mapping):
        return {k: _map(v, convert, kind) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map(v, convert, kind) for v in value)
    return value


def state_dict_from_dtensors(state_dict: Mapping[str, Any], process_group: Any = None) -> dict[str, Any]:
    """``state_dict`` with every DTensor (at any depth) replaced by :func:`from_dtensor` of it.

    Other values are kept as they are (the same objects). Every rank calls it
    with its own state dict.
    """
    converted: dict[str, Any] = _map(state_dict, lambda dt: from_dtensor(dt, process_group), DTensor)
    return converted


def state_dict_to_dtensors(state_dict: Mapping[str, Any], device_mesh: Optional[DeviceMesh] = None) -> dict[str, Any]:
    """``state_dict`` with every ShardedTensor (at any depth) replaced by :func:`to_dtensor` of it.

    Args:
        state_dict: A state dict holding ShardedTensors.
        device_mesh: The mesh every DTensor should use (an FSDP2 model's
            ``model.weight.device_mesh``); None: one built per tensor from its
            placements.
    """
    converted: dict[str, Any] = _map(state_dict, lambda st: to_dtensor(st, device_mesh), ShardedTensor)
    return converted
