"""Tensor methods on a ShardedTensor: detach, clone, requires_grad_, to/cpu/cuda, copy_, ``*_like``, deepcopy.

``nn.Parameter(st)`` works through two of them: ``Parameter.__new__``
calls ``st.detach().requires_grad_(requires_grad)`` on tensor subclasses
and marks the result ``_is_param``, so the parameter is a ShardedTensor
whose local shards are leaves that require grad.

``copy_`` takes a ShardedTensor of the same layout (boxes and ranks; the
devices may differ), copied shard by shard, or a plain tensor that
broadcasts to the whole size and is the same on every rank: each rank
copies the slices its shards cover. Different layouts are a ValueError on
every rank (all ranks see the same metadata).
"""

from __future__ import annotations

import copy as _copy
from dataclasses import replace
from typing import Any, Callable, Optional

import torch

from shardwise._comm.default_group import resolve_group
from shardwise._registry.records import ShardedOp
from shardwise._tensor.custom_ops import local_shards_op
from shardwise._tensor.ops.common import (
    box_key,
    map_shards,
    moved,
    op_name,
    record,
    records_for,
    set_properties,
    with_properties,
)
from shardwise._tensor.ops.random import fill_normal, fill_uniform
from shardwise._tensor.sharded_tensor import ShardedTensor
from shardwise._vocab.metadata import ShardedTensorMetadata, TensorProperties
from shardwise._vocab.shard import Shard

__all__ = ["records"]

_FORMATS = (torch.preserve_format, torch.contiguous_format)


def _self(name: str, args: Any) -> ShardedTensor:
    if not args or not isinstance(args[0], ShardedTensor):
        raise TypeError(f"{name}: self must be a ShardedTensor")
    st: ShardedTensor = args[0]
    return st


def _check_format(name: str, memory_format: Any) -> None:
    if memory_format is not None and memory_format not in _FORMATS:
        raise ValueError(
            f"{name}: ShardedTensor shards are contiguous; memory_format={memory_format} is not supported "
            "(use torch.preserve_format or torch.contiguous_format)"
        )


def _grad_result(st: ShardedTensor) -> bool:
    """Whether a differentiable copy of ``st`` requires grad here."""
    return bool(st.metadata().tensor_properties.requires_grad) and torch.is_grad_enabled()


# -- detach, clone, contiguous, requires_grad_ -------------------------------------------------


def _derive(make: Callable[[torch.Tensor], torch.Tensor], grad: Callable[[ShardedTensor], bool], copies: bool) -> Any:
    """``customized_func`` for :func:`local_shards_op`: shards ``make(shard)``, grad flag ``grad(st)``.

    ``copies``: the new shards are fresh memory (so not pinned).
    """

    def customized(args: Any, kwargs: Any, process_group: Any) -> tuple[list[Shard], ShardedTensorMetadata]:
        st = args[0]
        old = st.metadata().tensor_properties
        props = replace(old, requires_grad=grad(st), pin_memory=old.pin_memory and not copies)
        shards = [Shard(make(s.tensor), s.metadata) for s in st.local_shards()]
        return shards, with_properties(st.metadata(), props)

    return customized


def _check_clone(*args: Any, **kwargs: Any) -> None:
    _check_format("clone", kwargs.get("memory_format"))


def _check_contiguous(*args: Any, **kwargs: Any) -> None:
    _check_format("contiguous", args[1] if len(args) > 1 else kwargs.get("memory_format"))


def _all_contiguous(st: ShardedTensor, *args: Any, **kwargs: Any) -> bool:
    return all(s.tensor.is_contiguous() for s in st.local_shards())


_detach = local_shards_op(torch.Tensor.detach, customized_func=_derive(torch.Tensor.detach, lambda st: False, False))
_clone = local_shards_op(
    torch.Tensor.clone,
    extra_check=_check_clone,
    customized_func=_derive(lambda t: t.clone(memory_format=torch.contiguous_format), _grad_result, True),
)
_contiguous = local_shards_op(torch.Tensor.contiguous, early_stop_func=_all_contiguous, extra_check=_check_contiguous)


