"""A torch tensor as the buffer MPI reads or writes: zero-copy where it can be, staged where it cannot.

The buffer half of :mod:`shardwise_mpi._collectives` (its "Zero-copy" and
"CUDA tensors" conventions): :func:`_source` makes an input MPI can read,
:func:`_target` a buffer MPI writes for an output with the function that
puts it into the output, :func:`_buffer` hands a contiguous tensor's memory
to MPI, and :func:`cuda_aware` says whether device memory may go to MPI as
it is. Kept apart from the collectives themselves (which only decide what
moves where) to keep each module short.

Like ``_collectives``, this module imports ``mpi4py.MPI``, which initialises
MPI: it is imported only by ``_collectives``, itself imported lazily.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any, Callable, Optional

import torch

from shardwise_mpi._libmpi import ensure_matching_library

# mpi4py keeps the first MPI library it loads: choose the launcher's kind first.
ensure_matching_library()
from mpi4py import MPI  # noqa: E402

__all__ = ["cuda_aware"]


@functools.lru_cache(maxsize=1)
def cuda_aware() -> bool:
    """Whether the MPI library takes CUDA device pointers (``MPIX_Query_cuda_support``).

    mpi4py has no wrapper for this extension, so it is looked up in the
    already-loaded libmpi; a library without it is not CUDA-aware.
    """
    if not torch.cuda.is_available():
        return False
    names = [None, "libmpi.so.12", "libmpi.so.40", "libmpi.so", ctypes.util.find_library("mpi")]
    for name in names:
        try:
            lib = ctypes.CDLL(name)
            query = lib.MPIX_Query_cuda_support
        except (OSError, AttributeError, TypeError):
            continue
        query.restype = ctypes.c_int
        return bool(query())
    return False


def _buffer(t: torch.Tensor, readonly: bool = False) -> Any:
    """The memory of a contiguous tensor as a buffer MPI reads or writes in place."""
    nbytes = t.numel() * t.element_size()
    return MPI.buffer.fromaddress(t.data_ptr() if nbytes else 0, nbytes, readonly=readonly)


def _in_place(t: torch.Tensor) -> bool:
    """Whether MPI can use ``t``'s memory as it is: a contiguous CPU tensor without lazy conj/neg bits."""
    return t.device.type == "cpu" and t.is_contiguous() and not t.is_conj() and not t.is_neg()


def _nothing() -> None:
    pass


def _movable(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" or (t.device.type == "cuda" and cuda_aware())


def _source(t: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Contiguous, detached form of an input that MPI can read (shares memory when possible)."""
    if _in_place(t) and (dtype is None or t.dtype == dtype):
        return t  # MPI only reads its memory, so autograd never sees it
    src = t.detach().resolve_conj().resolve_neg()
    if not _movable(src):
        src = src.cpu()
    if dtype is not None and src.dtype != dtype:
        src = src.to(dtype)
    src = src.contiguous()
    if src.is_cuda:
        # MPI reads device memory outside torch's streams: queued kernels must finish first.
        torch.cuda.current_stream(src.device).synchronize()
    return src


def _target(t: torch.Tensor, dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, Callable[[], None]]:
    """A contiguous buffer MPI writes for output ``t``, and a function that puts it into ``t``.

    The buffer is ``t``'s own memory when ``t`` is contiguous, movable and of
    ``dtype``; otherwise a staging copy (holding ``t``'s current values, as
    in-place collectives read it too).
    """
    if _in_place(t) and (dtype is None or t.dtype == dtype):
        return t.detach(), _nothing
    out = t.detach()
    # A conjugate or negative view's memory holds the values before the flag: MPI's bytes would come out flagged.
    plain = not out.is_conj() and not out.is_neg()
    if _movable(out) and out.is_contiguous() and (dtype is None or out.dtype == dtype) and plain:
        if out.is_cuda:
            torch.cuda.current_stream(out.device).synchronize()
        return out, lambda: None
    work = _source(out, dtype)
    if work.data_ptr() == out.data_ptr() and work.numel():
        work = work.clone()

    def finish() -> None:
        out.copy_(work.view(out.shape) if work.dtype == out.dtype else work.view(out.shape).to(out.dtype))

    return work, finish
