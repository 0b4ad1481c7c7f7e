"""The pickled form of a ``ShardedTensor``, and the group unpickling attaches it to.

A ShardedTensor pickles (``torch.save``) as the wrapper's size and dtype plus
a state of plain data: the global metadata as a JSON-safe dict, this rank's
shard tensors with their metadata dicts, the spec as a dict, and the rank and
size of its group at save time. Unpickling (``torch.load``) attaches it to the
group set by ``load_with_process_group`` (:func:`open_load_group`), else the default group, and
checks that the rank and the group size are the ones it was saved with.

Because the state holds only plain data and tensors, ``torch.load`` with its
default ``weights_only=True`` can load it once the ``ShardedTensor`` class is
allowlisted; :func:`register_safe_globals` does that, and is called on entry
to ``load_with_process_group`` (:mod:`shardwise._tensor.loading`), by
``shardwise.init`` and whenever a ShardedTensor is pickled (never at import
time, so importing shardwise changes no torch global state).
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple, Optional, Sequence

import torch

from shardwise._comm.default_group import get_default_group
from shardwise._comm.group import Group
from shardwise._tensor.specs import ChunkShardingSpec, EnumerableShardingSpec, ShardingSpec, spec_from_dict
from shardwise._vocab.metadata import Placement, ShardMetadata, ShardedTensorMetadata
from shardwise._vocab.shard import Shard
from shardwise.errors import LaunchError

__all__ = [
    "RestoredState",
    "close_load_group",
    "current_process_group",
    "open_load_group",
    "register_safe_globals",
    "restore_state",
    "sharded_tensor_state",
]

#: Version of the pickled state; bumped when its layout changes.
STATE_VERSION = 1

_lock = threading.Lock()
_current: Optional[Group] = None
_registered = False


def open_load_group(group: Group) -> None:
    """Make ``group`` the one unpickled ShardedTensors attach to (``load_with_process_group`` entering).

    Raises:
        RuntimeError: a group is already set (nesting is not supported, as in torch 2.13).
    """
    global _current
    with _lock:
        if _current is not None:
            raise RuntimeError(
                'ProcessGroup already set by previous "load_with_process_group" context manager: '
                f"{_current!r}; nesting is not supported, leave the outer block first"
            )
        _current = group


def close_load_group() -> None:
    """Forget the group :func:`open_load_group` set (``load_with_process_group`` leaving)."""
    global _current
    with _lock:
        _current = None


def current_process_group() -> Group:
    """The group set by :func:`load_with_process_group`, else the default group.

    Raises:
        LaunchError: no block is open and there is no default group.
    """
    group = _current
    return group if group is not None else get_default_group()


def register_safe_globals(tensor_class: type) -> None:
    """Allowlist ``tensor_class`` (the ShardedTensor class) and its records for ``torch.load(weights_only=True)``.

    Idempotent. The ShardedTensor class is what the pickled state needs
    (the state itself holds nothing but dicts, lists, strings, numbers and
    plain tensors); ``Placement`` and ``ShardMetadata``, which rebuild only
    from strings and lists, let user spec classes built from them load once
    the spec class itself is allowlisted.
    """
    global _registered
    if _registered:
        return
    torch.serialization.add_safe_globals([tensor_class, Placement, ShardMetadata])
    _registered = True


def _rebuildable(spec: Any) -> bool:
    return type(spec) in (ChunkShardingSpec, EnumerableShardingSpec)


def _default_rank_size() -> Optional[dict[str, int]]:
    try:
        default = get_default_group()
    except LaunchError:
        return None
    return {"rank": default.rank, "size": default.size}


def sharded_tensor_state(
    spec: ShardingSpec, metadata: ShardedTensorMetadata, shards: Sequence[Shard], group: Group, is_param: bool
) -> dict[str, Any]:
    """The state ``ShardedTensor.__getstate__`` returns: plain data and tensors.

    A spec of a class other than :class:`ChunkShardingSpec` and
    :class:`EnumerableShardingSpec` is kept as the object itself (under
    ``spec_object``); loading it with ``weights_only=True`` then needs its
    class allowlisted with ``torch.serialization.add_safe_globals``.
    """
    state: dict[str, Any] = {
        "version": STATE_VERSION,
        "metadata": metadata.to_dict(),
        "local_shards": [{"metadata": s.metadata.to_dict(), "tensor": s.tensor} for s in shards],
        "spec": spec.to_dict() if _rebuildable(spec) else None,
        "process_group": {"rank": group.rank, "size": group.size},
        "default_group": _default_rank_size(),
        # nn.Parameter(st) marks the ShardedTensor itself; keep it a parameter after loading.
        "is_param": is_param,
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


class RestoredState(NamedTuple):
    """What an unpickled ShardedTensor is made of, rebuilt from :func:`sharded_tensor_state`'s state."""

    spec: ShardingSpec
    metadata: ShardedTensorMetadata
    shards: list[Shard]
    group: Group
    is_param: bool


def restore_state(state: Any) -> RestoredState:
    """Rebuild a ShardedTensor's parts from :func:`sharded_tensor_state`'s state, attached to the loading group.

    Called by ``ShardedTensor.__setstate__`` while unpickling, which stores
    the parts in the bare wrapper.

    Raises:
        RuntimeError: the state is not a shardwise ShardedTensor's, or this
            rank's rank or group size differ from those at save time (in
            the group of :func:`load_with_process_group`, or the default
            group; and in the default group if it existed at both times).
        LaunchError: there is no group to load into.
        ValueError: the state's metadata is malformed.
    """
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
    return RestoredState(spec, metadata, local, group, bool(state.get("is_param")))
