"""An optimizer over ShardedTensor parameters: ``ShardedOptimizer``.

Names follow ``torch.distributed._shard.sharded_optim`` (torch 2.13).
"""

from __future__ import annotations

from typing import Iterator, Union

from torch import nn

from shardwise._modules.optim import ShardedOptimizer
from shardwise.sharded_tensor import ShardedTensor

__all__ = ["ShardedOptimizer", "named_params_with_sharded_tensor"]


def named_params_with_sharded_tensor(
    module: nn.Module,
    prefix: str = "",
    recurse: bool = True,
) -> Iterator[tuple[str, Union[nn.Parameter, ShardedTensor]]]:
    """Iterate over ``(name, parameter)`` pairs, ShardedTensors included, for :class:`ShardedOptimizer`.

    Yields first the ShardedTensors set as plain attributes of ``module``
    (and of its submodules when ``recurse``), then ``module.named_parameters``
    (ShardedTensor parameters among them, yielded as themselves). Unlike
    torch 2.13, ``prefix`` and ``recurse`` apply to the parameters too.

    Args:
        module: The module.
        prefix: Prefix prepended to every name.
        recurse: Include submodules.

    Yields:
        ``(name, tensor)``: a ``ShardedTensor`` or a dense parameter.

    Example::

        shard_parameter(model, "weight", spec)
        optim = ShardedOptimizer(dict(named_params_with_sharded_tensor(model)), torch.optim.SGD, lr=0.1)
    """
    modules = module.named_modules(prefix=prefix) if recurse else iter([(prefix, module)])
    seen: set[int] = set()
    for mod_prefix, mod in modules:
        for name, value in vars(mod).items():
            if isinstance(value, ShardedTensor) and id(value) not in seen:
                seen.add(id(value))
                yield (f"{mod_prefix}.{name}" if mod_prefix else name), value
    yield from module.named_parameters(prefix=prefix, recurse=recurse)
