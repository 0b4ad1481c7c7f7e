"""The one implementation of each collective over an mpi4py communicator.

Both the shardwise :class:`~shardwise_mpi._group.MpiGroup` and the
``torch.distributed`` backend (``_c10d.py``) call these functions, so a
collective is written (and fixed) once. Every function is blocking, must be
called by every rank of ``comm`` in the same order, and takes torch tensors:

==============================================================  ==============================================
``barrier(comm)``                                               block until every rank arrives
``bcast(comm, tensor, root)``                                   overwrite ``tensor`` with root's, in place
``allreduce(comm, tensor, op)``                                 reduce ``tensor`` in place
``allgatherv(comm, out, inp, counts)``                          ``out`` = every rank's ``inp`` in rank order
``reduce_scatter(comm, out, inp, counts, op)``                  ``out`` = this rank's chunk of the reduced ``inp``
``alltoallv(comm, out, out_counts, inp, in_counts)``            send ``in_counts[r]`` elements to rank r
``gatherv(comm, out, inp, counts, root)``                       ``out`` on root = every ``inp`` in rank order
``scatterv(comm, out, inp, counts, root)``                      ``out`` on rank r = chunk r of root's ``inp``
==============================================================  ==============================================

Conventions:

* ``counts`` are numbers of *elements* (of the tensors' dtype), one per rank
  of ``comm``; ``out`` and ``inp`` are read as flat arrays (any shape, any
  layout). ``inp`` and ``out`` of one call have the same dtype.
* ``op`` is any form ``shardwise.sdk.normalize_reduce_op`` reads (a name of
  ``shardwise.sdk.REDUCE_OPS`` or an alias, a torch ``ReduceOp``), or one of
  torch's bitwise ops (``shardwise.sdk.BITWISE_REDUCE_OPS``: ``"band"``,
  ``"bor"``, ``"bxor"``), which the ``"mpi4py"`` torch backend must
  implement. Which names exist is the SDK's business; mapping them to
  ``MPI.Op`` objects is this module's.
* Zero-copy: a contiguous CPU tensor is handed to MPI as its own memory
  (``MPI.buffer.fromaddress``, so bfloat16 and every other dtype works without
  a numpy dtype). A non-contiguous or requires-grad input is made contiguous
  and detached first (mpi4py would otherwise send the raw storage of a
  transposed tensor); a non-contiguous output is filled through a staging
  buffer and copied back.
* Data movement sends bytes (``MPI.BYTE``), so every dtype travels.
  Reductions use the matching MPI datatype; float16, bfloat16 and complex32
  are reduced in float32/complex64 and cast back; bool reduces as logical
  or (sum, max) / and (min, product).
* Aliased buffers: MPI forbids a send buffer that overlaps the receive
  buffer. ``allgatherv`` always gathers with ``MPI_IN_PLACE`` (the standard
  wants it on all ranks or none): an input that is exactly this rank's slot
  of the output (``all_gather_into_tensor`` into the tensor its input is a
  view of) is not copied at all, any other input is copied into that slot
  first. The root of ``gatherv``/``scatterv`` passes ``MPI_IN_PLACE`` when
  its own block is its input/output. Any other overlap (found by
  :func:`overlaps`: same device, overlapping byte ranges, whatever the
  views' shapes) sends from a private copy of the input.
* CUDA tensors go to MPI directly when the library is CUDA-aware
  (``MPIX_Query_cuda_support``; the current stream is synchronised first),
  otherwise they are staged through host memory and copied back.

Raises (every function): ``TypeError`` for an op undefined on the dtype
(avg of integers, min of complex) and ``ValueError`` for counts that do not
fit the buffers. Both are raised before any data moves, from local
information only; callers that need every rank to fail together check first.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from shardwise import sdk
from shardwise_mpi._libmpi import ensure_matching_library
from shardwise_mpi._tensor_buffers import _buffer, _source, _target, cuda_aware

# mpi4py keeps the first MPI library it loads: choose the launcher's kind first.
ensure_matching_library()
from mpi4py import MPI  # noqa: E402

__all__ = [
    "allgatherv",
    "allreduce",
    "alltoallv",
    "barrier",
    "bcast",
    "one_copy_broadcast",
    "cuda_aware",
    "gatherv",
    "mpi_datatype",
    "normalize_op",
    "overlapping",
    "overlaps",
    "reduce_scatter",
    "reduction_dtype",
    "scatterv",
]

_MPI_OPS = {
    "sum": MPI.SUM,
    "avg": MPI.SUM,
    "min": MPI.MIN,
    "max": MPI.MAX,
    "product": MPI.PROD,
    "band": MPI.BAND,
    "bor": MPI.BOR,
    "bxor": MPI.BXOR,
}
# MPI defines only logical ops on C_BOOL; on {0, 1} sum/max are "or", min/product "and".
_BOOL_OPS = {
    "sum": MPI.LOR,
    "max": MPI.LOR,
    "min": MPI.LAND,
    "product": MPI.LAND,
    "band": MPI.LAND,
    "bor": MPI.LOR,
    "bxor": MPI.LXOR,
}

_DATATYPES: dict[torch.dtype, Any] = {
    torch.float64: MPI.DOUBLE,
    torch.float32: MPI.FLOAT,
    torch.int8: MPI.INT8_T,
    torch.int16: MPI.INT16_T,
    torch.int32: MPI.INT32_T,
    torch.int64: MPI.INT64_T,
    torch.uint8: MPI.UINT8_T,
    torch.uint16: MPI.UINT16_T,
    torch.uint32: MPI.UINT32_T,
    torch.uint64: MPI.UINT64_T,
    torch.bool: MPI.C_BOOL,
    torch.complex64: MPI.C_FLOAT_COMPLEX,
    torch.complex128: MPI.C_DOUBLE_COMPLEX,
}
# Dtypes MPI has no datatype for: reduced in a wider one and cast back.
_UPCAST = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.complex32: torch.complex64}


#: Tag of the pairwise all-to-all's messages (communicators are shardwise's own duplicates).
_ALLTOALL_TAG = 7011


def normalize_op(op: Any) -> str:
    """``"sum"``, ``"PROD"``, ``ReduceOp.MAX`` ... as one of ``sdk.REDUCE_OPS`` or ``sdk.BITWISE_REDUCE_OPS``.

    Raises:
        ValueError: not a reduction this module implements.
    """
    try:
        name = sdk.normalize_reduce_op(op, bitwise=True)
    except ValueError:
        name = ""
    # Also catches a name a newer SDK adds before this module maps it to an MPI op.
    if name not in _MPI_OPS:
        known = ", ".join(n for n in (*sdk.REDUCE_OPS, *sdk.BITWISE_REDUCE_OPS) if n in _MPI_OPS)
        raise ValueError(f"unsupported reduce op {op!r}; use one of {known}") from None
    return name


def reduction_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype ``dtype`` tensors are reduced in (itself, or float32/complex64 for half types).

    Raises:
        TypeError: no MPI datatype can reduce it (float8, quantized ...).
    """
    wide = _UPCAST.get(dtype, dtype)
    if wide not in _DATATYPES:
        raise TypeError(f"MPI cannot reduce {dtype} tensors; cast to a float or integer dtype first")
    return wide


