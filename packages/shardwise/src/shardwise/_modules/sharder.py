"""``Sharder``: a user-defined way to shard a whole submodule.

Name and behaviour follow ``torch.distributed._shard.sharder`` (torch 2.13).
"""

from __future__ import annotations

import abc

from torch import nn

__all__ = ["Sharder"]


class Sharder(abc.ABC):
    """Shards a submodule in a way a per-parameter :class:`ShardingSpec` cannot express.

    Put a ``Sharder`` in a :class:`~shardwise.sharding_plan.ShardingPlan`
    under a submodule's path; :func:`~shardwise.shard_module` calls
    :meth:`shard` on that submodule and puts the returned module in its
    place in the parent (torch 2.13 set an attribute literally named
    ``mod_name`` on the parent instead, leaving the original in place).

    Example::

        class ColumnwiseSharder(Sharder):
            def shard(self, module: nn.Module) -> nn.Module:
                shard_parameter(module, "weight", spec)
                return module
    """

    @abc.abstractmethod
    def shard(self, module: nn.Module) -> nn.Module:
        """Shard ``module`` and return the sharded module.

        Args:
            module: The submodule named by the plan entry.

        Returns:
            The module that replaces ``module`` in its parent (it may be
            ``module`` itself, modified in place).
        """
