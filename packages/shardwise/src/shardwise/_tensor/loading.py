"""``load_with_process_group`` and the safe-globals allowlist: loading pickled ShardedTensors.

Above the ``ShardedTensor`` class (it allowlists the class for
``torch.load(weights_only=True)``); the pickled form itself is
:mod:`shardwise._tensor.pickling`'s.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from shardwise._comm.default_group import resolve_group
from shardwise._tensor import pickling
from shardwise._tensor.pickling import close_load_group, open_load_group
from shardwise._tensor.sharded_tensor import ShardedTensor

__all__ = ["load_with_process_group", "register_safe_globals"]


def register_safe_globals() -> None:
    """Allowlist ``ShardedTensor`` and the records its state rebuilds for ``torch.load(weights_only=True)``.

    Idempotent.
    """
    pickling.register_safe_globals(ShardedTensor)


@contextmanager
def load_with_process_group(process_group: Any) -> Iterator[Any]:
    """Load ShardedTensors (``torch.load``) into ``process_group`` inside this block.

    Args:
        process_group: A shardwise ``Group``, a torch ``ProcessGroup``,
            None for the default group, or (on a rank outside the group)
            torch's ``GroupMember.NON_GROUP_MEMBER``: tensors then load
            with no local shards, as in torch.

    Yields:
        ``process_group``, as torch 2.13 does.

    Raises:
        RuntimeError: a ``load_with_process_group`` block is already open
            (nesting is not supported, as in torch 2.13).
        TypeError: ``process_group`` is not a group.

    Example::

        with shardwise.load_with_process_group(group):
            st = torch.load(path, weights_only=True)
    """
    open_load_group(resolve_group(process_group))
    register_safe_globals()
    try:
        yield process_group
    finally:
        close_load_group()
