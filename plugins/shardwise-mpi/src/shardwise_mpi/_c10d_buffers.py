"""Buffer fast paths of the ``"mpi4py"`` torch backend (``_c10d.py``): fewer copies, fewer page faults.

Two things made torch-native code slower over this backend than it had to be
(measured with ``benchmarks/dtensor.py``, 2 ranks, 64 MiB):

* **Staging the list forms.** ``scatter``, ``gather``, ``all_gather``,
  ``all_to_all`` and ``reduce_scatter`` take lists of tensors and MPI takes
  one buffer, so each call concatenated its inputs into a new flat tensor
  (and/or received into one and copied out): a full extra copy of the data
  into freshly allocated memory. The lists torch code passes are very often
  pieces of one contiguous tensor, back to back (DTensor's
  ``distribute_tensor`` scatters ``tensor.chunk(n)``; ``t.split(k)`` as
  outputs). :func:`flat_view` sees that and hands MPI the memory the pieces
  already share, so nothing is staged. The MPI calls stay the same on every
  rank whatever each rank's layout (a rank's buffers decide only whether
  *it* stages), so ranks can never disagree about which collective runs.
  ``scatter`` and ``gather`` go further: :func:`scatter_list` and
  :func:`gather_list` send each piece from, and receive it into, its own
  tensor point to point (what MPICH's ``Scatterv``/``Gatherv`` do inside
  anyway), so separate tensors are not staged either, and the root's own
  piece is a local copy (MPICH's send to self of 32 MiB cost ~4x a memcpy).
* **First-touch page faults.** The outputs torch allocates for a collective
  (``full_tensor``'s all-gather, ``distribute_tensor``'s scatter) are fresh
  memory: on Linux each 4 KiB page faults and is zeroed when MPI first
  writes it, which cost more than the copy itself (64 MiB: about 23 ms of
  faults against 9 ms of copying on the benchmark machine).
  :func:`prefer_huge_pages` advises the kernel (``madvise(MADV_HUGEPAGE)``)
  to back the 2 MiB-aligned interior of a large output with transparent huge
  pages before MPI writes it: one fault per 2 MiB. It is only a hint: the
  values are the same, memory outside the tensor is not touched, and where
  transparent huge pages are off (``never``) or unsupported nothing happens.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from typing import Any, Callable, Optional, Sequence

import torch

__all__ = [
    "HUGE_PAGE_MIN_BYTES",
    "flat_view",
    "gather_list",
    "list_source",
    "list_target",
    "prefer_huge_pages",
    "scatter_list",
]

#: Outputs smaller than this are not advised (too few pages to matter against the system call).
HUGE_PAGE_MIN_BYTES = 4 << 20
_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # Linux, every architecture (asm-generic/mman-common.h)


@functools.lru_cache(maxsize=1)
def _madvise() -> Optional[Callable[..., int]]:
    """libc's ``madvise``, or None off Linux or where it cannot be found."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):  # pragma: no cover - a libc without madvise
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    result: Callable[..., int] = fn
    return result


