"""Tensor plumbing shared by every collective: dtypes, wire views, JSON.

The "wire" form of a tensor is a flat, contiguous, detached view (or copy)
on a device the backend moves natively, in a dtype every backend can carry:
``bool`` travels as ``uint8`` and complex as its real view. Nothing here
communicates.
"""

from __future__ import annotations

import json
import math
from typing import Any, Optional, Sequence

import torch

__all__ = [
    "BITWISE_REDUCE_OPS",
    "DTYPES",
    "REDUCE_OPS",
    "check_reducible",
    "decode_json",
    "dtype_code",
    "encode_json",
    "from_bytes",
    "from_wire",
    "normalize_reduce_op",
    "overlapping",
    "shares_memory",
    "to_bytes",
    "to_wire",
    "wire_dtype",
]

#: Dtypes collectives accept, indexed by their code in the handshake.
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
    torch.uint16,
    torch.uint32,
    torch.uint64,
)
_CODES = {dtype: code for code, dtype in enumerate(DTYPES)}

REDUCE_OPS: tuple[str, ...] = ("sum", "avg", "min", "max", "product")
#: torch's bitwise reductions (``ReduceOp.BAND`` ...): not collectives of a shardwise ``Group``, but
#: a backend that implements torch's process-group API (the ``"mpi4py"`` torch backend) must accept
#: them, so their names are part of the one vocabulary too.
BITWISE_REDUCE_OPS: tuple[str, ...] = ("band", "bor", "bxor")
_OP_ALIASES = {"prod": "product", "mean": "avg", "add": "sum"}


def dtype_code(dtype: torch.dtype) -> int:
    """Code of ``dtype`` in :data:`DTYPES`.

    Raises:
        TypeError: the dtype cannot be sent (quantized, float8, ...).
    """
    try:
        return _CODES[dtype]
    except KeyError:
        names = ", ".join(str(d).replace("torch.", "") for d in DTYPES)
        raise TypeError(f"collectives cannot send {dtype} tensors; supported: {names}") from None


def normalize_reduce_op(op: Any, *, bitwise: bool = False) -> str:
    """``"sum"``, ``torch.distributed.ReduceOp.SUM`` ... as one of :data:`REDUCE_OPS`.

    Args:
        op: A name (any case; ``"prod"``, ``"mean"`` and ``"add"`` are aliases),
            a ``torch.distributed.ReduceOp`` member or a ``ReduceOp`` object.
        bitwise: Also accept :data:`BITWISE_REDUCE_OPS` (for backends of
            torch's process-group API).

    Raises:
        ValueError: the op is not one shardwise reduces with.
    """
    # A ReduceOp object (ReduceOp(ReduceOp.SUM)) carries its member in .op.
    op = getattr(op, "op", op)
    if isinstance(op, str):
        name = op.lower()
    else:
        # torch's ReduceOp and its RedOpType print as "ReduceOp.SUM" or "RedOpType.SUM".
        name = str(getattr(op, "name", op)).rsplit(".", 1)[-1].lower()
    name = _OP_ALIASES.get(name, name)
    known = (*REDUCE_OPS, *BITWISE_REDUCE_OPS) if bitwise else REDUCE_OPS
    if name not in known:
        raise ValueError(f"unsupported reduce op {op!r}; use one of {', '.join(known)}")
    return name


