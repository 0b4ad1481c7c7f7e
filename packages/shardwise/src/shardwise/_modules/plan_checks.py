"""Checks on sharding plans and planned parameters, made before any data moves.

Everything here is local to a rank; :func:`shardwise.shard_module` exchanges
the outcome so that a failure on one rank raises on every rank.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import nn

from shardwise._modules.plan import ShardingPlan
from shardwise._modules.sharder import Sharder
from shardwise._tensor.sharded_tensor import ShardedTensor
from shardwise._tensor.specs import ShardingSpec

__all__ = [
    "check_parameter",
    "deferred",
    "find_module",
    "inside",
    "plan_fingerprint",
    "requires_grad_of",
    "resolve_after_sharding",
    "validate_plan",
]


def inside(path: str, root: str) -> bool:
    """Whether module ``path`` is ``root`` or lies in its subtree (by path component)."""
    return path == root or path.startswith(root + ".")


def check_parameter(module: nn.Module, param_name: str, where: str = "") -> torch.Tensor:
    """The dense parameter ``module.<param_name>``, checked as shard_parameter needs it.

    Raises:
        TypeError: ``module`` is not an nn.Module.
        AttributeError: no such attribute (as torch 2.13).
        ValueError: it is not a tensor (as torch 2.13), already sharded,
            or not contiguous (as torch 2.13).
        KeyError: it is a buffer or a plain attribute rather than a
            parameter (torch 2.13's error, raised there after scattering).
    """
    label = f"{where}: " if where else ""
    if not isinstance(module, nn.Module):
        raise TypeError(f"{label}expected an nn.Module, got {type(module).__name__}")
    if not hasattr(module, param_name):
        raise AttributeError(f"{label}{module._get_name()} has no attribute `{param_name}`")
    tensor = getattr(module, param_name)
    owner = f"{type(module).__name__}.{param_name}"
    if isinstance(tensor, ShardedTensor):
        raise ValueError(f"{label}{owner} is already a ShardedTensor; use its reshard(spec) to change the sharding")
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{label}Expected {owner} to be a Tensor, but found {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError(
            f"{label}param: {param_name} is not a contiguous Tensor; make it contiguous first "
            f"(module.{param_name} = nn.Parameter(module.{param_name}.contiguous()))"
        )
    if param_name not in module._parameters:
        # torch 2.13 scatters it and then fails in register_parameter with this KeyError; raised here
        # before any data moves, after the checks torch makes first.
        raise KeyError(
            f"{label}{owner} is a buffer or plain tensor attribute, not a parameter, so it cannot be replaced "
            f"by a sharded parameter (attribute '{param_name}' already exists); delete it and register an "
            "nn.Parameter, or use shard_tensor for other tensors"
        )
    return tensor


def find_module(root: nn.Module, path: str) -> Optional[nn.Module]:
    """``root.get_submodule(path)``, or None when there is no such submodule."""
    try:
        return root.get_submodule(path)
    except AttributeError:
        return None


def plan_fingerprint(plan: ShardingPlan, src_rank: int) -> dict[str, Any]:
    """JSON-safe description of the plan, compared across ranks."""
    entries = []
    for name, entry in plan.plan.items():
        if isinstance(entry, Sharder):
            entries.append([name, {"sharder": f"{type(entry).__module__}.{type(entry).__qualname__}"}])
        else:
            entries.append([name, entry.to_dict()])
    outputs = [[path, spec.to_dict()] for path, spec in (plan.output_plan or {}).items()]
    return {
        "plan": entries,
        "output_plan": outputs,
        "return_local_tensor": list(plan.return_local_tensor or []),
        "src_rank": src_rank,
    }


def requires_grad_of(module: nn.Module, plan: ShardingPlan) -> dict[str, bool]:
    """``requires_grad`` of each planned parameter (call after :func:`validate_plan`)."""
    return {
        name: bool(module.get_parameter(name).requires_grad)
        for name, entry in plan.plan.items()
        if isinstance(entry, ShardingSpec)
    }


def _check_plan_types(plan: Any) -> None:
    if not isinstance(plan, ShardingPlan):
        raise TypeError(f"shard_module expects a ShardingPlan, got {type(plan).__name__}")
    if not isinstance(plan.plan, dict):
        raise TypeError(f"ShardingPlan.plan must be a dict, got {type(plan.plan).__name__}")
    for name, entry in plan.plan.items():
        if not isinstance(name, str):
            raise TypeError(f"ShardingPlan.plan keys must be str, got {name!r}")
        if not isinstance(entry, (ShardingSpec, Sharder)):
            raise TypeError(
                f"Only `ShardingSpec` and `Sharder` are supported to shard '{name}', got {type(entry).__name__}"
            )
        if isinstance(entry, Sharder) and name == "":
            raise KeyError("Module path must not be empty for custom sharder!")
    if plan.output_plan is not None:
        if not isinstance(plan.output_plan, dict):
            raise TypeError(f"ShardingPlan.output_plan must be a dict or None, got {type(plan.output_plan).__name__}")
        for path, spec in plan.output_plan.items():
            if not isinstance(path, str):
                raise TypeError(f"ShardingPlan.output_plan keys must be str, got {path!r}")
            if not isinstance(spec, ShardingSpec):
                raise TypeError(
                    f"Only `ShardingSpec` is supported as output_plan for '{path}', got {type(spec).__name__}"
                )
    rlt = plan.return_local_tensor
    if rlt is not None:
        if isinstance(rlt, str) or not isinstance(rlt, (list, tuple)) or not all(isinstance(p, str) for p in rlt):
            raise TypeError(f"ShardingPlan.return_local_tensor must be a list of module paths, got {rlt!r}")


def _check_conflicts(plan: ShardingPlan) -> None:
    sharders = [name for name, entry in plan.plan.items() if isinstance(entry, Sharder)]
    conflicts = []
    for name, entry in plan.plan.items():
        if isinstance(entry, ShardingSpec):
            module_path = name.rpartition(".")[0]
            conflicts += [
                f"parameter entry '{name}' lies inside submodule '{sp}' of Sharder entry '{sp}'"
                for sp in sharders
                if inside(module_path, sp)
            ]
    conflicts += [
        f"Sharder entry '{inner}' lies inside submodule '{outer}' of Sharder entry '{outer}'"
        for outer in sharders
        for inner in sharders
        if inner != outer and inside(inner, outer)
    ]
    if conflicts:
        raise RuntimeError(
            "ShardingPlan is invalid: " + "; ".join(conflicts) + ". A Sharder shards its whole submodule tree, so "
            "no other entry may lie inside it; remove one entry of each pair (an entry should not conflict with the "
            "submodule tree of a Sharder)"
        )


def deferred(path: str, sharders: Sequence[str]) -> bool:
    """Whether ``path`` can only be resolved after the Sharders have replaced their submodules."""
    return any(inside(path, sp) for sp in sharders)


def validate_plan(module: nn.Module, plan: ShardingPlan) -> None:
    """Every check shard_module makes before moving data (raises the first kind of problem found)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"shard_module expects an nn.Module, got {type(module).__name__}")
    _check_plan_types(plan)
    _check_conflicts(plan)
    sharders = [name for name, entry in plan.plan.items() if isinstance(entry, Sharder)]
    unknown = []
    params = []
    for name, entry in plan.plan.items():
        if isinstance(entry, Sharder):
            if find_module(module, name) is None:
                unknown.append(f"'{name}' (no such submodule)")
            continue
        module_path, _, param_name = name.rpartition(".")
        owner = find_module(module, module_path)
        if owner is None:
            unknown.append(f"'{name}' (no submodule '{module_path}')")
        elif not hasattr(owner, param_name):
            unknown.append(f"'{name}' ({type(owner).__name__} has no attribute `{param_name}`)")
        else:
            params.append((name, owner, param_name))
    for field, paths in (
        ("output_plan", plan.output_plan or {}),
        ("return_local_tensor", plan.return_local_tensor or []),
    ):
        for path in paths:
            if not deferred(path, sharders) and find_module(module, path) is None:
                unknown.append(f"{field} '{path}' (no such submodule)")
    if unknown:
        raise AttributeError(
            f"ShardingPlan names what {type(module).__name__} does not have: {', '.join(unknown)}; "
            "plan keys are dotted parameter names ('fc1.weight') or submodule paths ('fc1') (the module has no "
            "attribute of that path)"
        )
    for name, owner, param_name in params:
        check_parameter(owner, param_name, where=f"ShardingPlan entry '{name}'")


def resolve_after_sharding(module: nn.Module, plan: ShardingPlan) -> list[tuple[str, nn.Module, Any]]:
    hooks: list[tuple[str, nn.Module, Any]] = []
    missing = []
    for field, items in (
        ("output_plan", list((plan.output_plan or {}).items())),
        ("return_local_tensor", [(p, None) for p in plan.return_local_tensor or []]),
    ):
        for path, spec in items:
            mod = find_module(module, path)
            if mod is None:
                missing.append(f"{field} '{path}'")
            else:
                hooks.append((path, mod, spec))
    if missing:
        raise AttributeError(
            f"after sharding, {type(module).__name__} has no submodule for {', '.join(missing)} "
            "(did a Sharder return a module without it?)"
        )
    return hooks
