"""Large CPU buffers backed by transparent huge pages.

Why: a fresh tensor of tens of MiB comes from ``mmap`` (glibc hands out
every block above 32 MiB that way, and gives it back on free), so each
call of a sharded op or collective faults its result in 4 KiB at a time.
Measured on a 2-core CPU machine, faulting a 51 MiB gradient costs
~18 ms while writing it costs ~5 ms; the faults, not the arithmetic,
dominated sharded embedding passes. Buffers from here are anonymous
mappings advised ``MADV_HUGEPAGE``, so the kernel maps them 2 MiB at a
time (when its THP mode is ``always`` or ``madvise``; under ``never``
they behave like ordinary memory).

The tensors are ordinary CPU tensors except that their storage cannot be
resized (``resize_`` to a larger size raises); the mapping is released
when the last tensor viewing it is freed. ``SHARDWISE_HUGE_PAGES=0``
turns this off (every buffer then comes from torch's allocator).
"""

from __future__ import annotations

import math
import mmap
import os
from typing import Optional, Sequence, Union

import torch

__all__ = ["HUGE_PAGE_MIN_BYTES", "empty", "empty_like", "huge_pages_enabled", "zeros"]

#: Smallest buffer worth a mapping of its own: below it glibc's heap reuses freed memory anyway.
HUGE_PAGE_MIN_BYTES = 4 << 20

Shape = Union[Sequence[int], torch.Size]


def huge_pages_enabled() -> bool:
    """Whether large CPU buffers get their own huge-page mapping (``SHARDWISE_HUGE_PAGES``, default on)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False  # not Linux, or a Python built without it
    return os.environ.get("SHARDWISE_HUGE_PAGES", "1").strip().lower() not in ("0", "false", "no", "off")


def _mapped(shape: Shape, dtype: torch.dtype) -> torch.Tensor:
    region = mmap.mmap(-1, _nbytes(shape, dtype), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    # The tensor keeps the mmap object alive; freeing the last view unmaps it.
    return torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(tuple(shape))


def _nbytes(shape: Shape, dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _wants_mapping(shape: Shape, dtype: torch.dtype, device: Optional[torch.device]) -> bool:
    if device is not None and torch.device(device).type != "cpu":
        return False
    return _nbytes(shape, dtype) >= HUGE_PAGE_MIN_BYTES and huge_pages_enabled()


def empty(shape: Shape, dtype: torch.dtype, device: Optional[torch.device] = None) -> torch.Tensor:
    """An uninitialised contiguous tensor; large CPU ones on huge pages.

    Args:
        shape: Size of the result.
        dtype: Its dtype.
        device: Its device (None: CPU). Other devices use ``torch.empty``.

    Returns:
        A contiguous tensor (its contents are zero when it came from a mapping,
        but callers must not rely on that; use :func:`zeros`).
    """
    if _wants_mapping(shape, dtype, device):
        return _mapped(shape, dtype)
    return torch.empty(tuple(shape), dtype=dtype, device=device)


def empty_like(tensor: torch.Tensor, shape: Optional[Shape] = None) -> torch.Tensor:
    """:func:`empty` with ``tensor``'s dtype and device (and its shape unless ``shape`` is given)."""
    return empty(tensor.shape if shape is None else shape, tensor.dtype, tensor.device)


def zeros(shape: Shape, dtype: torch.dtype, device: Optional[torch.device] = None) -> torch.Tensor:
    """A zero-filled contiguous tensor; large CPU ones on huge pages (the kernel zero-fills them)."""
    if _wants_mapping(shape, dtype, device):
        return _mapped(shape, dtype)
    return torch.zeros(tuple(shape), dtype=dtype, device=device)
