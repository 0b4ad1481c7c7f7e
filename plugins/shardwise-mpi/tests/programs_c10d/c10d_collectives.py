"""Run under ``mpiexec -n N``: every c10d collective of backend "mpi4py" against expected values.

No rendezvous variables are set: ``init_process_group("mpi4py")`` must find
rank, world size and a store through MPI. Prints ``OK <rank> <checks>`` at the end.
"""

from __future__ import annotations

import os
import sys

import shardwise_mpi
import shardwise_mpi._c10d as c10d
import torch
import torch.distributed as dist


def main() -> None:
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        assert var not in os.environ, f"{var} is set: this program tests init without rendezvous variables"
    shardwise_mpi.register_torch_backend()
    shardwise_mpi.register_torch_backend()  # idempotent
    dist.init_process_group("mpi4py")
    rank, n = dist.get_rank(), dist.get_world_size()
    assert dist.get_backend() == "mpi4py", dist.get_backend()
    assert isinstance(dist.group.WORLD, c10d.MpiProcessGroup), type(dist.group.WORLD)
    checks = []

    def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
        assert torch.equal(got, want), f"{name} on rank {rank}: got {got}, want {want}"
        checks.append(name)

    ranks = torch.arange(n)
    # all_reduce, every op and a few dtypes (bfloat16 reduces through float32).
    for dtype in (torch.float32, torch.float64, torch.int64, torch.bfloat16):
        base = torch.tensor([1, 2, 3], dtype=dtype) * (rank + 1)
        scale = torch.arange(1, n + 1)
        for op, want in (
            (dist.ReduceOp.SUM, torch.tensor([1, 2, 3]) * int(scale.sum())),
            (dist.ReduceOp.MAX, torch.tensor([1, 2, 3]) * n),
            (dist.ReduceOp.MIN, torch.tensor([1, 2, 3])),
            (dist.ReduceOp.PRODUCT, torch.tensor([1, 2, 3]) ** n * int(scale.prod())),
        ):
            t = base.clone()
            dist.all_reduce(t, op=op)
            check(f"all_reduce {op} {dtype}", t, want.to(dtype))
    t = torch.full((4,), float(rank))
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    check("all_reduce avg", t, torch.full((4,), float(ranks.float().mean())))
    t = torch.tensor([1 << rank, 3], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.BOR)
    check("all_reduce bor", t, torch.tensor([(1 << n) - 1, 3], dtype=torch.int32))
    # a transposed (non-contiguous) tensor reduces by value, not by raw storage
    m = (torch.arange(6.0).view(2, 3) + rank).t()
    dist.all_reduce(m)
    check("all_reduce transposed", m, (torch.arange(6.0).view(2, 3) * n + ranks.sum()).t())
    # async_op returns a completed work
    t = torch.ones(2)
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    check("all_reduce async", t, torch.full((2,), float(n)))

    # broadcast from the last rank
    t = torch.full((3,), float(rank))
    dist.broadcast(t, src=n - 1)
    check("broadcast", t, torch.full((3,), float(n - 1)))

    # all_gather (list) with per-rank shapes equal, and into a tensor
    outs = [torch.empty(2, dtype=torch.int64) for _ in range(n)]
    dist.all_gather(outs, torch.tensor([rank, rank * 10]))
    check("all_gather", torch.stack(outs), torch.stack([torch.tensor([r, r * 10]) for r in range(n)]))
    out = torch.empty(n, 2)
    dist.all_gather_into_tensor(out, torch.full((1, 2), float(rank)))
    check("all_gather_into_tensor", out, ranks.float().repeat_interleave(2).view(n, 2))

    # reduce_scatter (list) and reduce_scatter_tensor
    out = torch.empty(2)
    dist.reduce_scatter(out, [torch.full((2,), float(rank + r)) for r in range(n)])
    check("reduce_scatter", out, torch.full((2,), float(ranks.sum() + n * rank)))
    inp = torch.arange(2.0 * n) + rank
    out = torch.empty(2)
    dist.reduce_scatter_tensor(out, inp)
    check("reduce_scatter_tensor", out, (torch.arange(2.0 * n) * n + ranks.sum())[2 * rank : 2 * rank + 2])

    # all_to_all_single, even and uneven (rank r sends r+1+d rows to rank d)
    inp = torch.arange(n * 2.0) + 100 * rank
    out = torch.empty(n * 2)
    dist.all_to_all_single(out, inp)
    want = torch.cat([torch.arange(2.0) + 2 * rank + 100 * r for r in range(n)])
    check("all_to_all_single even", out, want)
    in_splits = [rank + 1 + d for d in range(n)]
    out_splits = [r + 1 + rank for r in range(n)]
    inp = torch.cat([torch.full((s, 3), float(10 * rank + d)) for d, s in enumerate(in_splits)])
    out = torch.empty(sum(out_splits), 3)
    dist.all_to_all_single(out, inp, out_splits, in_splits)
    want = torch.cat([torch.full((s, 3), float(10 * r + rank)) for r, s in enumerate(out_splits)])
    check("all_to_all_single uneven", out, want)
    outs = [torch.empty(r + 1) for r in range(n)]
    dist.all_to_all(outs, [torch.full((rank + 1,), float(rank * n + d)) for d in range(n)])
    check("all_to_all", torch.cat(outs), torch.cat([torch.full((r + 1,), float(r * n + rank)) for r in range(n)]))

    # gather / scatter to and from rank 0
    t = torch.full((2,), float(rank))
    gathered = [torch.empty(2) for _ in range(n)] if rank == 0 else None
    dist.gather(t, gathered, dst=0)
    if rank == 0:
        check("gather", torch.stack(gathered), ranks.float().repeat_interleave(2).view(n, 2))
    out = torch.empty(3)
    dist.scatter(out, [torch.full((3,), float(r * 7)) for r in range(n)] if rank == 0 else None, src=0)
    check("scatter", out, torch.full((3,), float(rank * 7)))
    t = torch.full((2,), float(rank + 1))
    dist.reduce(t, dst=0)
    if rank == 0:
        check("reduce", t, torch.full((2,), float((ranks + 1).sum())))

    # send / recv around a ring
    if n > 1:
        t = torch.full((2,), float(rank))
        got = torch.empty(2)
        if rank % 2 == 0:
            dist.send(t, (rank + 1) % n)
            dist.recv(got, (rank - 1) % n)
        else:
            dist.recv(got, (rank - 1) % n)
            dist.send(t, (rank + 1) % n)
        check("send/recv", got, torch.full((2,), float((rank - 1) % n)))
        # Every rank sends first, then receives: 1 MiB, past MPI's eager size, where a blocking send waits
        # for a receive its peer has not posted yet.
        big = 1 << 18
        nxt, prev = (rank + 1) % n, (rank - 1) % n
        sent, got = torch.full((big,), float(rank)), torch.empty(big)
        ops = [dist.P2POp(dist.isend, sent, nxt), dist.P2POp(dist.irecv, got, prev)]
        works = dist.batch_isend_irecv(ops)
        for work in works:
            work.wait()
            assert work.is_completed()
        check("batch_isend_irecv 1 MiB both ways", got, torch.full((big,), float(prev)))
        got = torch.empty(big)
        send_work = dist.isend(sent + 1, nxt)
        dist.recv(got, prev)
        send_work.wait()
        check("isend then recv 1 MiB", got, torch.full((big,), float(prev + 1)))
        # Tags received in the reverse of their sending order, both past the eager size.
        first, second = torch.empty(big), torch.empty(big)
        works = [dist.isend(sent + tag, nxt, tag=tag) for tag in (1, 2)]
        later = dist.irecv(first, prev, tag=1)
        dist.recv(second, prev, tag=2)
        later.wait()
        for work in works:
            work.wait()
        want = torch.stack([torch.full((big,), float(prev + 1)), torch.full((big,), float(prev + 2))])
        check("tags out of order", torch.stack([first, second]), want)
        # A transposed (dense, permuted) receiver gets the values in its own element order.
        square = torch.arange(6.0).view(2, 3) + rank
        into = torch.empty(3, 2).t()
        work = dist.isend(square, nxt)
        dist.recv(into, prev)
        work.wait()
        check("recv into a transposed tensor", into, torch.arange(6.0).view(2, 3) + prev)
        # A user's message whose tag an all_to_all might use inside must not meet it.
        mine = dist.isend(torch.full((2,), -1.0 - rank), nxt, tag=7011)
        out = torch.empty(2 * n)
        dist.all_to_all_single(out, torch.arange(2.0 * n) + 100 * rank)
        check("all_to_all_single beside a user message", out,
              torch.cat([torch.arange(2.0 * rank, 2.0 * rank + 2) + 100 * r for r in range(n)]))
        user = torch.empty(2)
        dist.recv(user, prev, tag=7011)
        mine.wait()
        check("the user message", user, torch.full((2,), -1.0 - prev))
        from mpi4py import MPI  # the library's largest tag

        upper = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
        if upper < (1 << 31) - 1:  # a larger tag still fits torch's int
            try:
                dist.send(sent, nxt, tag=upper + 1)
            except ValueError as exc:
                assert "MPI_TAG_UB" in str(exc), exc
                checks.append("tag past MPI_TAG_UB")
            else:
                raise AssertionError("a tag past MPI_TAG_UB was accepted")

    dist.barrier()
    checks.append("barrier")

    # object collectives
    objs: list = [None] * n
    dist.all_gather_object(objs, {"rank": rank, "name": f"r{rank}"})
    assert objs == [{"rank": r, "name": f"r{r}"} for r in range(n)], objs
    lst = [f"from {rank}", rank] if rank == 0 else [None, None]
    dist.broadcast_object_list(lst, src=0)
    assert lst == ["from 0", 0], lst
    gathered_objs = [None] * n if rank == 0 else None
    dist.gather_object(("g", rank), gathered_objs, dst=0)
    if rank == 0:
        assert gathered_objs == [("g", r) for r in range(n)], gathered_objs
    got_obj: list = [None]
    dist.scatter_object_list(got_obj, [{"to": r} for r in range(n)] if rank == 0 else None, src=0)
    assert got_obj == [{"to": rank}], got_obj
    checks.append("object collectives")

    # a sub-group of the even ranks (every rank calls new_group)
    evens = list(range(0, n, 2))
    sub = dist.new_group(evens)
    if rank in evens:
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=sub)
        check("new_group all_reduce", t, torch.tensor([float(sum(evens))]))
    dist.barrier()

    dist.destroy_process_group()
    print(f"OK {rank} {len(checks)}", flush=True)


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
