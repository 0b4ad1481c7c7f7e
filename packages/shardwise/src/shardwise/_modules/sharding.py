"""Sharding modules: ``shard_parameter``, ``shard_module`` and their forward hooks.

The state-dict hooks ``shard_parameter`` installs are in
:mod:`shardwise._modules.state_dict`.

Names and behaviour follow ``torch.distributed._shard.api`` (torch 2.13),
with these differences:

- Every check runs before any data moves, and its outcome is exchanged, so
  a bad argument on one rank raises on every rank (the real error there,
  :class:`~shardwise.errors.PeerError` naming it elsewhere) instead of
  leaving the others waiting. Ranks must also pass the same plan.
- A :class:`~shardwise.Sharder` entry replaces the submodule in its parent
  (torch 2.13 set an attribute literally named ``mod_name``).
- Conflicts are found by module path, not by string prefix (torch treats
  ``"fc10.weight"`` as inside a Sharder for ``"fc1"``), and nested Sharder
  entries are conflicts too; all conflicts and unknown names are reported
  at once.
- An ``output_plan`` module whose output is not a ShardedTensor is an error
  (torch silently passed it through).
- ``return_local_tensor`` squeezes the sharded dimension only when every
  shard has size 1 along it, so every rank returns the same shape (torch
  squeezed on the ranks whose shard happened to have size 1).
- ``load_state_dict`` of a dense state dict into a module with ShardedTensor
  parameters works: each rank copies its shards' slices (a hook that
  :func:`shard_parameter` registers). So does a state dict of torch 2.13's
  own ShardedTensors (``torch.save``, FSDP1's ``SHARDED_STATE_DICT``): each
  is converted and resharded to the parameter's layout.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from shardwise._comm.default_group import resolve_group
from shardwise._modules.plan import ShardingPlan
from shardwise._modules.plan_checks import (
    check_parameter,
    deferred,
    plan_fingerprint,
    requires_grad_of,
    resolve_after_sharding,
    validate_plan,
)
from shardwise._modules.state_dict import ensure_dense_load_hook
from shardwise._tensor.scatter import shard_tensor
from shardwise._tensor.sharded_tensor import ShardedTensor
from shardwise._tensor.specs import ChunkShardingSpec, ShardingSpec

__all__ = ["shard_module", "shard_parameter"]

def _agree(group: Any, check: Callable[[], Any], what: str) -> list[Any]:
    """Every rank's result of its own ``check()`` (``Group.agree``); raise on every rank if any failed.

    Args:
        group: The shardwise Group.
        check: This rank's validation; returns JSON-safe data to share.
        what: The call, for the message (``"shard_module"``).

    Returns:
        Every rank's result; on a rank outside the group (which cannot talk
        to the members, and gets tensors with no local shards) only its own.

    Raises:
        The rank's own error if its check failed; else PeerError naming the
        ranks whose check failed, with their messages.
    """
    if not group.is_member:
        return [check()]
    return list(group.agree(check, op=what, gather=True))


def _check_same_plan(fingerprints: list[Any], rank: int) -> None:
    """Raise ValueError (on every rank: all see the same list) unless all ranks passed the same plan."""
    assert fingerprints[rank] is not None
    for field in fingerprints[rank]:
        values = [fp[field] for fp in fingerprints]
        if any(v != values[0] for v in values):
            shown = "; ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            raise ValueError(
                f"ranks passed different {field} to shard_module ({shown}); every rank must pass the same "
                "plan and src_rank"
            )


def _check_spec(spec: Any, where: str) -> None:
    if not isinstance(spec, ShardingSpec):
        raise TypeError(f"{where}: expected a ShardingSpec, got {type(spec).__name__}")


def _from_src(rows: list[Any], src_rank: Any, rank: int) -> Any:
    """``src_rank``'s row (its parameter is the truth), or this rank's while src_rank is invalid."""
    valid = isinstance(src_rank, int) and not isinstance(src_rank, bool) and 0 <= src_rank < len(rows)
    return rows[src_rank] if valid else rows[rank]


def _replace_parameter(
    module: nn.Module,
    param_name: str,
    tensor: torch.Tensor,
    spec: ShardingSpec,
    src_rank: int,
    group: Any,
    requires_grad: bool,
) -> None:
    st = shard_tensor(tensor.detach(), spec, src_rank=src_rank, process_group=group)
    # nn.Parameter of a tensor subclass returns that subclass, marked as a parameter.
    module.register_parameter(param_name, nn.Parameter(st, requires_grad=requires_grad))
    ensure_dense_load_hook(module)


def shard_parameter(
    module: nn.Module,
    param_name: str,
    sharding_spec: ShardingSpec,
    src_rank: int = 0,
    process_group: Any = None,
) -> None:
    """Replace ``module.<param_name>`` by a ShardedTensor parameter sharded by ``sharding_spec``.

    Every rank of the group calls it. ``src_rank``'s parameter is the truth;
    each element goes straight to the rank that owns it. The new parameter
    keeps ``src_rank``'s parameter's ``requires_grad``.

    Args:
        module: The module that owns the parameter.
        param_name: The parameter's attribute name on ``module``.
        sharding_spec: How to shard it.
        src_rank: Rank of the group whose parameter is scattered.
        process_group: Group, torch ProcessGroup or None (default group).

    Raises:
        AttributeError: ``module`` has no attribute ``param_name``.
        KeyError: it is a buffer or plain attribute, not a parameter (torch 2.13 raises this KeyError
            after scattering; shardwise before any data moves).
        ValueError: it is not a tensor, already sharded,
            or not contiguous; or ranks disagree on the spec or src_rank.
        TypeError: ``sharding_spec`` is not a ShardingSpec.
        PeerError: another rank's arguments failed these checks.
    """
    group = resolve_group(process_group)
    found: list[torch.Tensor] = []

    def check() -> bool:
        _check_spec(sharding_spec, f"shard_parameter({param_name!r})")
        found.append(check_parameter(module, param_name))
        return found[0].requires_grad

    rows = _agree(group, check, "shard_parameter")
    tensor = found[0]
    _replace_parameter(
        module, param_name, tensor, sharding_spec, src_rank, group, bool(_from_src(rows, src_rank, group.rank))
    )


# -- shard_module -----------------------------------------------------------


def shard_module(module: nn.Module, plan: ShardingPlan, src_rank: int = 0, process_group: Any = None) -> None:
    """Shard ``module`` in place by ``plan`` (every rank of the group calls it).

    Parameters named in ``plan.plan`` are replaced by ShardedTensor
    parameters (:func:`shard_parameter`); a :class:`Sharder` entry's
    submodule is replaced in its parent by what ``Sharder.shard`` returns;
    then forward hooks reshard the outputs named in ``plan.output_plan`` and
    return the local tensor of those in ``plan.return_local_tensor``.

    Everything is checked before any data moves, and the outcome is agreed
    across ranks: a bad plan raises on every rank.

    Args:
        module: The module to shard.
        plan: The :class:`~shardwise.sharding_plan.ShardingPlan`.
        src_rank: Rank of the group whose parameters are scattered.
        process_group: Group, torch ProcessGroup or None (default group).

    Raises:
        TypeError: ``plan`` or an entry has the wrong type.
        KeyError: a Sharder entry has the empty path.
        RuntimeError: an entry lies inside a Sharder entry's submodule
            (naming both).
        AttributeError: the plan names parameters or submodules the module
            does not have (naming all of them).
        ValueError: a planned parameter is not a contiguous dense
            parameter, or ranks pass different plans or src_rank.
        PeerError: another rank's plan failed these checks.
    """
    group = resolve_group(process_group)

    def check() -> dict[str, Any]:
        validate_plan(module, plan)
        return {"plan": plan_fingerprint(plan, src_rank), "requires_grad": requires_grad_of(module, plan)}

    rows = _agree(group, check, "shard_module")
    _check_same_plan([row["plan"] for row in rows], group.rank)
    requires_grad = _from_src(rows, src_rank, group.rank)["requires_grad"]

    sharders = []
    for name, entry in plan.plan.items():
        if isinstance(entry, ShardingSpec):
            module_path, _, param_name = name.rpartition(".")
            owner = module.get_submodule(module_path)
            tensor = getattr(owner, param_name)
            _replace_parameter(owner, param_name, tensor, entry, src_rank, group, requires_grad[name])
        else:
            sharders.append(name)
            parent_path, _, child = name.rpartition(".")
            sharded = entry.shard(module.get_submodule(name))
            if not isinstance(sharded, nn.Module):
                raise TypeError(
                    f"{type(entry).__name__}.shard() for '{name}' returned a {type(sharded).__name__}; "
                    "it must return the nn.Module that replaces the submodule"
                )
            setattr(module.get_submodule(parent_path), child, sharded)

    paths = list(plan.output_plan or {}) + list(plan.return_local_tensor or [])
    if any(deferred(p, sharders) for p in paths):
        # Sharders may build any module tree: agree on resolving these paths too.
        resolved: list[Any] = []

        def resolve() -> None:
            resolved.extend(resolve_after_sharding(module, plan))

        _agree(group, resolve, "shard_module")
        hooks = resolved
    else:
        hooks = resolve_after_sharding(module, plan)
    for path, mod, spec in hooks:
        if spec is not None:
            _reshard_output(mod, spec, path)
        else:
            _collect_local_shard(mod)


# -- forward hooks ----------------------------------------------------------


class _ReshardOutput:
    """Forward hook: reshard the module's ShardedTensor output (a class, so modules stay picklable)."""

    def __init__(self, spec: ShardingSpec, path: str) -> None:
        self.spec = spec
        self.path = path

    def __call__(self, module: nn.Module, inputs: Any, output: Any) -> Any:
        if not isinstance(output, ShardedTensor):
            where = f"submodule '{self.path}'" if self.path else "the root module"
            raise TypeError(
                f"output_plan reshards the output of {where} ({type(module).__name__}) to {self.spec!r}, but it "
                f"returned a {type(output).__name__}, not a ShardedTensor; remove the output_plan entry or "
                "shard the module so that it returns a ShardedTensor"
            )
        return output.reshard(self.spec)


class _CollectLocalShard:
    """Forward hook: return this rank's local tensor of a ShardedTensor output."""

    def __call__(self, module: nn.Module, inputs: Any, output: Any) -> Any:
        if not isinstance(output, ShardedTensor):
            return None  # not sharded: leave the output as it is (as torch 2.13)
        local = output.local_tensor()
        spec = output.sharding_spec()
        if isinstance(spec, ChunkShardingSpec) and output.dim() > 0:
            dim = spec.dim % output.dim()
            # Squeeze only when every rank's shard has size 1 there, so all ranks agree on the shape.
            if all(md.shard_sizes[dim] == 1 for md in output.metadata().shards_metadata):
                local = local.squeeze(dim)
        return local


def _reshard_output(module: nn.Module, resharding_spec: ShardingSpec, path: str = "") -> nn.Module:
    """Hook ``module`` so that its ShardedTensor output is resharded to ``resharding_spec``."""
    module.register_forward_hook(_ReshardOutput(resharding_spec, path))
    return module


def _collect_local_shard(module: nn.Module) -> nn.Module:
    """Hook ``module`` so that it returns the local tensor of its ShardedTensor output."""
    module.register_forward_hook(_CollectLocalShard())
    return module
