"""Run under ``mpiexec -n N``: the "mpi4py" backend's fast paths against the generic ones.

``scatter`` and ``gather`` go point to point, each piece from / into where it
is; ``all_gather``, ``all_to_all`` and ``reduce_scatter`` use the memory of
lists that lie back to back in one buffer instead of staging them
(``shardwise_mpi._c10d_buffers``). Each is compared with the generic path
(``shardwise_mpi._collectives`` on a flat concatenation, as the backend did
before) and with the values it must produce; the ring all-reduce with
MPI's ``Allreduce``; on hypothesis-drawn dtypes,
per-rank sizes (uneven and empty included), layouts (separate tensors, views
of one buffer, strided views) and roots.

Every rank draws the same examples (``derandomize=True``, no shrinking), and
each example's description is compared across ranks before it runs, so the
ranks cannot silently run different collectives. A failing rank prints its
traceback and aborts the job. Prints ``OK <rank> <examples>`` at the end.
"""

from __future__ import annotations

import sys
import traceback
from typing import Any

import shardwise_mpi
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from mpi4py import MPI
from shardwise_mpi import _collectives as C
from shardwise_mpi._c10d_allreduce import RING_MIN_BYTES, ring_allreduce, takes_ring

DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64, torch.bfloat16, torch.float16, torch.uint8,
          torch.bool, torch.complex64)  # fmt: skip
LAYOUTS = ("separate", "views", "strided")
examples = 0


def values(seed: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """``numel`` small values of ``dtype``, the same on every rank for the same seed (exact in every dtype)."""
    x = torch.randint(0, 50, (numel,), generator=torch.Generator().manual_seed(seed))
    if dtype == torch.bool:
        return (x % 2).bool()
    if dtype.is_complex:
        return torch.complex(x.float(), (x + 1).float()).to(dtype)
    return x.to(dtype)


def laid_out(parts: list[torch.Tensor], layout: str) -> list[torch.Tensor]:
    """``parts`` (same values) as separate tensors, as views back to back in one buffer, or as strided views."""
    if layout == "separate":
        return [p.clone() for p in parts]
    if layout == "views":
        return list(torch.cat(parts).split([p.numel() for p in parts]))
    out = []
    for p in parts:
        holder = torch.zeros(2 * p.numel(), dtype=p.dtype)
        holder[::2] = p
        out.append(holder[::2])  # not contiguous (unless it has at most one element)
    return out


def blank(counts: list[int], dtype: torch.dtype, layout: str) -> list[torch.Tensor]:
    return laid_out([torch.zeros(c, dtype=dtype) for c in counts], layout)


cases = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(DTYPES),
        "sizes": st.lists(st.integers(0, 5), min_size=16, max_size=16),
        "layout_in": st.sampled_from(LAYOUTS),
        "layout_out": st.sampled_from(LAYOUTS),
        "root": st.integers(0, 15),
        "seed": st.integers(0, 1000),
    }
)