def _detach_(types: Any, args: Any, kwargs: Any, process_group: Any) -> ShardedTensor:
    st = _self("detach_", args)
    for shard in st.local_shards():
        shard.tensor.detach_()
    set_properties(st, replace(st.metadata().tensor_properties, requires_grad=False))
    return st


def _set_requires_grad(st: ShardedTensor, flag: bool) -> None:
    dtype = st.metadata().tensor_properties.dtype
    if flag and not (dtype.is_floating_point or dtype.is_complex):
        raise RuntimeError(f"only Tensors of floating point and complex dtype can require gradients, got {dtype}")
    for shard in st.local_shards():
        shard.tensor.requires_grad_(flag)
    set_properties(st, replace(st.metadata().tensor_properties, requires_grad=flag))


def _requires_grad_(types: Any, args: Any, kwargs: Any, process_group: Any) -> ShardedTensor:
    st = _self("requires_grad_", args)
    _set_requires_grad(st, bool(args[1] if len(args) > 1 else (kwargs or {}).get("requires_grad", True)))
    return st


def _requires_grad_set(types: Any, args: Any, kwargs: Any, process_group: Any) -> None:
    _set_requires_grad(_self("requires_grad", args), bool(args[1]))


# -- to / cpu / cuda / dtype conversions ---------------------------------------------------------


def convert(
    st: ShardedTensor,
    device: Optional[torch.device] = None,
    dtype: Optional[torch.dtype] = None,
    *,
    non_blocking: bool = False,
    copy: bool = False,
    process_group: Any = None,
) -> ShardedTensor:
    """``st`` on ``device`` with ``dtype`` (None: unchanged), shard by shard.

    Every placement moves to ``device`` (as named: ``"cuda"`` means each
    rank's current CUDA device). Returns ``st`` itself when nothing
    changes and ``copy`` is False, as ``Tensor.to`` does.
    """
    props = st.metadata().tensor_properties
    group = st.process_group if process_group is None else resolve_group(process_group)
    new_dtype = props.dtype if dtype is None else dtype
    shards_md = st.metadata().shards_metadata
    same_device = device is None or all(
        md.placement is not None and md.placement.device() == device for md in shards_md
    )
    changed = new_dtype != props.dtype or not same_device or copy
    if not changed and group is st.process_group:
        return st
    spec, new_md = (st.sharding_spec(), list(shards_md)) if same_device else moved(st, device)  # type: ignore[arg-type]
    by_box = {box_key(md): md for md in new_md}
    local = []
    for shard in st.local_shards():
        target = shard.tensor.device if same_device else by_box[box_key(shard.metadata)].placement.device()  # type: ignore[union-attr]
        tensor = shard.tensor.to(target, new_dtype, non_blocking=non_blocking, copy=copy)
        local.append(Shard(tensor, by_box[box_key(shard.metadata)]))
    differentiable = new_dtype.is_floating_point or new_dtype.is_complex
    requires_grad = props.requires_grad and (not changed or (torch.is_grad_enabled() and differentiable))
    new_props = TensorProperties(
        new_dtype, props.layout, requires_grad, props.memory_format, props.pin_memory and not changed
    )
    metadata = ShardedTensorMetadata(new_md, st.size(), new_props)
    if group is st.process_group:
        return ShardedTensor._create(spec, metadata, local, group)
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, metadata, group, sharding_spec=spec)


def _to(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
    st = _self("to", args)
    rest, kw = list(args[1:]), dict(kwargs or {})
    copy, group = kw.pop("copy", False), kw.pop("process_group", None)
    flags = [i for i, a in enumerate(rest) if isinstance(a, bool)]
    if len(flags) > 1:  # to(dtype, non_blocking, copy): torch's parser does not take copy
        copy = rest.pop(flags[1])
    if rest and isinstance(rest[0], ShardedTensor):
        rest[0] = torch.empty(0, dtype=rest[0].dtype, device=rest[0].device)
    device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*rest, **kw)
    _check_format("to", memory_format)
    return convert(st, device, dtype, non_blocking=non_blocking, copy=copy, process_group=group)


