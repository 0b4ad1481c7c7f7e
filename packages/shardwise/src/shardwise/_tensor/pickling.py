"""``load_with_process_group`` and the pickled form of a ``ShardedTensor``.

A ShardedTensor pickles (``torch.save``) as the wrapper's size and dtype plus
a state of plain data: the global metadata as a JSON-safe dict, this rank's
shard tensors with their metadata dicts, the spec as a dict, and the rank and
size of its group at save time. Unpickling (``torch.load``) attaches it to the
group set by :func:`load_with_process_group`, else the default group, and
checks that the rank and the group size are the ones it was saved with.

Because the state holds only plain data and tensors, ``torch.load`` with its
default ``weights_only=True`` can load it once the ``ShardedTensor`` class is
allowlisted; :func:`register_safe_globals` does that, and is called on entry
to :func:`load_with_process_group` and whenever a ShardedTensor is pickled
(never at import time, so importing shardwise changes no torch global state).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch

from shardwise._vocab.metadata import Placement, ShardMetadata, ShardedTensorMetadata
from shardwise.errors import LaunchError

if TYPE_CHECKING:
    from shardwise._comm.group import Group
    from shardwise._tensor.sharded_tensor import ShardedTensor

__all__ = [
    "current_process_group",
    "load_with_process_group",
    "register_safe_globals",
    "restore_sharded_tensor",
    "sharded_tensor_state",
]

#: Version of the pickled state; bumped when its layout changes.
STATE_VERSION = 1

_lock = threading.Lock()
_current: Optional[Group] = None
_registered = False


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
    global _current
    from shardwise._comm.default_group import resolve_group

    group = resolve_group(process_group)
    with _lock:
        if _current is not None:
            raise RuntimeError(
                'ProcessGroup already set by previous "load_with_process_group" context manager: '
                f"{_current!r}; nesting is not supported, leave the outer block first"
            )
        _current = group
    register_safe_globals()
    try:
        yield process_group
    finally:
        with _lock:
            _current = None


def current_process_group() -> Group:
    """The group set by :func:`load_with_process_group`, else the default group.

    Raises:
        LaunchError: no block is open and there is no default group.
    """
    from shardwise._comm.default_group import get_default_group

    group = _current
    return group if group is not None else get_default_group()


def register_safe_globals() -> None:
    """Allowlist shardwise's classes for ``torch.load(..., weights_only=True)``.

    Idempotent. The ShardedTensor class is what the pickled state needs
    (the state itself holds nothing but dicts, lists, strings, numbers and
    plain tensors); ``Placement`` and ``ShardMetadata``, which rebuild only
    from strings and lists, let user spec classes built from them load once
    the spec class itself is allowlisted.
    """
    global _registered
    if _registered:
        return
    from shardwise._tensor.sharded_tensor import ShardedTensor

    torch.serialization.add_safe_globals([ShardedTensor, Placement, ShardMetadata])
    _registered = True


def _rebuildable(spec: Any) -> bool:
    from shardwise._tensor.specs import ChunkShardingSpec, EnumerableShardingSpec

    return type(spec) in (ChunkShardingSpec, EnumerableShardingSpec)


def _default_rank_size() -> Optional[dict[str, int]]:
    from shardwise._comm.default_group import get_default_group

    try:
        default = get_default_group()
    except LaunchError:
        return None
    return {"rank": default.rank, "size": default.size}


def sharded_tensor_state(st: ShardedTensor) -> dict[str, Any]:
    """The state ``ShardedTensor.__getstate__`` returns: plain data and tensors.

    A spec of a class other than :class:`ChunkShardingSpec` and
    :class:`EnumerableShardingSpec` is kept as the object itself (under
    ``spec_object``); loading it with ``weights_only=True`` then needs its
    class allowlisted with ``torch.serialization.add_safe_globals``.
    """
    register_safe_globals()
    group = st.process_group
    spec = st.sharding_spec()
    state: dict[str, Any] = {
        "version": STATE_VERSION,
        "metadata": st.metadata().to_dict(),
        "local_shards": [{"metadata": s.metadata.to_dict(), "tensor": s.tensor} for s in st.local_shards()],
        "spec": spec.to_dict() if _rebuildable(spec) else None,
        "process_group": {"rank": group.rank, "size": group.size},
        "default_group": _default_rank_size(),
        # nn.Parameter(st) marks the ShardedTensor itself; keep it a parameter after loading.
        "is_param": bool(getattr(st, "_is_param", False)),
    }
    if not _rebuildable(spec):
        state["spec_object"] = spec
    return state


def _check_same(kind: str, what: str, saved: int, now: int) -> None:
    if saved != now:
        raise RuntimeError(
            f"{kind} {what} at save time was {saved}, but at load time was {now}; load a ShardedTensor on the "
            "same rank of a group of the same size as it was saved from "
            "(choose the group with shardwise.load_with_process_group)"
        )


def restore_sharded_tensor(st: ShardedTensor, state: Any) -> None:
    """Fill a bare ``ShardedTensor`` wrapper from :func:`sharded_tensor_state`'s state.

    Called by ``ShardedTensor.__setstate__`` while unpickling.

    Raises:
        RuntimeError: the state is not a shardwise ShardedTensor's, or this
            rank's rank or group size differ from those at save time (in
            the group of :func:`load_with_process_group`, or the default
            group; and in the default group if it existed at both times).
        LaunchError: there is no group to load into.
        ValueError: the state's metadata is malformed.
    """
    from shardwise._vocab.shard import Shard
    from shardwise._tensor.specs import spec_from_dict

    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        found = state.get("version") if isinstance(state, dict) else type(state).__name__
        raise RuntimeError(
            f"cannot restore a ShardedTensor from this state (expected a shardwise state of version "
            f"{STATE_VERSION}, found {found!r}); was it saved by another library or shardwise version?"
        )
    group = current_process_group()
    saved = state["process_group"]
    _check_same("Local", "rank", saved["rank"], group.rank)
    _check_same("Local", "world size", saved["size"], group.size)
    saved_default = state.get("default_group")
    now_default = _default_rank_size()
    if saved_default is not None and now_default is not None:
        _check_same("Global", "rank", saved_default["rank"], now_default["rank"])
        _check_same("Global", "world size", saved_default["size"], now_default["size"])
    metadata = ShardedTensorMetadata.from_dict(state["metadata"])
    # Placements name global ranks (a rank outside the group, global_rank -1, holds none).
    mine = [md for md in metadata.shards_metadata if md.rank == group.global_rank]
    local = []
    for entry in state["local_shards"]:
        md = ShardMetadata.from_dict(entry["metadata"])
        # Share the global metadata's objects, as shards built any other way do.
        same = next((m for m in mine if m == md), None)
        if same is None:
            raise RuntimeError(
                f"saved local shard ({md.describe()}) is not among the global metadata's shards for rank "
                f"{group.global_rank}: {[m.describe() for m in mine]}"
            )
        mine.remove(same)
        local.append(Shard(entry["tensor"], same))
    spec = spec_from_dict(state["spec"]) if state.get("spec") is not None else state["spec_object"]
    st._sharding_spec = spec
    st._metadata = metadata
    st._local_shards = local
    st._process_group = group
    st._init_rrefs = False
    if state.get("is_param"):
        st._is_param = True
