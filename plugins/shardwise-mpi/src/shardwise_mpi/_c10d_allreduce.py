"""Large all-reduces of the ``"mpi4py"`` torch backend: a ring of point-to-point exchanges, summed by torch.

MPICH's ``MPI_Allreduce`` of large buffers between processes of one host
was slower than gloo's (64 MiB float32 on 2 ranks: 69 ms against gloo's
75 ms and 37 ms for the ring below, measured side by side): its
reduce-scatter/all-gather goes through the shared-memory collectives'
staging cells, while a plain ``MPI_Sendrecv`` of a large block uses the
single-copy path. So a large sum is done as the textbook ring: ``W - 1``
steps of reduce-scatter (each rank sends one chunk to the next rank,
receives one from the previous and adds it into its copy), then ``W - 1``
steps of all-gather of the reduced chunks. Each chunk is reduced once, on
one rank, and then copied to the others, so every rank ends with the same
bits. Received blocks go through a small scratch buffer in segments, so the
addition reads them while they are still in cache.

Which path runs is decided from what every rank of an all-reduce has alike
(byte size, dtype, op), never from a rank's own layout: a non-contiguous or
non-CPU tensor goes through a contiguous host copy.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["RING_MIN_BYTES", "ring_allreduce", "takes_ring"]

#: All-reduces of at least this many bytes take the ring (below it MPI's own algorithms win).
RING_MIN_BYTES = 8 << 20
#: Bytes received into scratch at a time (and added before the next piece comes).
_SEGMENT_BYTES = 4 << 20
#: Tag of the ring's messages (on the group's side communicator, which no other code sends on).
_RING_TAG = 7014
# Dtypes the ring sums in themselves (the half types are reduced in float32 by the MPI path).
_RING_DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64, torch.complex64, torch.complex128)


def takes_ring(t: torch.Tensor, op: str, size: int) -> bool:
    """Whether the all-reduce of ``t`` with ``op`` over ``size`` ranks takes the ring (alike on every rank).

    Averages of integers are left to the MPI path, which refuses them.
    """
    if op == "avg" and not (t.dtype.is_floating_point or t.dtype.is_complex):
        return False
    return (
        size > 1 and op in ("sum", "avg") and t.dtype in _RING_DTYPES and t.numel() * t.element_size() >= RING_MIN_BYTES
    )


def _block(mpi: Any, t: torch.Tensor, readonly: bool = False) -> list[Any]:
    nbytes = t.numel() * t.element_size()
    return [mpi.buffer.fromaddress(t.data_ptr() if nbytes else 0, nbytes, readonly=readonly), nbytes, mpi.BYTE]


def ring_allreduce(
    mpi: Any, comm: Any, tensor: torch.Tensor, op: str, segment_bytes: int = _SEGMENT_BYTES
) -> torch.Tensor:
    """Sum (``op`` ``"sum"``) or average (``"avg"``) ``tensor`` over ``comm`` in place; returns ``tensor``.

    ``comm`` must be a communicator no other code sends on. Call only where
    :func:`takes_ring` says so, on every rank alike. ``segment_bytes``
    (alike on every rank) is how much is received and added at a time.
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    direct = tensor.device.type == "cpu" and tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg()
    work = tensor.detach() if direct else tensor.detach().resolve_conj().resolve_neg().to("cpu").contiguous()
    flat = work.view(-1)
    chunks = list(flat.tensor_split(size))
    right, left = (rank + 1) % size, (rank - 1) % size
    segment = max(1, segment_bytes // flat.element_size())
    scratch = torch.empty(min(segment, chunks[0].numel()), dtype=flat.dtype)
    for step in range(size - 1):
        outgoing = chunks[(rank - step) % size]
        incoming = chunks[(rank - step - 1) % size]
        # What rank r sends is the chunk rank r + 1 receives, cut at the same offsets; every
        # rank makes as many exchanges (the largest chunk's segments; some may be empty).
        for start in range(0, chunks[0].numel(), segment):
            piece = incoming[start : start + segment]
            got = scratch[: piece.numel()]
            sending = outgoing[start : start + segment]
            comm.Sendrecv(_block(mpi, sending, True), right, _RING_TAG, _block(mpi, got), left, _RING_TAG)
            piece.add_(got)
    for step in range(size - 1):
        outgoing = chunks[(rank + 1 - step) % size]
        incoming = chunks[(rank - step) % size]
        comm.Sendrecv(_block(mpi, outgoing, True), right, _RING_TAG, _block(mpi, incoming), left, _RING_TAG)
    if op == "avg":
        work.div_(size)
    if not direct:
        tensor.copy_(work)
    return tensor
