"""Run under ``mpiexec -n N``: every MPI collective and the MpiGroup API, checked against dense results.

Prints ``RANK <r> OK`` on success; any failed check raises (and the abort
hook ends the whole job with the traceback).
"""

from __future__ import annotations

import torch
from shardwise_mpi import _collectives as C

import shardwise

ALL_DTYPES = (
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.bool,
    torch.complex64,
    torch.complex128,
)


def same(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype, (what, actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    assert torch.equal(actual, expected), (what, actual, expected)


def value(dtype: torch.dtype, rank: int, n: int = 4) -> torch.Tensor:
    """A small tensor that differs per rank and is exact in every dtype."""
    base = torch.arange(n) % 3 + rank + 1
    if dtype == torch.bool:
        return (torch.arange(n) + rank) % 2 == 0
    if dtype.is_complex:
        return torch.complex(base.double(), -base.double()).to(dtype)
    return base.to(dtype)


def wide(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.bool or t.dtype.is_complex:
        return t
    return t.to(torch.float64 if t.dtype.is_floating_point else torch.int64)


def check_raw(comm) -> None:
    r, w = comm.Get_rank(), comm.Get_size()
    ranks = range(w)
    folds = {"sum": torch.add, "min": torch.minimum, "max": torch.maximum, "product": torch.mul}
    for dtype in ALL_DTYPES:
        vals = [value(dtype, s) for s in ranks]
        # every reduction op the dtype allows
        for op, fold in folds.items():
            if dtype.is_complex and op in ("min", "max"):
                continue
            if dtype == torch.bool:
                fold = {
                    "sum": torch.logical_or,
                    "max": torch.logical_or,
                    "min": torch.logical_and,
                    "product": torch.logical_and,
                }[op]
            # Folded in a wide dtype: torch lacks arithmetic on uint16/32/64.
            expected = wide(vals[0])
            for v in vals[1:]:
                expected = fold(expected, wide(v))
            t = vals[r].clone()
            assert C.allreduce(comm, t, op) is t
            same(t, expected.to(dtype), f"allreduce {op} {dtype}")
        if dtype.is_floating_point or dtype.is_complex:
            t = vals[r].clone()
            C.allreduce(comm, t, "avg")
            expected = sum(v.to(torch.complex128 if dtype.is_complex else torch.float64) for v in vals) / w
            same(t, expected.to(dtype), f"allreduce avg {dtype}")
        else:
            try:
                C.allreduce(comm, vals[r].clone(), "avg")
            except TypeError as exc:
                assert "avg" in str(exc)
            else:
                raise AssertionError(f"avg of {dtype} did not raise")
        # uneven allgatherv with an empty rank 0, in bytes for every dtype
        counts = [s for s in ranks]
        out = torch.empty(sum(counts), dtype=dtype)
        C.allgatherv(comm, out, value(dtype, r, r), counts)
        same(out, torch.cat([value(dtype, s, s) for s in ranks]), f"allgatherv {dtype}")
        # uneven reduce_scatter (sum), chunk s has s + 1 elements
        counts = [s + 1 for s in ranks]
        inp = torch.cat([value(dtype, r, c) for c in counts])
        out = torch.empty(counts[r], dtype=dtype)
        C.reduce_scatter(comm, out, inp, counts, "max" if dtype == torch.bool else "sum")
        chunks = [wide(value(dtype, s, counts[r])) for s in ranks]
        expected = chunks[0]
        for c in chunks[1:]:
            expected = torch.logical_or(expected, c) if dtype == torch.bool else expected + c
        same(out, expected.to(dtype), f"reduce_scatter {dtype}")
        # alltoallv: rank r sends (r + s) % 3 elements to rank s (some empty)
        in_counts = [(r + s) % 3 for s in ranks]
        out_counts = [(s + r) % 3 for s in ranks]
        inp = torch.cat([value(dtype, 10 * r + s, n) for s, n in enumerate(in_counts)])
        out = torch.empty(sum(out_counts), dtype=dtype)
        C.alltoallv(comm, out, out_counts, inp, in_counts)
        same(out, torch.cat([value(dtype, 10 * s + r, n) for s, n in enumerate(out_counts)]), f"alltoallv {dtype}")
        # bcast from the last rank
        t = value(dtype, r)
        C.bcast(comm, t, w - 1)
        same(t, value(dtype, w - 1), f"bcast {dtype}")

    # Equal-count fast paths (Allgather, Reduce_scatter_block).
    out = torch.empty(3 * w)
    C.allgatherv(comm, out, torch.full((3,), float(r)), [3] * w)
    same(out, torch.arange(w).float().repeat_interleave(3), "allgather equal")
    out = torch.empty(2)
    C.reduce_scatter(comm, out, torch.arange(2.0 * w), [2] * w, "sum")
    same(out, torch.arange(2.0 * r, 2.0 * r + 2) * w, "reduce_scatter_block")

    # A transposed input must arrive as its logical values, not its storage.
    base = torch.arange(6.0).reshape(2, 3) + 10 * r
    tr = base.t()
    assert not tr.is_contiguous()
    out = torch.empty(6 * w)
    C.allgatherv(comm, out, tr, [6] * w)
    same(out, torch.cat([(torch.arange(6.0).reshape(2, 3) + 10 * s).t().reshape(-1) for s in ranks]), "transposed in")
    # A transposed output is written through (in-place allreduce and bcast).
    base = torch.arange(6.0).reshape(2, 3) * (r + 1)
    C.allreduce(comm, base.t(), "sum")
    same(base, torch.arange(6.0).reshape(2, 3) * sum(s + 1 for s in ranks), "transposed allreduce")
    base = torch.zeros(3, 2)
    view = base.t()
    if r == 0:
        view.copy_(torch.arange(6.0).reshape(2, 3))
    C.bcast(comm, view, 0)
    same(base.t(), torch.arange(6.0).reshape(2, 3), "transposed bcast")
    # Inputs that require grad are detached; leaves that require grad are written in place.
    leaf = torch.full((4,), float(r + 1), requires_grad=True)
    out = torch.empty(4 * w)
    C.allgatherv(comm, out, leaf * 2, [4] * w)
    same(out, torch.cat([torch.full((4,), 2.0 * (s + 1)) for s in ranks]), "requires grad in")
    C.allreduce(comm, leaf, "sum")
    same(leaf.detach(), torch.full((4,), float(sum(s + 1 for s in ranks))), "requires grad in place")
    # gatherv / scatterv with uneven counts, root = last rank / rank 1 % w
    counts = [s + 1 for s in ranks]
    root = w - 1
    out = torch.empty(sum(counts), dtype=torch.bfloat16) if r == root else None
    C.gatherv(comm, out, torch.full((r + 1,), r + 0.5, dtype=torch.bfloat16), counts, root)
    if r == root:
        same(out, torch.cat([torch.full((s + 1,), s + 0.5, dtype=torch.bfloat16) for s in ranks]), "gatherv")
    src = 1 % w
    inp = torch.cat([torch.full((c,), s, dtype=torch.int64) for s, c in enumerate(counts)]) if r == src else None
    out = torch.empty(counts[r], dtype=torch.int64)
    C.scatterv(comm, out, inp, counts, src)
    same(out, torch.full((r + 1,), r, dtype=torch.int64), "scatterv")
    # Bad counts are refused locally before anything moves.
    try:
        C.allgatherv(comm, torch.empty(1), torch.empty(1), [1])
    except ValueError as exc:
        assert "entries" in str(exc) or w == 1
    else:
        assert w == 1
    C.barrier(comm)


def check_group() -> None:
    g = shardwise.get_default_group()
    assert g.backend == "mpi", g
    r, w = g.rank, g.size
    ranks = range(w)
    # uneven all_gather with an empty rank, 2-D
    got = g.all_gather(torch.full((r, 2), r, dtype=torch.float16))
    for s in ranks:
        same(got[s], torch.full((s, 2), s, dtype=torch.float16), "group all_gather")
    same(
        g.all_reduce(torch.tensor([1.5 + r], dtype=torch.bfloat16), op="max"),
        torch.tensor([0.5 + w], dtype=torch.bfloat16),
        "group all_reduce bf16",
    )
    chunks = [torch.full((s + 1, 2), float(r + s)) for s in ranks]
    same(g.reduce_scatter(chunks), torch.full((r + 1, 2), float(sum(ranks) + w * r)), "group reduce_scatter")
    sent = [torch.full(((r + s) % 3, 2), 10 * r + s, dtype=torch.int32) for s in ranks]
    for s, t in enumerate(g.all_to_all(sent)):
        same(t, torch.full(((s + r) % 3, 2), 10 * s + r, dtype=torch.int32), "group all_to_all")
    pieces = [torch.arange(2.0 * (s + 1)).reshape(2, s + 1).t() for s in ranks] if r == 0 else None
    same(g.scatter(pieces, src=0), torch.arange(2.0 * (r + 1)).reshape(2, r + 1).t(), "group scatter")
    gathered = g.gather(torch.full((r,), r, dtype=torch.uint8), dst=w - 1)
    if r == w - 1:
        assert gathered is not None
        for s in ranks:
            same(gathered[s], torch.full((s,), s, dtype=torch.uint8), "group gather")
    else:
        assert gathered is None
    assert g.exchange({"rank": r, "t": (r, "é")}) == [{"rank": s, "t": [s, "é"]} for s in ranks]
    # sub-groups: the last rank alone, and {0, w-1}; then destroy them
    members = sorted({0, w - 1})
    sub = g.new_group(members)
    if r in members:
        assert sub is not None and sub.backend == "mpi" and sub.size == len(members)
        assert sub.rank == members.index(r)
        same(sub.all_reduce(torch.ones(1)), torch.full((1,), float(len(members))), "sub all_reduce")
        assert sub.exchange(r) == members
        sub.destroy()
    else:
        assert sub is None
    evens = g.new_group([s for s in ranks if s % 2 == 0])
    if r % 2 == 0:
        assert evens is not None
        same(evens.all_gather(torch.tensor([r]))[-1], torch.tensor([max(s for s in ranks if s % 2 == 0)]), "evens")
        evens.destroy()
    g.barrier()


def check_direct_paths() -> None:
    """With verify=False, plain calls never reach the base class's general path (the speed of the Group).

    The public collectives hand a checked call to MpiGroup's direct paths;
    the general path would run the primitives, which are made to refuse here.
    """
    g = shardwise.get_default_group()
    r, w = g.rank, g.size
    saved = dict.fromkeys(("_broadcast", "_all_reduce", "_all_gather", "_reduce_scatter", "_all_to_all"))

    def refuse(*args, **kwargs):
        raise AssertionError("the direct path was not taken")

    g.verify = False
    try:
        for name in saved:
            setattr(g, name, refuse)
        t = torch.full((2 * w, 3), float(r + 1))
        same(g.all_reduce(t.clone(), op="max"), torch.full((2 * w, 3), float(w)), "direct all_reduce")
        same(g.broadcast(t.clone(), src=w - 1), torch.full((2 * w, 3), float(w)), "direct broadcast")
        out = torch.empty(2 * w * w, 3)
        g.all_gather(t, out=out)
        same(out, torch.cat([torch.full((2 * w, 3), float(s + 1)) for s in range(w)]), "direct all_gather")
        into = torch.empty(2, 3)
        g.reduce_scatter(list(t.split(2)), op="sum", out=into)
        same(into, torch.full((2, 3), float(w * (w + 1) // 2)), "direct reduce_scatter")
        same(g.reduce_scatter(list(t.split(2))), into, "direct reduce_scatter, new output")
        recv = torch.empty(2 * w, 3)
        g.all_to_all_single(t, out=recv)
        same(recv, torch.cat([torch.full((2, 3), float(s + 1)) for s in range(w)]), "direct all_to_all_single")
        sizes = [1] * w
        same(g.all_to_all_single(t[:w], sizes, sizes), torch.arange(1.0, w + 1).repeat_interleave(3).reshape(w, 3),
             "direct all_to_all_single, sizes")
    finally:
        for name in saved:
            delattr(g, name)
        g.verify = True
    # Outside the plain case (a transposed input, bfloat16) the general path runs, with the same results.
    g.verify = False
    try:
        tt = torch.arange(6.0).reshape(2, 3).t() * (r + 1)
        same(g.all_reduce(tt), torch.arange(6.0).reshape(2, 3).t() * (w * (w + 1) // 2), "general all_reduce")
        same(g.all_reduce(torch.ones(2, dtype=torch.bfloat16)), torch.full((2,), float(w), dtype=torch.bfloat16),
             "general all_reduce bf16")
    finally:
        g.verify = True


def main() -> None:
    group = shardwise.init()
    check_raw(group.comm.Dup())
    check_group()
    check_direct_paths()
    print(f"RANK {group.rank} OF {group.size} OK", flush=True)
    shardwise.destroy()


if __name__ == "__main__":
    main()