def run_case(case: dict[str, Any]) -> None:
    global examples
    pg: Any = dist.group.WORLD
    comm = pg.comm
    rank, n = dist.get_rank(), dist.get_world_size()
    # Every rank must be running the same example.
    drawn = comm.allgather(repr(case))
    assert all(d == drawn[0] for d in drawn), f"ranks drew different examples: {drawn}"
    dtype, sizes, seed = case["dtype"], case["sizes"], case["seed"]
    counts = sizes[:n]
    root = case["root"] % n
    lin, lout = case["layout_in"], case["layout_out"]

    def piece(src: int, dst: int, numel: int) -> torch.Tensor:
        return values(seed * 1000 + src * 31 + dst, numel, dtype)

    # scatter: rank r gets the root's piece r
    pieces = laid_out([piece(root, r, counts[r]) for r in range(n)], lin) if rank == root else None
    (out,) = blank([counts[rank]], dtype, lout)
    (generic,) = blank([counts[rank]], dtype, lout)
    dist.scatter(out, pieces, src=root)
    C.scatterv(comm, generic, torch.cat(pieces) if pieces is not None else None, counts, root)
    assert torch.equal(out, generic) and torch.equal(out, piece(root, rank, counts[rank])), ("scatter", case)

    # gather: the root gets every rank's input
    (inp,) = laid_out([piece(rank, root, counts[rank])], lin)
    outs = blank(counts, dtype, lout) if rank == root else None
    dist.gather(inp, outs, dst=root)
    if outs is not None:
        flat = torch.zeros(sum(counts), dtype=dtype)
        C.gatherv(comm, flat, inp, counts, root)
        for r, (got, want) in enumerate(zip(outs, flat.split(counts), strict=True)):
            assert torch.equal(got, want) and torch.equal(got, piece(r, root, counts[r])), ("gather", r, case)
    else:
        C.gatherv(comm, None, inp, counts, root)

    # all_gather (list): every rank gets every rank's input
    (inp,) = laid_out([piece(rank, -1, counts[rank])], lin)
    outs = blank(counts, dtype, lout)
    dist.all_gather(outs, inp)
    flat = torch.zeros(sum(counts), dtype=dtype)
    C.allgatherv(comm, flat, inp, counts)
    for r, (got, want) in enumerate(zip(outs, flat.split(counts), strict=True)):
        assert torch.equal(got, want) and torch.equal(got, piece(r, -1, counts[r])), ("all_gather", r, case)

    # all_to_all (list): rank a sends sizes[(a * n + b) % 16] elements to rank b
    def a2a(a: int, b: int) -> int:
        return sizes[(a * n + b) % len(sizes)]

    ins = laid_out([piece(rank, b, a2a(rank, b)) for b in range(n)], lin)
    outs = blank([a2a(a, rank) for a in range(n)], dtype, lout)
    dist.all_to_all(outs, ins)
    flat = torch.zeros(sum(a2a(a, rank) for a in range(n)), dtype=dtype)
    C.alltoallv(comm, flat, [a2a(a, rank) for a in range(n)], torch.cat(ins), [a2a(rank, b) for b in range(n)])
    for a, (got, want) in enumerate(zip(outs, flat.split([a2a(x, rank) for x in range(n)]), strict=True)):
        assert torch.equal(got, want) and torch.equal(got, piece(a, rank, a2a(a, rank))), ("all_to_all", a, case)

    # reduce_scatter (list): sum of every rank's piece r, on rank r
    if dtype != torch.bool:
        ins = laid_out([piece(rank, r, counts[r]) for r in range(n)], lin)
        (out,) = blank([counts[rank]], dtype, lout)
        (generic,) = blank([counts[rank]], dtype, lout)
        dist.reduce_scatter(out, ins)
        C.reduce_scatter(comm, generic, torch.cat(ins), counts, "sum")
        want = sum(piece(a, rank, counts[rank]).to(C.reduction_dtype(dtype)) for a in range(n))
        assert torch.equal(out, generic), ("reduce_scatter vs generic", case)
        assert torch.equal(out, torch.as_tensor(want).to(dtype)), ("reduce_scatter", case)
    # all_reduce: the ring (called directly: the backend takes it from RING_MIN_BYTES on) against MPI's
    ring_dtype = dtype if dtype in (torch.float32, torch.float64, torch.int64, torch.complex64) else torch.int32
    numel = sum(sizes) * 37 + counts[0]  # uneven chunks, up to a few hundred elements
    for op in ("sum", "avg") if (ring_dtype.is_floating_point or ring_dtype.is_complex) else ("sum",):
        (x,) = laid_out([values(seed + rank, numel, ring_dtype)], lin)  # strided: through a contiguous copy
        generic = x.clone()
        ring_allreduce(MPI, pg._side(), x, op, segment_bytes=8 * (1 + seed % 40))  # many segments, uneven
        C.allreduce(comm, generic, op)
        assert torch.equal(x, generic), ("all_reduce ring", op, case)
    assert takes_ring(torch.empty(1 << 22), "sum", n) and not takes_ring(
        torch.empty(1 << 22, dtype=torch.int64), "avg", n
    )
    examples += 1


@settings(
    max_examples=30,
    derandomize=True,  # the same examples on every rank
    database=None,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: a failure aborts the job
    suppress_health_check=list(HealthCheck),
)
@given(case=cases)
def test_list_collectives(case: dict[str, Any]) -> None:
    run_case(case)


def large_all_reduce_takes_the_ring() -> None:
    """``dist.all_reduce`` from ``RING_MIN_BYTES`` on, contiguous or not, gives MPI's ``Allreduce``'s values."""
    pg: Any = dist.group.WORLD
    rank = dist.get_rank()
    numel = RING_MIN_BYTES // 4 + 5
    for op, dist_op in (("sum", dist.ReduceOp.SUM), ("avg", dist.ReduceOp.AVG)):
        x = (torch.arange(2 * numel) % 1000 + rank).float()
        for t in (x[:numel], x[::2]):
            assert takes_ring(t, op, dist.get_world_size())
            generic = t.clone()
            dist.all_reduce(t, op=dist_op)
            C.allreduce(pg.comm, generic, op)
            assert torch.equal(t, generic), ("large all_reduce", op, t.is_contiguous())


def main() -> None:
    shardwise_mpi.register_torch_backend()
    dist.init_process_group("mpi4py")
    try:
        large_all_reduce_takes_the_ring()
        test_list_collectives()
    except BaseException:  # noqa: BLE001 - the job must end, not wait in the next collective
        traceback.print_exc()
        sys.stderr.flush()
        dist.group.WORLD.comm.Abort(1)  # type: ignore[union-attr]
    print(f"OK {dist.get_rank()} {examples}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
