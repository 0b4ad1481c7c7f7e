"""Creation functions: ``empty``, ``zeros``, ``ones``, ``full``, ``rand``, ``randn`` and ``init_from_local_shards``."""

from __future__ import annotations

from typing import Any, Optional

import torch

from shardwise._tensor.ops.random import fill_normal, fill_uniform
from shardwise._tensor.sharded_tensor import ShardedTensor
from shardwise._tensor.specs import ShardingSpec
from shardwise._vocab.shard import Shard

__all__ = ["empty", "full", "init_from_local_shards", "ones", "rand", "randn", "zeros"]


def empty(
    sharding_spec: ShardingSpec,
    *size: Any,
    dtype: Optional[torch.dtype] = None,
    layout: torch.layout = torch.strided,
    requires_grad: bool = False,
    pin_memory: bool = False,
    memory_format: torch.memory_format = torch.contiguous_format,
    process_group: Any = None,
    init_rrefs: bool = False,
) -> ShardedTensor:
    """A ShardedTensor of ``size`` sharded by ``sharding_spec``, with uninitialised data.

    Every rank must pass the same spec and size. No data moves; when the
    spec puts a shard on a device other than the CPU, the ranks agree (one
    small collective) that each can use the devices of its own shards, so
    a rank without one (``cuda`` on a CPU-only host, ``cuda:3`` on a host
    with 2 GPUs) raises and its peers raise PeerError, instead of one rank
    failing alone.

    Args:
        sharding_spec: How to cut the tensor.
        *size: Size of the whole tensor (ints, or one list/tuple/Size).
        dtype: Element type (default ``torch.get_default_dtype()``).
        layout: Only ``torch.strided``.
        requires_grad: Whether local shards require grad.
        pin_memory: Pin CPU shards.
        memory_format: Only ``torch.contiguous_format``.
        process_group: Group, torch ProcessGroup or None (default group).
        init_rrefs: Must be False.

    Raises:
        TypeError: ``size`` is not a sequence of ints.
        ValueError: ``size`` is negative, the spec cannot shard that size,
            or it places a shard on a rank outside the group (on every
            rank), or on a device its rank cannot use (a ``PlacementError``
            on that rank; its peers raise
            :class:`~shardwise.errors.PeerError`).
    """
    return ShardedTensor(
        sharding_spec,
        *size,
        dtype=dtype,
        layout=layout,
        requires_grad=requires_grad,
        pin_memory=pin_memory,
        memory_format=memory_format,
        process_group=process_group,
        init_rrefs=init_rrefs,
    )


def _filled(st: ShardedTensor, fill: Any) -> ShardedTensor:
    with torch.no_grad():
        for shard in st.local_shards():
            fill(shard.tensor)
    return st


def ones(
    sharding_spec: ShardingSpec,
    *size: Any,
    dtype: Optional[torch.dtype] = None,
    layout: torch.layout = torch.strided,
    requires_grad: bool = False,
    pin_memory: bool = False,
    memory_format: torch.memory_format = torch.contiguous_format,
    process_group: Any = None,
    init_rrefs: bool = False,
) -> ShardedTensor:
    """Like :func:`empty`, filled with 1."""
    kwargs: dict[str, Any] = dict(
        dtype=dtype,
        layout=layout,
        requires_grad=requires_grad,
        pin_memory=pin_memory,
        memory_format=memory_format,
        process_group=process_group,
        init_rrefs=init_rrefs,
    )
    return _filled(empty(sharding_spec, *size, **kwargs), lambda t: t.fill_(1))


def zeros(
    sharding_spec: ShardingSpec,
    *size: Any,
    dtype: Optional[torch.dtype] = None,
    layout: torch.layout = torch.strided,
    requires_grad: bool = False,
    pin_memory: bool = False,
    memory_format: torch.memory_format = torch.contiguous_format,
    process_group: Any = None,
    init_rrefs: bool = False,
) -> ShardedTensor:
    """Like :func:`empty`, filled with 0."""
    kwargs: dict[str, Any] = dict(
        dtype=dtype,
        layout=layout,
        requires_grad=requires_grad,
        pin_memory=pin_memory,
        memory_format=memory_format,
        process_group=process_group,
        init_rrefs=init_rrefs,
    )
    return _filled(empty(sharding_spec, *size, **kwargs), lambda t: t.zero_())


