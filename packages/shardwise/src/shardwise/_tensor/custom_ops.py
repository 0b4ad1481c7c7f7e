"""User-registered sharded ops and the helper for ops that act shard by shard.

``custom_sharded_op_impl`` and ``custom_sharding_spec_op`` are decorators
that feed the same registry as plugins: they add :class:`ShardedOp` records
(``override=True``) to a list that the built-in plugin ``shardwise._tensor.custom_ops``
returns from its ``shardwise_sharded_ops`` hook. Decorating never builds the
plugin manager; it only invalidates one that is already built.
"""

from __future__ import annotations

import functools
import inspect
import threading
from typing import TYPE_CHECKING, Any, Callable, Optional

from shardwise._registry import manager as _registry
from shardwise._registry.records import ShardedOp, qualified_name
from shardwise._tensor.sharded_tensor import ShardedTensor
from shardwise._tensor.specs import ChunkShardingSpec, ShardingSpec
from shardwise._vocab.shard import Shard
from shardwise.hookspecs import hookimpl

if TYPE_CHECKING:
    from shardwise._tensor.sharded_tensor import ShardedTensor

__all__ = [
    "custom_sharded_op_impl",
    "custom_sharding_spec_op",
    "local_shards_op",
    "local_tensor_op",
    "register_sharded_op_on_local_shards",
    "register_sharded_op_on_local_tensor",
]

_lock = threading.Lock()
_custom: dict[tuple[Any, type], ShardedOp] = {}

Impl = Callable[..., Any]


@hookimpl
def shardwise_sharded_ops() -> list[ShardedOp]:
    """The ops registered with the decorators in this process."""
    with _lock:
        return list(_custom.values())


def _add(record: ShardedOp) -> None:
    with _lock:
        # Re-registering the same (op, spec) replaces it, as torch's dicts did.
        _custom[(record.op, record.spec)] = record
    current = _registry._current
    if current is not None:
        current.invalidate()


def _remove(op: Any, spec: type) -> None:
    """Forget a decorator registration (tests use this to clean up)."""
    with _lock:
        _custom.pop((op, spec), None)
    current = _registry._current
    if current is not None:
        current.invalidate()


def _check_signature(decorator: str, func: Any, impl: Any) -> None:
    """Raise unless ``impl`` takes the four arguments every sharded op is called with.

    Raises:
        TypeError: ``impl`` is not callable or takes another number of
            parameters (the message carries torch 2.13's wording).
    """
    if not callable(impl):
        raise TypeError(f"{decorator}({qualified_name(func)}) decorates a callable, got {type(impl).__name__}")
    try:
        signature = inspect.signature(impl)
    except (TypeError, ValueError):
        return  # a builtin without introspectable parameters: it is called as any other impl
    if len(signature.parameters) != 4:
        name = getattr(impl, "__qualname__", repr(impl))
        raise TypeError(
            f"{decorator}({qualified_name(func)}): {name}{signature} cannot be called as a sharded op; it must "
            f"take exactly (types, args, kwargs, process_group). Custom sharded op function expects signature: "
            f"(types, args, kwargs, process_group), but received signature: {signature}"
        )


def custom_sharded_op_impl(func: Any) -> Callable[[Impl], Impl]:
    """Register ``impl(types, args, kwargs, process_group)`` for ``func`` on every spec.

    It takes precedence over every plugin's implementation of ``func``.

    Raises:
        TypeError: the decorated function does not take exactly
            ``(types, args, kwargs, process_group)``.

    Example::

        @custom_sharded_op_impl(torch.nn.functional.linear)
        def my_linear(types, args, kwargs, process_group):
            ...
    """
    def decorator(impl: Impl) -> Impl:
        _check_signature("custom_sharded_op_impl", func, impl)
        _add(ShardedOp(op=func, spec=ShardingSpec, impl=impl, description="custom_sharded_op_impl", override=True))
        return impl

    return decorator


def custom_sharding_spec_op(sharding_spec_class: type, func: Any) -> Callable[[Impl], Impl]:
    """Register ``impl(types, args, kwargs, process_group)`` for ``func`` on one spec class.

    It takes precedence over every plugin's implementation of ``func`` for
    that spec class and its subclasses.

    Raises:
        TypeError: ``sharding_spec_class`` is not a ShardingSpec subclass, or
            the decorated function does not take exactly
            ``(types, args, kwargs, process_group)``.
    """
    if not (isinstance(sharding_spec_class, type) and issubclass(sharding_spec_class, ShardingSpec)):
        raise TypeError(f"custom_sharding_spec_op needs a ShardingSpec subclass, got {sharding_spec_class!r}")

    def decorator(impl: Impl) -> Impl:
        _check_signature("custom_sharding_spec_op", func, impl)
        _add(
            ShardedOp(
                op=func, spec=sharding_spec_class, impl=impl, description="custom_sharding_spec_op", override=True
            )
        )
        return impl

    return decorator


def _prologue(
    op: Any,
    args: Any,
    kwargs: dict[str, Any],
    early_stop_func: Optional[Callable[..., bool]],
    extra_check: Optional[Callable[..., None]],
) -> tuple[ShardedTensor, bool]:
    """The ShardedTensor argument, after the checks; True when ``early_stop_func`` says to return it as is."""
    if not args or not isinstance(args[0], ShardedTensor):
        raise TypeError(f"{getattr(op, '__name__', op)} expects a ShardedTensor as its first argument")
    if extra_check is not None:
        extra_check(*args, **kwargs)
    return args[0], early_stop_func is not None and bool(early_stop_func(*args, **kwargs))