def check_reducible(dtype: torch.dtype, op: str) -> str:
    """The op to run on the wire form of ``dtype`` tensors for ``op``.

    Raises:
        TypeError: ``op`` has no meaning for ``dtype`` (avg of integers,
            min/max/product of complex numbers, avg of bools).
    """
    if dtype == torch.bool:
        if op == "avg":
            raise TypeError("avg of bool tensors is not defined; reduce with sum (logical or) or min")
        # On uint8 0/1 values, max is "or" and min is "and".
        return {"sum": "max", "max": "max", "min": "min", "product": "min"}[op]
    if dtype.is_complex and op not in ("sum", "avg"):
        raise TypeError(f"{op} of complex tensors is not elementwise; only sum and avg are defined")
    if op == "avg" and not (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(f"avg of {dtype} tensors would truncate; reduce with sum and divide yourself")
    return op


def to_wire(tensor: torch.Tensor, device: Optional[torch.device]) -> torch.Tensor:
    """Flat contiguous detached form of ``tensor`` on ``device``.

    Shares storage with ``tensor`` when it is already contiguous and on
    ``device`` (None means "keep its device"), so in-place collectives can
    write straight into the caller's tensor.
    """
    wire = tensor.detach()
    if wire.dtype == torch.bool:
        wire = wire.view(torch.uint8)
    elif wire.is_complex():
        wire = torch.view_as_real(wire.resolve_conj())
    if device is not None and wire.device != device:
        wire = wire.to(device)
    return wire.contiguous().reshape(-1)


def from_wire(flat: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Undo :func:`to_wire`: view ``flat`` as ``dtype`` with ``shape``."""
    if dtype == torch.bool:
        return flat.view(torch.bool).reshape(shape)
    if dtype.is_complex:
        return torch.view_as_complex(flat.reshape(*shape, 2))
    return flat.reshape(shape)


def wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of :func:`to_wire`'s result for a ``dtype`` tensor."""
    if dtype == torch.bool:
        return torch.uint8
    if dtype.is_complex:
        return torch.float32 if dtype == torch.complex64 else torch.float64
    return dtype


def to_bytes(tensor: torch.Tensor, device: Optional[torch.device]) -> torch.Tensor:
    """Flat contiguous ``uint8`` view (or copy) of ``tensor`` on ``device``.

    Collectives that only move data send bytes, so every dtype travels on
    every backend (gloo cannot send int16 or unsigned types as such).
    Shares storage with ``tensor`` when it is contiguous and on ``device``.
    """
    wire = tensor.detach().resolve_conj().resolve_neg()
    if device is not None and wire.device != device:
        wire = wire.to(device)
    flat = wire.contiguous().reshape(-1)
    if flat.numel() <= 1 and flat.stride(0) != 1:
        # A 0- or 1-element tensor counts as contiguous whatever its stride (an
        # expanded gradient has stride 0), but a byte view needs stride 1.
        flat = flat.clone(memory_format=torch.contiguous_format).as_strided((flat.numel(),), (1,))
    return flat.view(torch.uint8)


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether any byte of ``a`` may share memory with a byte of ``b`` (their spans intersect on one device).

    By address, not by storage object: two storages over one block of
    memory (``torch.frombuffer``, DLPack) share memory too. A span is
    conservative for strided tensors: views whose bytes interleave without
    sharing an element (``t[::2]`` and ``t[1::2]``) count as sharing, since
    a copy is always safe and a missed alias is not.
    """
    if not a.numel() or not b.numel() or a.device != b.device:
        return False
    a0, a1 = _span(a)
    b0, b1 = _span(b)
    return a0 < b1 and b0 < a1


def overlapping(tensors: Sequence[torch.Tensor]) -> list[bool]:
    """For each of ``tensors``, whether it may share memory with another of them (:func:`shares_memory`'s test).

    The answers of :func:`shares_memory` on every pair, in O(n log n): a
    collective's list of one tensor per rank is tested on every call, and
    its pairs grow with the square of the ranks. A tensor listed twice
    shares memory with its other entry.
    """
    flags = [False] * len(tensors)
    by_device: dict[torch.device, list[tuple[int, int, int]]] = {}
    for i, t in enumerate(tensors):
        if t.numel():
            by_device.setdefault(t.device, []).append((*_span(t), i))
    for spans in by_device.values():
        spans.sort()
        reach = -1  # the furthest end of the spans that start no later than this one
        for k, (start, end, i) in enumerate(spans):
            # An earlier span reaching past this start, or the next span starting before this end.
            flags[i] = start < reach or (k + 1 < len(spans) and spans[k + 1][0] < end)
            reach = max(reach, end)
    return flags


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The addresses of ``t``'s first and one past its last byte (any strides, negative ones too)."""
    low = high = t.data_ptr()
    for size, stride in zip(t.shape, t.stride(), strict=True):
        reach = (size - 1) * stride * t.element_size()
        low, high = (low + reach, high) if reach < 0 else (low, high + reach)
    return low, high + t.element_size()


def from_bytes(flat: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Undo :func:`to_bytes`: view ``flat`` bytes as ``dtype`` with ``shape``."""
    return flat.view(dtype).reshape(shape)


def _check_json_safe(obj: Any, path: str) -> None:
    if obj is None or isinstance(obj, (bool, int, str)):
        return
    if isinstance(obj, float):
        if not math.isfinite(obj):
            raise TypeError(f"{path} is {obj!r}; JSON has no NaN or infinity")
        return
    if isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            _check_json_safe(item, f"{path}[{i}]")
        return
    if isinstance(obj, dict):
        for key, value in obj.items():
            if not isinstance(key, str):
                raise TypeError(f"{path} has key {key!r} of type {type(key).__name__}; JSON keys must be str")
            _check_json_safe(value, f"{path}[{key!r}]")
        return
    raise TypeError(
        f"{path} is a {type(obj).__module__}.{type(obj).__qualname__}, which is not JSON-safe; "
        "exchange() carries only None, bool, int, float, str, list, tuple and dict with str keys"
    )


def encode_json(obj: Any) -> bytes:
    """Strict JSON bytes of ``obj`` (tuples become lists).

    Raises:
        TypeError: ``obj`` holds something JSON cannot represent exactly;
            the message gives its path (``obj['shards'][2]``).
    """
    _check_json_safe(obj, "obj")
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def decode_json(data: bytes, sender: str = "a peer") -> Any:
    """Parse bytes produced by :func:`encode_json` on a peer (never unpickles).

    Raises:
        ValueError: the bytes are not strict JSON (a peer running other
            code, or a crafted payload); they are not interpreted further.
    """
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(
            f"{sender} sent {len(data)} bytes that are not strict JSON ({type(exc).__name__}: {exc}); shardwise "
            "exchanges metadata only as JSON and never unpickles a peer's bytes, so the payload was rejected "
            "unread. Every rank must run the same shardwise version"
        ) from None


def _no_constant(name: str) -> Any:
    # NaN and Infinity are not strict JSON, and encode_json never writes them.
    raise ValueError(f"non-standard JSON constant {name}")
