"""Attribute reads (``shape``, ``dtype``, ``requires_grad``, ...) on the wrapper itself.

The wrapper tensor carries the global size, dtype and layout, so these run
torch's own getter on it with subclass dispatch switched off.
"""

from __future__ import annotations

from typing import Any

import torch

from shardwise._registry.records import ShardedOp
from shardwise._tensor.specs import ShardingSpec

_PASSTHROUGH = (
    torch.Tensor.shape.__get__,  # type: ignore[attr-defined]
    torch.Tensor.dtype.__get__,  # type: ignore[attr-defined]
    torch.Tensor.layout.__get__,  # type: ignore[attr-defined]
    torch.Tensor.ndim.__get__,  # type: ignore[attr-defined]
    torch.Tensor.is_leaf.__get__,  # type: ignore[attr-defined]
    torch.Tensor.grad.__get__,  # type: ignore[union-attr]
    torch.Tensor.grad.__set__,  # type: ignore[union-attr]
    torch.Tensor.grad_fn.__get__,  # type: ignore[union-attr]
    torch.Tensor.is_sparse.__get__,  # type: ignore[attr-defined]
    torch.Tensor.is_quantized.__get__,  # type: ignore[attr-defined]
    torch.Tensor.is_meta.__get__,  # type: ignore[attr-defined]
    torch.Tensor.is_cuda.__get__,  # type: ignore[attr-defined]
    torch.Tensor.is_floating_point,
    torch.Tensor.is_complex,
    torch.Tensor.element_size,
    torch.Tensor.__reduce_ex__,
    torch._has_compatible_shallow_copy_type,
    torch.Tensor.numel,
    torch.Tensor.nelement,
    torch.numel,
)


def _passthrough(func: Any) -> Any:
    def impl(types: Any, args: Any = (), kwargs: Any = None, process_group: Any = None) -> Any:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    impl.__name__ = f"passthrough_{getattr(func, '__name__', 'op')}"
    return impl


def _requires_grad(types: Any, args: Any = (), kwargs: Any = None, process_group: Any = None) -> bool:
    return bool(args[0].metadata().tensor_properties.requires_grad)


def _device(types: Any, args: Any = (), kwargs: Any = None, process_group: Any = None) -> torch.device:
    st = args[0]
    shards = st.local_shards()
    if shards:
        device: torch.device = shards[0].tensor.device
        return device
    with torch._C.DisableTorchFunctionSubclass():
        return torch.Tensor.device.__get__(st)


def _is_contiguous(types: Any, args: Any = (), kwargs: Any = None, process_group: Any = None) -> bool:
    st = args[0]
    memory_format = (kwargs or {}).get("memory_format", args[1] if len(args) > 1 else torch.contiguous_format)
    return all(shard.tensor.is_contiguous(memory_format=memory_format) for shard in st.local_shards())


def records() -> list[ShardedOp]:
    """Attribute reads on the wrapper."""
    out = [
        ShardedOp(op=func, spec=ShardingSpec, impl=_passthrough(func), description="attribute of the wrapper")
        for func in _PASSTHROUGH
    ]
    out += [
        ShardedOp(
            op=torch.Tensor.requires_grad.__get__,  # type: ignore[attr-defined]
            spec=ShardingSpec,
            impl=_requires_grad,
            description="whether the local shards require grad",
        ),
        ShardedOp(
            op=torch.Tensor.device.__get__,
            spec=ShardingSpec,
            impl=_device,
            description="device of the local shards",
        ),
        ShardedOp(
            op=torch.Tensor.is_contiguous,
            spec=ShardingSpec,
            impl=_is_contiguous,
            description="whether every local shard is contiguous",
        ),
    ]
    return out
