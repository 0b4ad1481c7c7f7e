"""``ShardingPlan`` and the ``ShardingPlanner`` interface."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Optional, Union

from torch import nn

from shardwise._modules.sharder import Sharder
from shardwise._tensor.specs import ShardingSpec

__all__ = ["ShardingPlan", "ShardingPlanner"]


@dataclass
class ShardingPlan:
    """How :func:`~shardwise.shard_module` shards a module.

    Attributes:
        plan: Keyed by the dotted name of a parameter (``"fc1.weight"``) to
            the :class:`~shardwise.ShardingSpec` it is sharded by, or by the
            dotted path of a submodule (``"encoder.embedding"``) to a
            :class:`~shardwise.Sharder` that shards the whole submodule and
            returns its replacement. A parameter entry may not lie inside
            a Sharder's submodule.
        output_plan: Keyed by submodule path (``""`` is the root module) to
            the spec its output ShardedTensor is resharded to after each
            forward.
        return_local_tensor: Submodule paths (``""`` is the root) whose
            output ShardedTensor is replaced by this rank's local tensor
            after each forward (with a size-1 sharded dimension of a chunk
            spec squeezed away), to go back to data-parallel code.

    Example::

        plan = ShardingPlan(
            plan={"fc1.weight": colwise_spec, "fc2.weight": rowwise_spec},
            output_plan={"fc2": output_spec},
            return_local_tensor=["fc2"],
        )
    """

    plan: dict[str, Union[ShardingSpec, Sharder]]
    output_plan: Optional[dict[str, ShardingSpec]] = None
    return_local_tensor: Optional[list[str]] = None


class ShardingPlanner(abc.ABC):
    """Builds a :class:`ShardingPlan` for a module (a pluggable sharding strategy)."""

    @abc.abstractmethod
    def build_plan(self, module: nn.Module) -> ShardingPlan:
        """Decide how to shard ``module``.

        Args:
            module: The module to shard.

        Returns:
            The plan to pass to :func:`~shardwise.shard_module`.
        """