def local_shards_op(
    op: Any,
    early_stop_func: Optional[Callable[..., bool]] = None,
    extra_check: Optional[Callable[..., None]] = None,
    customized_func: Optional[Callable[..., Any]] = None,
) -> Impl:
    """An impl that applies ``op`` to each local shard and keeps the layout.

    Args:
        op: The torch op; called as ``op(shard_tensor, *args[1:], **kwargs)``.
        early_stop_func: ``f(*args, **kwargs) -> bool``; when true the input
            ShardedTensor is returned unchanged.
        extra_check: ``f(*args, **kwargs)``, raising to reject the call
            (e.g. softmax along the sharded dim).
        customized_func: ``f(args, kwargs, process_group) -> (local_shards,
            metadata)`` computing the new shards and metadata itself.

    Returns:
        ``impl(types, args, kwargs, process_group)`` for a :class:`ShardedOp`.
    """

    @functools.wraps(op)
    def impl(types: Any, args: Any = (), kwargs: Any = None, process_group: Any = None) -> Any:
        kwargs = kwargs or {}
        st, stop = _prologue(op, args, kwargs, early_stop_func, extra_check)
        if stop:
            return st
        if customized_func is not None:
            new_shards, metadata = customized_func(args, kwargs, process_group)
        else:
            new_shards = [Shard(op(shard.tensor, *args[1:], **kwargs), shard.metadata) for shard in st.local_shards()]
            metadata = st.metadata()
        return ShardedTensor._create(st.sharding_spec(), metadata, new_shards, st.process_group)

    return impl


def register_sharded_op_on_local_shards(
    op: Any,
    early_stop_func: Optional[Callable[..., bool]] = None,
    extra_check: Optional[Callable[..., None]] = None,
    customized_func: Optional[Callable[..., Any]] = None,
) -> Impl:
    """Register ``op`` to run on each local shard (torch's ``_register_sharded_op_on_local_shards``).

    For ops such as ``softmax`` along an unsharded dim. See
    :func:`local_shards_op` for the arguments. The registration overrides
    plugin implementations, like :func:`custom_sharded_op_impl`.

    Returns:
        The registered impl.
    """
    impl = local_shards_op(op, early_stop_func, extra_check, customized_func)
    return custom_sharded_op_impl(op)(impl)


def local_tensor_op(
    op: Any,
    early_stop_func: Optional[Callable[..., bool]] = None,
    extra_check: Optional[Callable[..., None]] = None,
    customized_func: Optional[Callable[..., Any]] = None,
) -> Impl:
    """An impl that applies ``op`` to the rank's single local tensor.

    The result keeps the input's spec and size unless ``customized_func``
    says otherwise. A rank holding no shard (a chunk spec with fewer
    placements than ranks) gets a result with no local shard.

    Args:
        op: The torch op; called as ``op(local_tensor, *args[1:], **kwargs)``.
        early_stop_func: ``f(*args, **kwargs) -> bool``; when true the input
            is returned unchanged.
        extra_check: ``f(*args, **kwargs)``, raising to reject the call.
        customized_func: ``f(args, kwargs, process_group) -> (local_tensor,
            sharding_spec, size)``.

    Returns:
        ``impl(types, args, kwargs, process_group)`` for a :class:`ShardedOp`.

    Raises (from the impl):
        TypeError: the rank holds several local shards.
    """

    @functools.wraps(op)
    def impl(types: Any, args: Any = (), kwargs: Any = None, process_group: Any = None) -> Any:
        kwargs = kwargs or {}
        st, stop = _prologue(op, args, kwargs, early_stop_func, extra_check)
        if stop:
            return st
        shards = st.local_shards()
        if len(shards) > 1:
            raise TypeError(
                f"{getattr(op, '__name__', op)} on a ShardedTensor needs one local shard per rank; "
                f"rank {st.process_group.rank} holds {len(shards)}"
            )
        if customized_func is not None:
            local, spec, size = customized_func(args, kwargs, process_group)
        elif not shards:
            return ShardedTensor._create(st.sharding_spec(), st.metadata(), [], st.process_group)
        else:
            local = op(shards[0].tensor, *args[1:], **kwargs)
            spec, size = st.sharding_spec(), st.size()
        return ShardedTensor._init_from_local_tensor(local.contiguous(), spec, size, process_group=st.process_group)

    return impl


def register_sharded_op_on_local_tensor(
    op: Any,
    early_stop_func: Optional[Callable[..., bool]] = None,
    extra_check: Optional[Callable[..., None]] = None,
    customized_func: Optional[Callable[..., Any]] = None,
    sharding_spec_class: Optional[type] = None,
) -> Impl:
    """Register ``op`` on the single local tensor (torch's ``_register_sharded_op_on_local_tensor``).

    Registers for ``ChunkShardingSpec`` by default, as torch did. See
    :func:`local_tensor_op` for the arguments. Plugins should instead put
    ``ShardedOp(op, spec, local_tensor_op(op, ...))`` in their
    ``shardwise_sharded_ops`` hook.

    Returns:
        The registered impl.
    """
    if sharding_spec_class is None:
        sharding_spec_class = ChunkShardingSpec
    impl = local_tensor_op(op, early_stop_func, extra_check, customized_func)
    return custom_sharding_spec_op(sharding_spec_class, op)(impl)