def mpi_datatype(dtype: torch.dtype) -> Any:
    """The MPI datatype of ``dtype`` elements (``KeyError`` if MPI has none)."""
    return _DATATYPES[dtype]


def _check_op(dtype: torch.dtype, name: str) -> None:
    if name == "avg" and not (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(f"avg of {dtype} tensors would truncate; reduce with sum and divide yourself")
    if dtype.is_complex and name not in ("sum", "avg", "product"):
        raise TypeError(f"{name} of complex tensors is not defined; only sum, avg and product are")
    if name in ("band", "bor", "bxor") and (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(f"bitwise {name} needs an integer or bool tensor, got {dtype}")


#: Whether two tensors may share memory (by address span): the core's one rule.
overlaps = sdk.shares_memory
#: For each tensor of a list, whether it may share memory with another (the same rule, in O(n log n)).
overlapping = sdk.overlapping


def _is_slot(part: torch.Tensor, whole: torch.Tensor, offset: int) -> bool:
    """Whether contiguous ``part`` is exactly the bytes ``[offset, offset + nbytes)`` of contiguous ``whole``."""
    return (
        part.device == whole.device
        and part.is_contiguous()
        and whole.is_contiguous()
        and part.data_ptr() == whole.data_ptr() + offset
        and part.numel() * part.element_size() + offset <= whole.numel() * whole.element_size()
    )


def _unaliased(src: torch.Tensor, work: torch.Tensor) -> torch.Tensor:
    """``src``, or a private copy of it when MPI would read it while writing ``work``."""
    return src.clone() if overlaps(src, work) else src


def _byte_layout(counts: Sequence[int], itemsize: int) -> tuple[list[int], list[int]]:
    sizes = [int(c) * itemsize for c in counts]
    displs, offset = [], 0
    for s in sizes:
        displs.append(offset)
        offset += s
    return sizes, displs


def _check_counts(comm: Any, counts: Sequence[int], what: str) -> None:
    if len(counts) != comm.Get_size():
        raise ValueError(f"{what} has {len(counts)} entries but the communicator has {comm.Get_size()} ranks")
    if any(int(c) < 0 for c in counts):
        raise ValueError(f"{what} must be non-negative, got {list(counts)}")


def _check_numel(t: torch.Tensor, expected: int, what: str) -> None:
    if t.numel() != expected:
        raise ValueError(f"{what} has {t.numel()} elements but the counts need {expected}")


def barrier(comm: Any) -> None:
    """Block until every rank of ``comm`` has called it."""
    comm.Barrier()


#: Groups of at least this many ranks offer a broadcast to the one-copy path first (``shardwise.sdk.local_broadcast``).
ONE_COPY_BROADCAST_RANKS = 3


def one_copy_broadcast(size: int) -> bool:
    """Whether a group of ``size`` ranks offers a broadcast to cross-memory attach before MPI's ``Bcast``."""
    return size >= ONE_COPY_BROADCAST_RANKS


def bcast(comm: Any, tensor: torch.Tensor, root: int) -> torch.Tensor:
    """Overwrite ``tensor`` on every rank with ``root``'s, in place; returns ``tensor``."""
    work, finish = _target(tensor)
    comm.Bcast([_buffer(work), work.numel() * work.element_size(), MPI.BYTE], root=root)
    finish()
    return tensor


def allreduce(comm: Any, tensor: torch.Tensor, op: Any = "sum") -> torch.Tensor:
    """Reduce ``tensor`` across ``comm`` in place with ``op``; returns ``tensor``."""
    name = normalize_op(op)
    _check_op(tensor.dtype, name)
    kind = reduction_dtype(tensor.dtype)
    work, finish = _target(tensor, kind)
    mpi_op = _BOOL_OPS[name] if kind == torch.bool else _MPI_OPS[name]
    comm.Allreduce(MPI.IN_PLACE, [_buffer(work), work.numel(), _DATATYPES[kind]], op=mpi_op)
    if name == "avg":
        work.div_(comm.Get_size())
    finish()
    return tensor


def allgatherv(comm: Any, out: torch.Tensor, inp: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """Fill ``out`` with every rank's ``inp`` in rank order (``counts[r]`` elements from rank r)."""
    _check_counts(comm, counts, "counts")
    _check_numel(inp, int(counts[comm.Get_rank()]), "inp")
    _check_numel(out, sum(int(c) for c in counts), "out")
    src = _source(inp, out.dtype)
    work, finish = _target(out)
    item = work.element_size()
    sizes, displs = _byte_layout(counts, item)
    rank = comm.Get_rank()
    # The standard wants MPI_IN_PLACE on every rank of an all-gather or on none,
    # and whether the input aliases the output is a per-rank fact. So every
    # rank gathers in place: the input is first put into its slot, unless it
    # is that slot already (FSDP2 gathers into the buffer its shard is a view
    # of: no copy at all). MPI would copy a separate send buffer there itself.
    if not _is_slot(src, work, displs[rank]):
        start = displs[rank] // item
        work.view(-1)[start : start + int(counts[rank])].copy_(_unaliased(src, work).view(-1))
        if work.is_cuda:
            torch.cuda.current_stream(work.device).synchronize()
    if all(s == sizes[0] for s in sizes):
        comm.Allgather(MPI.IN_PLACE, [_buffer(work), sizes[0], MPI.BYTE])
    else:
        comm.Allgatherv(MPI.IN_PLACE, [_buffer(work), (sizes, displs), MPI.BYTE])
    finish()
    return out


def reduce_scatter(
    comm: Any, out: torch.Tensor, inp: torch.Tensor, counts: Sequence[int], op: Any = "sum"
) -> torch.Tensor:
    """Reduce ``inp`` (per-rank chunks of ``counts`` elements) and keep this rank's chunk in ``out``."""
    name = normalize_op(op)
    _check_op(inp.dtype, name)
    _check_counts(comm, counts, "counts")
    _check_numel(inp, sum(int(c) for c in counts), "inp")
    _check_numel(out, int(counts[comm.Get_rank()]), "out")
    kind = reduction_dtype(inp.dtype)
    work, finish = _target(out, kind)
    # MPI_IN_PLACE would take the input from (and overwrite) the whole output buffer: copy instead.
    src = _unaliased(_source(inp, kind), work)
    dt = _DATATYPES[kind]
    mpi_op = _BOOL_OPS[name] if kind == torch.bool else _MPI_OPS[name]
    sizes = [int(c) for c in counts]
    if all(c == sizes[0] for c in sizes):
        # mpi4py reads an explicit send count of Reduce_scatter_block as the per-rank block.
        comm.Reduce_scatter_block([_buffer(src, True), sizes[0], dt], [_buffer(work), sizes[0], dt], op=mpi_op)
    else:
        comm.Reduce_scatter(
            [_buffer(src, True), src.numel(), dt], [_buffer(work), work.numel(), dt], recvcounts=sizes, op=mpi_op
        )
    if name == "avg":
        work.div_(comm.Get_size())
    finish()
    return out


def alltoallv(
    comm: Any, out: torch.Tensor, out_counts: Sequence[int], inp: torch.Tensor, in_counts: Sequence[int]
) -> torch.Tensor:
    """Send ``in_counts[r]`` elements of ``inp`` to rank r; receive ``out_counts[r]`` from it into ``out``."""
    _check_counts(comm, in_counts, "in_counts")
    _check_counts(comm, out_counts, "out_counts")
    _check_numel(inp, sum(int(c) for c in in_counts), "inp")
    _check_numel(out, sum(int(c) for c in out_counts), "out")
    work, finish = _target(out)
    src = _unaliased(_source(inp, out.dtype), work)
    item = work.element_size()
    send_sizes, send_displs = _byte_layout(in_counts, item)
    recv_sizes, recv_displs = _byte_layout(out_counts, item)
    # A pairwise exchange rather than MPI_Alltoallv: MPICH's Alltoallv moves
    # large blocks at half the speed of its Alltoall, and choosing Alltoall
    # for even splits would need every rank to know that all splits are even
    # (a rank may send evenly while another does not: mixing the two
    # collectives deadlocks). Step k sends to rank + k and receives from
    # rank - k, which is what Alltoall does for large messages; step 0 is
    # the rank's own block (a local copy, below, when its sizes agree).
    rank, size = comm.Get_rank(), comm.Get_size()
    send_base = src.data_ptr() if src.numel() else 0
    recv_base = work.data_ptr() if work.numel() else 0
    first = 0
    if send_sizes[rank] == recv_sizes[rank]:
        # The rank's own block is a local copy: MPICH's send to self of a large
        # block costs about 4x a memcpy (measured, 32 MiB). src never overlaps
        # work here (_unaliased). Unequal sizes still go through MPI, which reports them.
        own = send_sizes[rank]
        if own:
            into = work.view(-1).view(torch.uint8)[recv_displs[rank] : recv_displs[rank] + own]
            into.copy_(src.view(-1).view(torch.uint8)[send_displs[rank] : send_displs[rank] + own])
        first = 1
    for k in range(first, size):
        dst, frm = (rank + k) % size, (rank - k) % size
        n_out, n_in = send_sizes[dst], recv_sizes[frm]
        outgoing = MPI.buffer.fromaddress(send_base + send_displs[dst] if n_out else 0, n_out, readonly=True)
        incoming = MPI.buffer.fromaddress(recv_base + recv_displs[frm] if n_in else 0, n_in)
        comm.Sendrecv([outgoing, n_out, MPI.BYTE], dst, _ALLTOALL_TAG, [incoming, n_in, MPI.BYTE], frm, _ALLTOALL_TAG)
    finish()
    return out


def gatherv(
    comm: Any, out: Optional[torch.Tensor], inp: torch.Tensor, counts: Sequence[int], root: int
) -> Optional[torch.Tensor]:
    """Concatenate every rank's ``inp`` (``counts[r]`` elements from rank r) into ``out`` on ``root``.

    ``out`` is ignored (may be None) on the other ranks.
    """
    _check_counts(comm, counts, "counts")
    _check_numel(inp, int(counts[comm.Get_rank()]), "inp")
    src = _source(inp)
    item = src.element_size()
    sendbuf: Any = [_buffer(src, True), src.numel() * item, MPI.BYTE]
    if comm.Get_rank() != root:
        comm.Gatherv(sendbuf, None, root=root)
        return out
    if out is None:
        raise ValueError("gatherv: the root must pass an output tensor")
    _check_numel(out, sum(int(c) for c in counts), "out")
    if out.dtype != inp.dtype:
        raise ValueError(f"gatherv: out is {out.dtype} but inp is {inp.dtype}")
    work, finish = _target(out)
    sizes, displs = _byte_layout(counts, item)
    if overlaps(src, work):
        if _is_slot(src, work, displs[root]):
            sendbuf = MPI.IN_PLACE  # the root's block is already in place
        else:
            src = src.clone()
            sendbuf = [_buffer(src, True), src.numel() * item, MPI.BYTE]
    comm.Gatherv(sendbuf, [_buffer(work), (sizes, displs), MPI.BYTE], root=root)
    finish()
    return out


def scatterv(
    comm: Any, out: torch.Tensor, inp: Optional[torch.Tensor], counts: Sequence[int], root: int
) -> torch.Tensor:
    """Send chunk r (``counts[r]`` elements) of ``root``'s ``inp`` to ``out`` on rank r.

    ``inp`` is ignored (may be None) on the other ranks.
    """
    _check_counts(comm, counts, "counts")
    _check_numel(out, int(counts[comm.Get_rank()]), "out")
    work, finish = _target(out)
    item = work.element_size()
    recvbuf: Any = [_buffer(work), work.numel() * item, MPI.BYTE]
    if comm.Get_rank() == root:
        if inp is None:
            raise ValueError("scatterv: the root must pass an input tensor")
        _check_numel(inp, sum(int(c) for c in counts), "inp")
        src = _source(inp, out.dtype)
        sizes, displs = _byte_layout(counts, item)
        if overlaps(src, work):
            if _is_slot(work, src, displs[root]):
                recvbuf = MPI.IN_PLACE  # the root's block is already where its output is
            else:
                src = src.clone()
        comm.Scatterv([_buffer(src, True), (sizes, displs), MPI.BYTE], recvbuf, root=root)
    else:
        comm.Scatterv(None, recvbuf, root=root)
    finish()
    return out