def full(
    sharding_spec: ShardingSpec,
    size: Any,
    fill_value: Any,
    *,
    dtype: Optional[torch.dtype] = None,
    layout: torch.layout = torch.strided,
    requires_grad: bool = False,
    pin_memory: bool = False,
    memory_format: torch.memory_format = torch.contiguous_format,
    process_group: Any = None,
    init_rrefs: bool = False,
) -> ShardedTensor:
    """Like :func:`empty` with ``size`` a sequence, filled with ``fill_value``."""
    kwargs: dict[str, Any] = dict(
        dtype=dtype,
        layout=layout,
        requires_grad=requires_grad,
        pin_memory=pin_memory,
        memory_format=memory_format,
        process_group=process_group,
        init_rrefs=init_rrefs,
    )
    return _filled(empty(sharding_spec, *_as_sizes(size), **kwargs), lambda t: t.fill_(fill_value))


def rand(
    sharding_spec: ShardingSpec,
    *size: Any,
    dtype: Optional[torch.dtype] = None,
    layout: torch.layout = torch.strided,
    requires_grad: bool = False,
    pin_memory: bool = False,
    memory_format: torch.memory_format = torch.contiguous_format,
    process_group: Any = None,
    init_rrefs: bool = False,
    generator: Optional[torch.Generator] = None,
) -> ShardedTensor:
    """Like :func:`empty`, filled with uniform numbers on ``[0, 1)``.

    The values depend only on the seed of torch's default generator (on
    every rank alike) and the global position of each element: the same
    seed gives the same whole tensor whatever the world size and spec.
    ``generator`` (the same seed on every rank) replaces the default one.
    """
    kwargs: dict[str, Any] = dict(
        dtype=dtype,
        layout=layout,
        requires_grad=requires_grad,
        pin_memory=pin_memory,
        memory_format=memory_format,
        process_group=process_group,
        init_rrefs=init_rrefs,
    )
    st = empty(sharding_spec, *size, **kwargs)
    fill_uniform(st, 0.0, 1.0, generator=generator)
    return st


def randn(
    sharding_spec: ShardingSpec,
    *size: Any,
    dtype: Optional[torch.dtype] = None,
    layout: torch.layout = torch.strided,
    requires_grad: bool = False,
    pin_memory: bool = False,
    memory_format: torch.memory_format = torch.contiguous_format,
    process_group: Any = None,
    init_rrefs: bool = False,
    generator: Optional[torch.Generator] = None,
) -> ShardedTensor:
    """Like :func:`empty`, filled with standard normal numbers (see :func:`rand` on seeds)."""
    kwargs: dict[str, Any] = dict(
        dtype=dtype,
        layout=layout,
        requires_grad=requires_grad,
        pin_memory=pin_memory,
        memory_format=memory_format,
        process_group=process_group,
        init_rrefs=init_rrefs,
    )
    st = empty(sharding_spec, *size, **kwargs)
    fill_normal(st, 0.0, 1.0, generator=generator)
    return st


def _as_sizes(size: Any) -> tuple[Any, ...]:
    if isinstance(size, int):
        return (size,)
    return tuple(size)


def init_from_local_shards(
    local_shards: list[Shard],
    *global_size: Any,
    process_group: Any = None,
    init_rrefs: bool = False,
) -> ShardedTensor:
    """Build a ShardedTensor from the shards each rank holds, checked across ranks.

    Every rank of the group calls it. Ranks exchange their shards'
    metadata (as JSON, through ``Group.exchange``) and each validates the
    whole picture the same way, so invalid input raises the same error on
    every rank instead of hanging some of them.

    Args:
        local_shards: This rank's shards (possibly none).
        *global_size: Size of the whole tensor. ``None`` for a dim (as in
            torch 2.13, e.g. ``init_from_local_shards(shards, None, None)``)
            works the size out: each rank passes one shard, and the shards
            are stacked along dim 0 in the order of their placement ranks
            (their offsets are recomputed; the other dims' sizes come from
            the lowest rank's shard).
        process_group: Group, torch ProcessGroup or None.
        init_rrefs: Must be False; checked after the shards are validated.

    Returns:
        The ShardedTensor; its spec is inferred from the shards (a chunk
        spec when they form one).

    Raises:
        ValueError: ranks disagree on the size or tensor properties, shards
            overlap, leave part of the tensor uncovered, stick out of it,
            or name a rank outside the group or another rank than the one
            passing them. A rank whose own input is bad raises the real
            error; its peers raise :class:`~shardwise.errors.PeerError`.
        TypeError: a local shard is not a :class:`Shard`.
        NotImplementedError: ``init_rrefs`` is True and the shards are valid.
    """
    return ShardedTensor._init_from_local_shards(
        local_shards, *global_size, process_group=process_group, init_rrefs=init_rrefs
    )
