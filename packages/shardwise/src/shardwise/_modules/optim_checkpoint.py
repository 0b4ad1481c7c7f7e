"""A ShardedOptimizer's state in a form a checkpoint can reshard.

``ShardedOptimizer.state_dict()`` is per rank and keyed by shard box, so it
only loads back on the same sharding. Here each state tensor shaped like
its parameter's shard (Adam's ``exp_avg``, SGD's ``momentum_buffer``, ...)
becomes part of a ShardedTensor laid out exactly like the parameter, and a
checkpoint can then load it on any number of ranks and any spec, like the
parameter itself. State of another shape (Adam's scalar ``step``) and the
state of dense parameters is the same on every rank and saved once.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from shardwise._modules.optim import ShardedOptimizer, shard_key
from shardwise._tensor.sharded_tensor import ShardedTensor
from shardwise._vocab.metadata import TensorProperties
from shardwise._vocab.shard import Shard

__all__ = ["apply_loaded", "empty_targets", "optimizer_state"]


def _sharded_like(param: ShardedTensor, tensors: list[torch.Tensor], dtype: torch.dtype) -> ShardedTensor:
    """``tensors`` (one per local shard of ``param``, in order) as a ShardedTensor with ``param``'s layout."""
    md = param.metadata()
    props = TensorProperties(dtype=dtype, layout=md.tensor_properties.layout, requires_grad=False,
                             memory_format=md.tensor_properties.memory_format,
                             pin_memory=md.tensor_properties.pin_memory)
    global_md = dataclasses.replace(md, tensor_properties=props)
    shards = [Shard(t, s.metadata) for t, s in zip(tensors, param.local_shards(), strict=True)]
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, global_md, process_group=param.process_group, sharding_spec=param.sharding_spec()
    )


def optimizer_state(optimizer: ShardedOptimizer) -> dict[str, Any]:
    """The optimizer's state as ``{"state": {param name: {field: value}}, "param_groups": [...]}``.

    Shard-shaped state is a ShardedTensor over the parameter's shards;
    ``param_groups`` list parameter names, not shard boxes, so the result
    loads on another sharding (see :func:`shardwise._modules.checkpoint.load_optimizer`).

    Raises:
        ValueError: some local shards of a parameter have state and others
            not, or their state differs in fields.
    """
    saved = optimizer.state_dict()
    by_key = saved["state"]
    state: dict[str, dict[str, Any]] = {}
    for name, value in optimizer.named_params.items():
        if isinstance(value, ShardedTensor):
            keys = [shard_key(name, s.metadata.shard_offsets, s.metadata.shard_sizes) for s in value.local_shards()]
            found = [by_key.get(k) for k in keys]
            if all(f is None for f in found):
                continue
            if any(f is None for f in found) or len({tuple(sorted(f)) for f in found if f is not None}) > 1:
                raise ValueError(f"optimizer state of {name!r}: its local shards do not all have the same fields")
            entries: dict[str, Any] = {}
            for field_name, first in found[0].items():
                values = [f[field_name] for f in found]
                shaped = all(
                    torch.is_tensor(v) and tuple(v.shape) == tuple(s.tensor.shape)
                    for v, s in zip(values, value.local_shards(), strict=True)
                )
                if shaped and value.local_shards():
                    entries[field_name] = _sharded_like(value, values, first.dtype)
                else:
                    entries[field_name] = first  # the same on every shard and rank (a step count)
            state[name] = entries
        elif name in by_key:
            state[name] = dict(by_key[name])
    # Names from the groups as given, not from the local shards: a rank holding no shard of a parameter
    # must still list it, or the copy DCP keeps (one rank's) would depend on which rank wrote it.
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": names}
        for group, names in zip(saved["param_groups"], optimizer.group_param_names(), strict=True)
    ]
    return {"state": state, "param_groups": groups}


def empty_targets(optimizer: ShardedOptimizer, saved: dict[str, Any]) -> dict[str, Any]:
    """Zero tensors to load into, laid out like the optimizer's parameters now.

    Args:
        saved: ``{param name: {field: (global size, dtype) or None}}`` from the
            checkpoint's metadata (None: a non-tensor value).
    """
    state: dict[str, dict[str, Any]] = {}
    for name, fields in saved.items():
        value = optimizer.named_params.get(name)
        if value is None:
            raise ValueError(f"the checkpoint has optimizer state for {name!r}, which this optimizer does not have")
        entries: dict[str, Any] = {}
        for field_name, spec in fields.items():
            if spec is None:
                entries[field_name] = None
                continue
            size, dtype = spec
            if isinstance(value, ShardedTensor) and list(size) == list(value.size()):
                zeros = [torch.zeros(s.tensor.shape, dtype=dtype) for s in value.local_shards()]
                entries[field_name] = _sharded_like(value, zeros, dtype)
            else:
                entries[field_name] = torch.zeros(size, dtype=dtype)
        state[name] = entries
    return state


def apply_loaded(optimizer: ShardedOptimizer, state: dict[str, Any], groups: list[dict[str, Any]]) -> None:
    """Give ``optimizer`` the loaded ``state`` (by parameter name) and ``groups`` (names), on its own sharding."""
    by_key: dict[str, dict[str, Any]] = {}
    keys_of: dict[str, list[str]] = {}
    for name, value in optimizer.named_params.items():
        if isinstance(value, ShardedTensor):
            keys_of[name] = []
            for i, shard in enumerate(value.local_shards()):
                key = shard_key(name, shard.metadata.shard_offsets, shard.metadata.shard_sizes)
                keys_of[name].append(key)
                if name in state:
                    by_key[key] = {f: _local_piece(v, i) for f, v in state[name].items()}
        else:
            keys_of[name] = [name]
            if name in state:
                by_key[name] = dict(state[name])
    inner_groups = []
    for group in groups:
        missing = [n for n in group["params"] if n not in keys_of]
        if missing:
            raise ValueError(f"the checkpoint's param groups name parameters this optimizer lacks: {missing}")
        keys = [k for n in group["params"] for k in keys_of[n]]
        inner_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": keys})
    optimizer.load_state_dict({"state": by_key, "param_groups": inner_groups})


def _local_piece(value: Any, i: int) -> Optional[Any]:
    if isinstance(value, ShardedTensor):
        return value.local_shards()[i].tensor
    return value.clone() if torch.is_tensor(value) else value