def prefer_huge_pages(*tensors: Optional[torch.Tensor]) -> None:
    """Advise transparent huge pages for the memory of large contiguous CPU ``tensors`` that MPI is about to write.

    Only whole 2 MiB pages inside each tensor's own bytes are advised, so no
    other tensor's memory changes. Failures (no THP support) are ignored:
    the advice changes speed, never values.
    """
    madvise = None
    for t in tensors:
        if t is None or t.device.type != "cpu" or not t.is_contiguous():
            continue
        nbytes = t.numel() * t.element_size()
        if nbytes < HUGE_PAGE_MIN_BYTES:
            continue
        madvise = madvise or _madvise()
        if madvise is None:
            return
        start = t.data_ptr()
        lo = -(-start // _HUGE_PAGE) * _HUGE_PAGE
        hi = (start + nbytes) // _HUGE_PAGE * _HUGE_PAGE
        if hi > lo:
            madvise(lo, hi - lo, _MADV_HUGEPAGE)


def flat_view(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """A 1-D tensor over exactly the memory of ``tensors`` when they lie back to back in one storage, else None.

    Each tensor must be contiguous, of one dtype and device, without lazy
    conj/neg bits, and start where the previous one (skipping empty ones)
    ends, in one storage (``t.chunk(n)`` / ``t.split(k)`` of a contiguous
    ``t``). Writing the view writes the tensors; it carries no autograd
    history. None when the list is empty or holds no element.
    """
    if not tensors:
        return None
    dtype, device = tensors[0].dtype, tensors[0].device
    first: Optional[torch.Tensor] = None
    end = 0
    total = 0
    for t in tensors:
        if t.dtype != dtype or t.device != device or t.is_conj() or t.is_neg():
            return None
        if t.numel() == 0:
            continue
        if not t.is_contiguous():
            return None
        if first is None:
            first = t
        elif t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or t.data_ptr() != end:
            return None
        end = t.data_ptr() + t.numel() * t.element_size()
        total += t.numel()
    if first is None:
        return None
    base: Any = first.detach()
    view: torch.Tensor = base.as_strided((total,), (1,), first.storage_offset())
    return view


def list_source(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One flat tensor holding ``tensors`` in order: :func:`flat_view` of them, else their concatenation (a copy)."""
    flat = flat_view(tensors)
    return flat if flat is not None else torch.cat([t.reshape(-1) for t in tensors])


def list_target(
    tensors: Sequence[torch.Tensor], dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, Callable[[], None]]:
    """A flat ``dtype`` buffer a collective fills for the outputs ``tensors``, and what puts it into them.

    The buffer is :func:`flat_view` of the outputs when they lie back to back
    in one buffer of ``dtype`` (nothing to put back), else a new tensor whose
    pieces are copied into the outputs in order. Large buffers get
    :func:`prefer_huge_pages`.
    """
    direct = flat_view(tensors)
    if direct is not None and direct.dtype == dtype:
        prefer_huge_pages(direct)
        return direct, _nothing
    counts = [t.numel() for t in tensors]
    flat = torch.empty(sum(counts), dtype=dtype, device=device)
    prefer_huge_pages(flat)

    def finish() -> None:
        for t, piece in zip(tensors, flat.split(counts), strict=True):
            t.copy_(piece.view(t.shape))

    return flat, finish


def _nothing() -> None:
    pass


# --- scatter / gather of tensor lists, point to point ------------------------
#: Tag of the list scatter's and gather's messages (on the group's private side communicator).
_LIST_TAG = 7013


def _send_form(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as contiguous host memory of ``dtype`` that MPI may read (itself when it already is)."""
    src = t.detach()
    if src.device.type != "cpu" or src.dtype != dtype or not src.is_contiguous() or src.is_conj() or src.is_neg():
        src = src.resolve_conj().resolve_neg().to("cpu", dtype).contiguous()
    return src


def _bytes(mpi: Any, t: torch.Tensor, readonly: bool = False) -> list[Any]:
    nbytes = t.numel() * t.element_size()
    return [mpi.buffer.fromaddress(t.data_ptr() if nbytes else 0, nbytes, readonly=readonly), nbytes, mpi.BYTE]


def _overlaps_any(t: torch.Tensor, others: Sequence[torch.Tensor], overlaps: Callable[..., bool]) -> bool:
    return any(o is not t and overlaps(t, o) for o in others)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same elements (copying one onto the other would change nothing)."""
    return (
        a.data_ptr() == b.data_ptr()
        and a.dtype == b.dtype
        and a.device == b.device
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.is_conj() == b.is_conj()
        and a.is_neg() == b.is_neg()
    )


def _receivable(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether MPI can write ``dtype`` elements straight into ``t``'s memory."""
    return t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous() and not t.is_conj() and not t.is_neg()


def scatter_list(
    mpi: Any,
    comm: Any,
    out: torch.Tensor,
    pieces: Optional[Sequence[torch.Tensor]],
    root: int,
    overlaps: Callable[..., bool],
) -> None:
    """``out`` on rank r = ``pieces[r]`` of ``root``, each piece sent from where it is (no concatenation).

    ``comm`` must be a communicator no other code sends on (the group's side
    communicator): the messages are point to point. Pieces are cast to
    ``out``'s dtype on the root, as the flat scatter does. The root's own
    piece is copied locally after the others are sent, so ``out`` may alias
    any piece.

    Raises:
        ValueError: on the root, its own piece has another number of elements than ``out``.
    """
    if comm.Get_rank() != root:
        buf = out.detach() if _receivable(out, out.dtype) else torch.empty(out.shape, dtype=out.dtype)
        prefer_huge_pages(buf)
        comm.Recv(_bytes(mpi, buf), source=root, tag=_LIST_TAG)
        if buf.data_ptr() != out.data_ptr():
            out.copy_(buf)
        return
    assert pieces is not None
    own = pieces[root]
    if own.numel() != out.numel():
        raise ValueError(f"scatter: the root's own piece has {own.numel()} elements but its output {out.numel()}")
    if overlaps(own, out) and not _same(own, out):
        own = own.clone()  # read after out is written
    held = [_send_form(p, out.dtype) for r, p in enumerate(pieces) if r != root]
    ranks = [r for r in range(len(pieces)) if r != root]
    requests = [comm.Isend(_bytes(mpi, p, True), dest=r, tag=_LIST_TAG) for r, p in zip(ranks, held, strict=True)]
    # Copying the own piece while the sends are in flight overlaps the two where the
    # receivers pull the data themselves (single-copy shared memory); unless out is
    # memory a send still reads.
    early = not _same(own, out) and not _overlaps_any(out, held, overlaps)
    prefer_huge_pages(out)
    if early:
        out.copy_(own.reshape(out.shape))
    mpi.Request.Waitall(requests)
    if not early and not _same(own, out):
        out.copy_(own.reshape(out.shape))


def gather_list(
    mpi: Any,
    comm: Any,
    outs: Optional[Sequence[torch.Tensor]],
    inp: torch.Tensor,
    root: int,
    overlaps: Callable[..., bool],
    overlapping: Callable[[Sequence[torch.Tensor]], list[bool]],
) -> None:
    """``outs[r]`` on ``root`` = rank r's ``inp``, each received where it goes (no staging buffer).

    ``comm`` as for :func:`scatter_list`. An output that is not contiguous
    host memory of ``inp``'s dtype, or that overlaps another output or
    ``inp``, is received into a staging tensor and copied in afterwards, in
    rank order (as the flat gather did).
    """
    if comm.Get_rank() != root:
        src = _send_form(inp, inp.dtype)  # held here: MPI reads its memory by address
        comm.Send(_bytes(mpi, src, True), dest=root, tag=_LIST_TAG)
        return
    assert outs is not None
    own = inp.detach()
    if _overlaps_any(own, outs, overlaps):
        own = own.clone()  # outputs may be written before it is read
    direct = [_receivable(o, inp.dtype) and not shared for o, shared in zip(outs, overlapping(outs), strict=True)]
    targets = [
        o.detach() if ok else torch.empty(o.numel(), dtype=inp.dtype) for o, ok in zip(outs, direct, strict=True)
    ]
    prefer_huge_pages(*targets)
    mpi.Request.Waitall(
        [comm.Irecv(_bytes(mpi, t), source=r, tag=_LIST_TAG) for r, t in enumerate(targets) if r != root]
    )
    targets[root].copy_(own.reshape(targets[root].shape))
    for o, t, ok in zip(outs, targets, direct, strict=True):
        if not ok:
            o.copy_(t.view(o.shape))
