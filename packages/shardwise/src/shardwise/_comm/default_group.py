"""The default group and ``process_group=`` resolution (comm layer).

Holds the group :func:`shardwise.init` made (the session layer sets it with
:func:`set_default_group`) and turns every form a ``process_group=`` argument
takes into a :class:`~shardwise.Group`. Below the tensor and module layers,
so they resolve groups without reaching up into the session.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

from shardwise._comm.group import Group
from shardwise._comm.non_member import NON_MEMBER
from shardwise._comm.torch_group import wrap_process_group
from shardwise.errors import LaunchError

__all__ = [
    "DEFAULT_TIMEOUT",
    "clear_default_group",
    "current_default_group",
    "get_default_group",
    "is_initialized",
    "resolve_group",
    "set_default_group",
]

#: How long a rendezvous or a collective may wait for a peer before failing.
DEFAULT_TIMEOUT = timedelta(minutes=5)

_lock = threading.Lock()
_default: Optional[Group] = None


def set_default_group(group: Group) -> None:
    """Make ``group`` the default group (called by :func:`shardwise.init`).

    Raises:
        LaunchError: a default group is already set.
    """
    global _default
    with _lock:
        if _default is not None:
            raise LaunchError(
                f"shardwise.init() was already called (backend {_default.backend!r}, rank "
                f"{_default.rank} of {_default.size}); call shardwise.destroy() before initialising again"
            )
        _default = group


def clear_default_group() -> Optional[Group]:
    """Forget the default group and return it (None if there was none); the caller destroys it."""
    global _default
    with _lock:
        group, _default = _default, None
    return group


def current_default_group() -> Optional[Group]:
    """The group :func:`shardwise.init` made, or None."""
    return _default


def is_initialized() -> bool:
    """True between :func:`init` and :func:`destroy`."""
    return _default is not None


def get_default_group() -> Group:
    """The group used when ``process_group=None``.

    The one :func:`init` made; else torch's default process group, if
    ``torch.distributed`` was initialised directly.

    Raises:
        LaunchError: neither exists.
    """
    group = _default
    if group is not None:
        return group
    if dist.is_available() and dist.is_initialized():
        world = dist.group.WORLD
        assert world is not None
        return wrap_process_group(world)
    raise LaunchError(
        "no default group: call shardwise.init() first (or torch.distributed.init_process_group)"
    )


def resolve_group(process_group: Any = None) -> Group:
    """Turn a ``process_group=`` argument into a :class:`Group`.

    Args:
        process_group: A shardwise ``Group``, a
            ``torch.distributed.ProcessGroup`` (wrapped on the fly; one
            shardwise made, such as the default group's, gives that group), None
            for :func:`get_default_group`, or — on a rank that a subgroup
            leaves out — torch's ``GroupMember.NON_GROUP_MEMBER``, which
            ``torch.distributed.new_group`` returns there.

    Returns:
        The group; for ``NON_GROUP_MEMBER`` the stand-in
        :class:`~shardwise._comm.non_member.NonMemberGroup` (``is_member`` False),
        with which sharded tensors are built with no local shards, as in
        torch.

    Raises:
        TypeError: it is none of these.
    """
    if process_group is None:
        return get_default_group()
    if isinstance(process_group, Group):
        return process_group
    if dist.is_available():
        if isinstance(process_group, dist.ProcessGroup):
            return wrap_process_group(process_group)
        if type(process_group) is int and process_group == dist.GroupMember.NON_GROUP_MEMBER:
            return NON_MEMBER
    raise TypeError(
        f"process_group must be a shardwise Group, a torch.distributed.ProcessGroup, None or (on a rank "
        f"outside the group) torch's GroupMember.NON_GROUP_MEMBER, got {type(process_group).__name__}"
    )