def _cpu(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
    kw = dict(kwargs or {})
    _check_format("cpu", kw.pop("memory_format", args[1] if len(args) > 1 else None))
    return convert(_self("cpu", args), torch.device("cpu"), process_group=kw.pop("process_group", None))


def _cuda(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
    kw = dict(kwargs or {})
    device = kw.pop("device", args[1] if len(args) > 1 else None)
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
    _check_format("cuda", kw.pop("memory_format", None))
    st = _self("cuda", args)
    return convert(st, device, non_blocking=kw.pop("non_blocking", False), process_group=kw.pop("process_group", None))


def _as_dtype(dtype: torch.dtype) -> Callable[..., Any]:
    def impl(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
        _check_format(str(dtype), (kwargs or {}).get("memory_format"))
        return convert(_self(str(dtype), args), dtype=dtype)

    return impl


def _type_as(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
    self, other = args[0], args[1] if len(args) > 1 else (kwargs or {})["other"]
    if not isinstance(self, ShardedTensor):
        return self.to(device=other.device, dtype=other.dtype)
    return convert(self, other.device, other.dtype)


# -- .data = ----------------------------------------------------------------------------------------


def _data_set(types: Any, args: Any, kwargs: Any, process_group: Any) -> None:
    """``st.data = other``: ``st`` takes ``other``'s layout, dtype and data and keeps its identity.

    What ``nn.Module.to()``/``cpu()``/``double()`` do to each parameter.
    Where this rank's shards keep their boxes (a device or dtype change),
    each local shard takes the new data with ``shard.data = new`` as a plain
    parameter would, so the shard tensors an optimizer holds, their grads
    and their ``requires_grad`` stay; otherwise the new shards are detached
    and take ``st``'s ``requires_grad``.
    """
    st = _self("data", args)
    new = args[1] if len(args) > 1 else (kwargs or {}).get("value")
    if new is st:
        return
    if not isinstance(new, ShardedTensor):
        raise TypeError(
            f"ShardedTensor.data must be set to a ShardedTensor, got {type(new).__name__}; "
            "shard the tensor first (shardwise.shard_tensor) or copy_ it in"
        )
    requires_grad = bool(st.metadata().tensor_properties.requires_grad)
    dtype = new.metadata().tensor_properties.dtype
    if requires_grad and not (dtype.is_floating_point or dtype.is_complex):
        raise RuntimeError(
            f"cannot set the data of a ShardedTensor that requires grad to one of dtype {dtype}: only floating "
            "point and complex tensors can require gradients (call requires_grad_(False) first)"
        )
    old_shards, new_shards = st.local_shards(), new.local_shards()
    if [box_key(s.metadata) for s in old_shards] == [box_key(s.metadata) for s in new_shards]:
        for old, fresh in zip(old_shards, new_shards, strict=True):
            old.tensor.data = fresh.tensor
        local = [Shard(old.tensor, fresh.metadata) for old, fresh in zip(old_shards, new_shards, strict=True)]
    else:
        local = [Shard(s.tensor.detach().requires_grad_(requires_grad), s.metadata) for s in new_shards]
    with torch._C.DisableTorchFunctionSubclass():
        # The wrapper itself takes the new dtype and device (its autograd flag stays).
        torch.Tensor.data.__set__(st, new)  # type: ignore[attr-defined]
    props = replace(new.metadata().tensor_properties, requires_grad=requires_grad)
    st._replace(
        spec=new.sharding_spec(), metadata=with_properties(new.metadata(), props), shards=local,
        group=new.process_group,
    )


# -- copy_ ---------------------------------------------------------------------------------------


def _copy_(types: Any, args: Any, kwargs: Any, process_group: Any) -> ShardedTensor:
    st = _self("copy_", args)
    src = args[1] if len(args) > 1 else (kwargs or {})["src"]
    if isinstance(src, ShardedTensor):
        return map_shards(torch.Tensor.copy_, args, kwargs, inplace=True, devices=False)  # type: ignore[no-any-return]
    if not isinstance(src, torch.Tensor):
        raise TypeError(f"copy_: src must be a tensor, got {type(src).__name__}")
    size = st.size()
    try:
        fits = torch.broadcast_shapes(src.shape, size) == size
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(
            f"copy_: a plain tensor of size {list(src.shape)} does not broadcast to the ShardedTensor's size "
            f"{list(size)}; pass the whole tensor (the same on every rank) or a ShardedTensor of the same layout"
        )
    whole = src.expand(size)
    rest = dict(kwargs or {})
    rest.pop("src", None)
    for shard in st.local_shards():
        md = shard.metadata
        piece = whole[tuple(slice(o, o + n) for o, n in zip(md.shard_offsets, md.shard_sizes, strict=True))]
        shard.tensor.copy_(piece, *args[2:], **rest)
    grad = bool(st.requires_grad) or (src.requires_grad and torch.is_grad_enabled())
    set_properties(st, replace(st.metadata().tensor_properties, requires_grad=grad))
    return st


# -- *_like --------------------------------------------------------------------------------------

_LIKE_KEYS = {"dtype", "layout", "device", "requires_grad", "memory_format", "pin_memory"}


def like(
    st: ShardedTensor,
    name: str,
    fill: Callable[[ShardedTensor], Any],
    kwargs: dict[str, Any],
) -> ShardedTensor:
    """A new tensor of ``st``'s layout filled by ``fill``, with ``*_like``'s keyword arguments.

    Raises:
        TypeError: an unknown keyword.
        ValueError: a layout or memory format shards cannot have.
    """
    unknown = set(kwargs) - _LIKE_KEYS
    if unknown:
        raise TypeError(f"{name}() got unexpected keyword arguments {sorted(unknown)}")
    if kwargs.get("layout") not in (None, torch.strided):
        raise ValueError(f"{name}: only torch.strided layout is supported, got {kwargs['layout']}")
    _check_format(name, kwargs.get("memory_format"))
    dtype = kwargs.get("dtype") or st.dtype
    device = kwargs.get("device")
    spec, shards_md = (st.sharding_spec(), list(st.metadata().shards_metadata))
    if device is not None:
        spec, shards_md = moved(st, torch.device(device))
    pin = bool(kwargs.get("pin_memory", False))
    group = st.process_group
    local = [
        Shard(torch.empty(md.shard_sizes, dtype=dtype, device=md.placement.device(), pin_memory=pin), md)  # type: ignore[union-attr]
        for md in shards_md
        if group.is_member and md.rank == group.global_rank  # placements name global ranks
    ]
    requires_grad = bool(kwargs.get("requires_grad", False))
    props = TensorProperties(dtype=dtype, pin_memory=pin)
    out = ShardedTensor._create(spec, ShardedTensorMetadata(shards_md, st.size(), props), local, group)
    fill(out)
    if requires_grad:
        _set_requires_grad(out, True)
    return out


Filler = Callable[[ShardedTensor, Any, Any], Any]


def _like_op(name: str, fill: Filler, with_value: bool = False, random: bool = False) -> Callable[..., Any]:
    """``torch.*_like``: ``fill(out, fill_value, generator)`` on a new tensor of the input's layout."""

    def impl(types: Any, args: Any, kwargs: Any, process_group: Any) -> ShardedTensor:
        st = _self(name, args)
        kw = dict(kwargs or {})
        value = (args[1] if len(args) > 1 else kw.pop("fill_value")) if with_value else None
        generator = kw.pop("generator", None) if random else None
        return like(st, name, lambda out: fill(out, value, generator), kw)

    return impl


def _fill_value(out: ShardedTensor, value: Any, generator: Any) -> None:
    for shard in out.local_shards():
        shard.tensor.fill_(value)


# -- deepcopy, data, new_tensor ------------------------------------------------------------------


def _deepcopy(types: Any, args: Any, kwargs: Any, process_group: Any) -> ShardedTensor:
    st = _self("__deepcopy__", args)
    memo = args[1] if len(args) > 1 else (kwargs or {}).get("memo")
    memo = {} if memo is None else memo
    if id(st) in memo:
        return memo[id(st)]  # type: ignore[no-any-return]
    with torch.no_grad():
        out: ShardedTensor = _clone(types, (st,), {}, process_group)
    for old, new in zip(st.local_shards(), out.local_shards(), strict=True):
        new.tensor.requires_grad_(old.tensor.requires_grad)
        if old.tensor.grad is not None:
            new.tensor.grad = _copy.deepcopy(old.tensor.grad, memo)
    set_properties(out, st.metadata().tensor_properties)
    if getattr(st, "_is_param", False):
        out._is_param = True
    memo[id(st)] = out
    return out


def _new_tensor(types: Any, args: Any, kwargs: Any, process_group: Any) -> torch.Tensor:
    st = _self("new_tensor", args)
    kw = dict(kwargs or {})
    data = args[1] if len(args) > 1 else kw.pop("data")
    if isinstance(data, ShardedTensor):
        raise TypeError("new_tensor: data must not be a ShardedTensor (use clone())")
    dtype, device = kw.pop("dtype", None) or st.dtype, kw.pop("device", None) or st.device
    requires_grad = kw.pop("requires_grad", False)
    if isinstance(data, torch.Tensor):
        return data.detach().to(device, dtype, copy=True).requires_grad_(requires_grad)
    return torch.tensor(data, dtype=dtype, device=device, requires_grad=requires_grad, **kw)


def records() -> list[ShardedOp]:
    """Tensor methods and ``*_like`` creation on a ShardedTensor."""
    T = torch.Tensor
    conversions = [
        (T.float, torch.float32),
        (T.double, torch.float64),
        (T.half, torch.float16),
        (T.bfloat16, torch.bfloat16),
        (T.int, torch.int32),
        (T.long, torch.int64),
        (T.short, torch.int16),
        (T.bool, torch.bool),
    ]
    likes: list[tuple[Any, Filler, bool, bool]] = [
        (torch.empty_like, lambda out, value, g: None, False, False),
        (torch.zeros_like, lambda out, value, g: _fill_value(out, 0, g), False, False),
        (torch.ones_like, lambda out, value, g: _fill_value(out, 1, g), False, False),
        (torch.full_like, _fill_value, True, False),
        (torch.rand_like, lambda out, value, g: fill_uniform(out, 0.0, 1.0, g), False, True),
        (torch.randn_like, lambda out, value, g: fill_normal(out, 0.0, 1.0, g), False, True),
    ]
    return (
        records_for([T.detach, torch.detach, T.data.__get__], lambda op: _detach, "detached shards")  # type: ignore[attr-defined]
        + records_for([T.clone, torch.clone], lambda op: _clone, "cloned shards")
        + [
            record(T.detach_, _detach_, "detach shards in place"),
            record(T.contiguous, _contiguous, "contiguous shards"),
            record(T.requires_grad_, _requires_grad_, "set requires_grad on the local shards"),
            record(T.requires_grad.__set__, _requires_grad_set, "set requires_grad on the local shards"),  # type: ignore[attr-defined]
            record(T.to, _to, "dtype/device conversion, shard by shard"),
            record(T.cpu, _cpu, "shards to the CPU"),
            record(T.cuda, _cuda, "shards to CUDA"),
            record(T.type_as, _type_as, "dtype/device of another tensor"),
            record(T.copy_, _copy_, "copy from a tensor of the same layout or the whole tensor"),
            record(T.data.__set__, _data_set, "take another ShardedTensor's data, keeping identity"),  # type: ignore[attr-defined]
            record(T.__deepcopy__, _deepcopy, "deep copy of the local shards"),
            record(T.new_tensor, _new_tensor, "a plain tensor from data, with this tensor's dtype and device"),
        ]
        + [record(op, _as_dtype(dtype), f"conversion to {dtype}") for op, dtype in conversions]
        + [
            record(op, _like_op(op_name(op), fill, value, random), "same layout, new data")
            for op, fill, value, random in likes
        ]
    )
