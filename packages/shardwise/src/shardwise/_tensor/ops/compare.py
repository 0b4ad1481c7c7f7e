"""Whole-tensor comparisons and reductions to one bool: ``equal``, ``allclose``, ``any``, ``all``.

Each rank compares its own shards and the group agrees on the answers
(``Group.agree``: one all-gather of each rank's flag and status), so every
rank returns the same answer. The flags travel on the group's device: this
works on gloo/CPU-only hosts, where torch 2.13's versions fail (they put the
flag on an accelerator).

Semantics follow torch 2.13's sharded ``equal``/``allclose``: tensors whose
layouts (size, shard boxes, placements) or dtypes differ compare False, and
tensors of two different process groups are a
:class:`~shardwise.errors.GroupMismatchError` (a ``RuntimeError``).
Every rank still joins the one ``all_reduce``, even when it knows the
answer alone: a rank that sees other operands than its peers (a plain
tensor of another shape on one rank) must not leave them waiting in it,
and a rank whose arguments fail raises its error while the others raise
:class:`~shardwise.errors.PeerError` naming it. Unlike torch 2.13, ``requires_grad`` and ``pin_memory`` do not
matter, as for plain tensors. The other operand may also be a plain tensor
holding the whole tensor, the same on every rank: each rank compares its
shards with the matching slices.

On a rank outside the tensors' group (built with ``process_group=`` torch's
``GroupMember.NON_GROUP_MEMBER``) there is no collective to join: as in
torch 2.13, each op returns that rank's local answer from the shards it
holds, which are none. ``equal``/``allclose`` are True there unless the
rank can tell from the metadata alone that the tensors differ (layout or
dtype: False, the answer the members give; torch says True), ``any`` is
False and ``all`` True.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from shardwise._registry.records import ShardedOp
from shardwise._tensor.ops.common import box_key, layout_key, local_by_box, op_name, records_for
from shardwise._tensor.sharded_tensor import ShardedTensor
from shardwise.errors import GroupMismatchError

__all__ = ["records"]


def _group_of(args: Any, kwargs: Any) -> Any:
    """The group of the first ShardedTensor argument (dispatch guarantees there is one)."""
    for value in (*args, *(kwargs or {}).values()):
        if isinstance(value, ShardedTensor):
            return value.process_group
    raise TypeError("expected a ShardedTensor argument")


def _same_group(a: Any, b: Any) -> bool:
    return a is b or (getattr(a, "pg", None) is not None and getattr(a, "pg", None) is getattr(b, "pg", None))


def _check_one_group(name: str, args: Any, kwargs: Any) -> None:
    """Raise unless every ShardedTensor operand lives in one process group (decided locally, before any collective).

    Raises:
        GroupMismatchError: naming both groups (with torch 2.13's wording).
    """
    tensors = [x for x in (*args, *(kwargs or {}).values()) if isinstance(x, ShardedTensor)]
    for other in tensors[1:]:
        if not _same_group(tensors[0].process_group, other.process_group):
            raise GroupMismatchError(
                f"{name}: the ShardedTensors live in different process groups ({tensors[0].process_group!r} and "
                f"{other.process_group!r}), so no collective can compare them; move one into the other's group "
                "first, e.g. b.to(process_group=...). All distributed tensors should use the same ProcessGroup "
                "if used together in an op."
            )


def _slice(full: torch.Tensor, key: Any) -> torch.Tensor:
    offsets, sizes = key
    return full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]


def _pairs(a: Any, b: Any) -> tuple[ShardedTensor, list[tuple[torch.Tensor, torch.Tensor]]] | None:
    """The sharded operand and the (a, b) pieces to compare on this rank, or None when they cannot match."""
    st = a if isinstance(a, ShardedTensor) else b
    if isinstance(a, ShardedTensor) and isinstance(b, ShardedTensor):
        if a.dtype != b.dtype:
            return None
        if layout_key(a, True) != layout_key(b, True):
            return None
        theirs = local_by_box(b)
        return a, [(shard.tensor, theirs[box_key(shard.metadata)]) for shard in a.local_shards()]
    plain = b if st is a else a
    if not isinstance(plain, torch.Tensor):
        raise TypeError(f"expected a ShardedTensor or a torch.Tensor, got {type(plain).__name__}")
    if plain.shape != st.size() or plain.dtype != st.dtype:
        return None
    pieces = [(shard.tensor, _slice(plain, box_key(shard.metadata))) for shard in st.local_shards()]
    return st, [p if st is a else (p[1], p[0]) for p in pieces]


_PARAMS = {"equal": ("input", "other"), "allclose": ("input", "other", "rtol", "atol", "equal_nan")}


def _comparison(func: Any) -> Callable[..., Any]:
    name = op_name(func)
    params = _PARAMS["allclose" if name.endswith("allclose") else "equal"]

    def local(args: Any, kwargs: Any) -> bool:
        """This rank's answer, from its own shards only."""
        if len(args) > len(params):
            raise TypeError(f"{name}() takes at most {len(params)} arguments, got {len(args)}")
        bound = dict(zip(params, args, strict=False))
        for key, value in (kwargs or {}).items():
            if key not in params or key in bound:
                raise TypeError(f"{name}() got an unexpected or repeated argument {key!r}")
            bound[key] = value
        if "other" not in bound:
            raise TypeError(f"{name}() missing the argument 'other'")
        a, b = bound.pop("input"), bound.pop("other")
        found = _pairs(a, b)
        if found is None:
            return False
        return all(func(x, y.to(x.device), **bound) for x, y in found[1])

    def impl(types: Any, args: Any, kwargs: Any, process_group: Any) -> bool:
        group = _group_of(args, kwargs)
        _check_one_group(name, args, kwargs)
        if not group.is_member:
            # No peer waits for this rank, and it holds no shard: its answer is its own.
            return local(args, kwargs)
        # Every rank's answer, or (any local failure joins the agreement) the same error on every rank.
        return all(group.agree(lambda: local(args, kwargs), op=name, gather=True))

    return impl


def _reduction(kind: str) -> Callable[..., Any]:
    def impl(types: Any, args: Any, kwargs: Any, process_group: Any) -> torch.Tensor:
        st = args[0]
        if len(args) > 1 or kwargs or not isinstance(st, ShardedTensor):
            raise TypeError(
                f"torch.{kind} on a ShardedTensor takes only the tensor (whole-tensor form); "
                "reductions along a dim are not supported"
            )
        tensors = [shard.tensor for shard in st.local_shards()]
        here = any(bool(t.any()) for t in tensors) if kind == "any" else all(bool(t.all()) for t in tensors)
        # Outside the group there is no collective to join: the answer is this rank's own (over no shards).
        group = st.process_group
        if group.is_member:
            flags = group.agree(lambda: here, op=f"torch.{kind}", gather=True)
            here = any(flags) if kind == "any" else all(flags)
        return torch.tensor(here, device=st.device)

    return impl


def records() -> list[ShardedOp]:
    """``equal``/``allclose`` and whole-tensor ``any``/``all``, each one global answer."""
    return (
        records_for([torch.equal, torch.Tensor.equal], _comparison, "global comparison, same answer on every rank")
        + records_for(
            [torch.allclose, torch.Tensor.allclose], _comparison, "global comparison, same answer on every rank"
        )
        + records_for([torch.any, torch.Tensor.any], lambda op: _reduction("any"), "global any, on every rank")
        + records_for([torch.all, torch.Tensor.all], lambda op: _reduction("all"), "global all, on every rank")
    )
