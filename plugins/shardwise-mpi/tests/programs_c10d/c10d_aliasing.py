"""Run under ``mpiexec -n N``: every in-place and aliased-buffer form of the "mpi4py" backend's collectives.

MPI forbids a send buffer that overlaps the receive buffer; torch code (FSDP2's
all-gather into the buffer its shard is a view of, in-place reduce-scatters,
collectives on views) passes such buffers. Each check compares with the value
the call must produce when every input is read as it was at the call. A
recording proxy around the group's communicator shows which MPI calls passed
``MPI_IN_PLACE``, and a dispatch mode which calls copied tensors (an input
that is exactly this rank's slot of the output must not be copied). Prints ``CHECKS <rank> <name>,<name>,... END`` and then
``OK <rank> <count>``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import shardwise_mpi
import shardwise_mpi._c10d as c10d
import shardwise_mpi._collectives as C
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.utils._python_dispatch import TorchDispatchMode

_RECORDED = ("Allgather", "Allgatherv", "Gatherv", "Scatterv", "Reduce_scatter", "Reduce_scatter_block")


class Recorder:
    """Forwards to an mpi4py communicator, noting each data-moving call and whether it passed ``MPI_IN_PLACE``."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.calls: list[tuple[str, bool]] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.comm, name)
        if name not in _RECORDED:
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, any(a is MPI.IN_PLACE for a in (*args, *kwargs.values()))))
            return attr(*args, **kwargs)

        return call

    def take(self) -> list[tuple[str, bool]]:
        calls, self.calls = self.calls, []
        return calls


class TensorOps(TorchDispatchMode):
    """Records the names of the aten ops run inside it (tells a zero-copy collective from one that copies)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

    def copies(self) -> list[str]:
        return [op for op in self.ops if "copy" in op or "clone" in op or "contiguous" in op]


def main() -> None:
    shardwise_mpi.register_torch_backend()
    dist.init_process_group("mpi4py")
    rank, n = dist.get_rank(), dist.get_world_size()
    pg = dist.group.WORLD
    assert isinstance(pg, c10d.MpiProcessGroup)
    rec = Recorder(pg.comm)
    pg.comm = rec
    checks: list[str] = []

    def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
        assert torch.equal(got, want), f"{name} on rank {rank}:\n got {got}\nwant {want}"
        checks.append(name)

    def in_place(name: str, expected: bool) -> None:
        calls = rec.take()
        assert calls and all(flag == expected for _, flag in calls), f"{name} on rank {rank}: MPI calls {calls}"

    # --- overlaps: same device, overlapping byte ranges, whatever the view -----------
    base = torch.arange(24.0)
    grid = base.view(4, 6)
    raw = bytearray(64)
    cases = [
        ("same tensor", base, base, True),
        ("disjoint slices", base[:12], base[12:], False),
        ("touching slices", base[:12], base[11:13], True),
        ("transposed view", grid.t(), base[5:6], True),
        ("column vs later rows", grid[:, 0], base[19:], False),  # the column ends at element 18
        ("interleaved (conservative)", base[::2], base[1::2], True),
        ("other storage", base, base.clone(), False),
        ("empty view", base[3:3], base, False),
        ("reinterpreted bytes", base.view(torch.uint8)[40:44], base[10:11], True),
        ("two storages over one buffer", torch.frombuffer(raw, dtype=torch.uint8), torch.frombuffer(raw, dtype=torch.int32)[3:], True),
        ("expanded", torch.zeros(1).expand(5), base, False),
    ]  # fmt: skip
    for name, a, b, want_overlap in cases:
        assert C.overlaps(a, b) is want_overlap and C.overlaps(b, a) is want_overlap, f"overlaps: {name}"
        checks.append(f"overlaps {name}")

    k = 3

    # Every rank's contribution: rank r holds r*100 + [0, 1, 2].
    def mine(r: int) -> torch.Tensor:
        return torch.arange(float(k)) + 100 * r

    gathered = torch.cat([mine(r) for r in range(n)])

    # --- all_gather_into_tensor --------------------------------------------------------
    # Every all-gather passes MPI_IN_PLACE (on all ranks, as the standard wants).
    # FSDP2's form: the input is this rank's slot of the output -> nothing is copied.
    out = torch.full((n * k,), -1.0)
    out[rank * k : (rank + 1) * k] = mine(rank)
    with TensorOps() as ops:
        dist.all_gather_into_tensor(out, out[rank * k : (rank + 1) * k])
    check("all_gather_into_tensor input is own slot", out, gathered)
    in_place("all_gather_into_tensor input is own slot", True)
    assert ops.copies() == [], f"own slot: copied with {ops.copies()} (ops {ops.ops})"
    # 2-D, rows as slots
    out2 = torch.full((n * 2, 3), -1.0)
    out2[2 * rank : 2 * rank + 2] = torch.arange(6.0).view(2, 3) + 10 * rank
    with TensorOps() as ops:
        dist.all_gather_into_tensor(out2, out2[2 * rank : 2 * rank + 2])
    assert ops.copies() == [], f"own rows: copied with {ops.copies()}"
    check(
        "all_gather_into_tensor 2-D own rows",
        out2,
        torch.cat([torch.arange(6.0).view(2, 3) + 10 * r for r in range(n)]),
    )
    in_place("all_gather_into_tensor 2-D own rows", True)
    # the input is slot 0 on every rank: rank 0's own slot; elsewhere copied aside, then into its slot
    out = torch.full((n * k,), -1.0)
    out[:k] = mine(rank)
    with TensorOps() as ops:
        dist.all_gather_into_tensor(out, out[:k])
    check("all_gather_into_tensor input is slot 0", out, gathered)
    in_place("all_gather_into_tensor input is slot 0", True)
    assert bool(ops.copies()) == (rank != 0), f"slot 0 on rank {rank}: copies {ops.copies()}"
    # a separate input (of another shape) is copied into this rank's slot
    out = torch.full((n, k), -1.0)
    with TensorOps() as ops:
        dist.all_gather_into_tensor(out, mine(rank).view(1, k))
    check("all_gather_into_tensor separate input", out.view(-1), gathered)
    in_place("all_gather_into_tensor separate input", True)
    assert ops.copies() == ["copy_"], f"separate input: copies {ops.copies()}"
    # the input straddles two slots
    out = torch.full((n * k,), -1.0)
    out[1 : k + 1] = mine(rank)
    dist.all_gather_into_tensor(out, out[1 : k + 1])
    check("all_gather_into_tensor input straddles slots", out, gathered)
    # the input is a strided view of the output (a column of its 2-D form)
    out = torch.full((k * n,), -1.0)
    out.view(k, n)[:, rank % n] = mine(rank)
    dist.all_gather_into_tensor(out, out.view(k, n)[:, rank % n])
    check("all_gather_into_tensor input is a strided view", out, gathered)
    # a non-contiguous output (transposed), input a view of the same storage
    store = torch.full((k, n), -1.0)
    store[:, rank] = mine(rank)
    out_t = store.t()  # (n, k), non-contiguous; row r is column r of store
    dist.all_gather_into_tensor(out_t, store[:, rank])
    check("all_gather_into_tensor non-contiguous output", out_t.reshape(-1), gathered)
    # the backend's base name (FSDP1, functional collectives)
    rec.take()
    out = torch.full((n * k,), -1.0)
    out[rank * k : (rank + 1) * k] = mine(rank)
    pg._allgather_base(out, out[rank * k : (rank + 1) * k]).wait()
    check("_allgather_base own slot", out, gathered)
    in_place("_allgather_base own slot", True)
    # coalesced (torch's _coalescing_manager -> all_gather_single_coalesced)
    outs = [torch.full((n * k,), -1.0), torch.full((n * 2,), -1.0)]
    outs[0][rank * k : (rank + 1) * k] = mine(rank)
    outs[1][:2] = torch.tensor([rank, -rank], dtype=torch.float32)
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.all_gather_into_tensor(outs[0], outs[0][rank * k : (rank + 1) * k])
        dist.all_gather_into_tensor(outs[1], outs[1][:2])
    cm.wait()
    check("allgather_into_tensor_coalesced aliased 0", outs[0], gathered)
    check(
        "allgather_into_tensor_coalesced aliased 1", outs[1], torch.tensor([[r, -r] for r in range(n)]).float().view(-1)
    )
    pg.allgather_into_tensor_coalesced([outs[0]], [outs[0][rank * k : (rank + 1) * k]]).wait()
    check("allgather_into_tensor_coalesced direct", outs[0], gathered)
    rec.take()

    # --- reduce_scatter_tensor -----------------------------------------------------------
    def contrib(r: int) -> torch.Tensor:
        return torch.arange(float(n * k)) * (r + 1)

    reduced = sum(contrib(r) for r in range(n))
    assert isinstance(reduced, torch.Tensor)
    own = slice(rank * k, (rank + 1) * k)
    for op_name, op, want_all in (("sum", dist.ReduceOp.SUM, reduced), ("avg", dist.ReduceOp.AVG, reduced / n)):
        inp = contrib(rank)
        dist.reduce_scatter_tensor(inp[own], inp, op=op)
        rest = contrib(rank)
        rest[own] = want_all[own]
        check(f"reduce_scatter_tensor in place {op_name}", inp, rest)  # only this rank's slot changed
    inp = contrib(rank)
    dist.reduce_scatter_tensor(inp[:k], inp)
    check("reduce_scatter_tensor output is slot 0", inp[:k], reduced[own])
    inp = contrib(rank)
    dist.reduce_scatter_tensor(inp[1 : k + 1], inp)
    check("reduce_scatter_tensor output straddles slots", inp[1 : k + 1], reduced[own])
    inp = contrib(rank)
    pg._reduce_scatter_base(inp[own], inp, dist.ReduceScatterOptions()).wait()
    check("_reduce_scatter_base in place", inp[own], reduced[own])
    inp = contrib(rank).to(torch.bfloat16)  # reduced in float32 through staging buffers
    dist.reduce_scatter_tensor(inp[own], inp)
    check("reduce_scatter_tensor in place bfloat16", inp[own], reduced[own].to(torch.bfloat16))
    ins = [contrib(rank), contrib(rank) * 2]
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.reduce_scatter_tensor(ins[0][own], ins[0])
        dist.reduce_scatter_tensor(ins[1][:k], ins[1])
    cm.wait()
    check("reduce_scatter_tensor_coalesced aliased 0", ins[0][own], reduced[own])
    check("reduce_scatter_tensor_coalesced aliased 1", ins[1][:k], reduced[own] * 2)
    # reduce_scatter (list) whose output is one of its inputs
    pieces = [torch.full((2,), float(rank + d)) for d in range(n)]
    dist.reduce_scatter(pieces[rank], pieces)
    check("reduce_scatter list output is an input", pieces[rank], torch.full((2,), float(sum(range(n)) + n * rank)))
    rec.take()

    # --- all_reduce on views -------------------------------------------------------------
    big = torch.arange(20.0).view(4, 5) + rank
    want = torch.arange(20.0).view(4, 5) * n + sum(range(n))
    for name, view in (
        ("contiguous rows", lambda t: t[1:3]),
        ("column", lambda t: t[:, 2]),
        ("transposed", lambda t: t.t()),
        ("every other row", lambda t: t[::2]),
        ("flat slice", lambda t: t.view(-1)[3:11]),
    ):
        t = big.clone()
        dist.all_reduce(view(t))
        expected = big.clone()
        view(expected).copy_(view(want))
        check(f"all_reduce on a view: {name}", t, expected)  # and nothing outside the view changed
    t = big.clone()
    dist.all_reduce(t[:, 1:4], op=dist.ReduceOp.AVG)
    expected = big.clone()
    expected[:, 1:4] = want[:, 1:4] / n
    check("all_reduce avg on a strided block", t, expected)

    # --- all_gather (list) whose outputs alias the input ------------------------------
    inp = mine(rank)
    outs = [torch.empty(k) for _ in range(n)]
    outs[rank] = inp
    dist.all_gather(outs, inp)
    check("all_gather output is the input", torch.cat(outs), gathered)
    inp = mine(rank)
    outs = [inp] + [torch.empty(k) for _ in range(n - 1)]
    dist.all_gather(outs, inp)
    check("all_gather output 0 is the input", torch.cat(outs), gathered)
    flat = torch.full((n * k,), -1.0)
    flat[rank * k : (rank + 1) * k] = mine(rank)
    dist.all_gather(list(flat.split(k)), flat[rank * k : (rank + 1) * k])
    check("all_gather outputs are views of one buffer", flat, gathered)

    # --- broadcast / scatter / gather with aliased or non-contiguous buffers ----------
    root = n - 1
    t = (torch.arange(12.0).view(3, 4) + rank).clone()
    dist.broadcast(t[:, 1], src=root)
    expected = torch.arange(12.0).view(3, 4) + rank
    expected[:, 1] = (torch.arange(12.0).view(3, 4) + root)[:, 1]
    check("broadcast into a column", t, expected)
    t = torch.arange(12.0) + rank
    dist.broadcast(t[4:8], src=0)
    expected = torch.arange(12.0) + rank
    expected[4:8] = torch.arange(4.0, 8.0)
    check("broadcast into a slice", t, expected)

    buf = torch.arange(float(n * k)) * 10 if rank == 0 else torch.full((n * k,), -1.0)
    views = list(buf.split(k))
    dist.scatter(views[rank], views if rank == 0 else None, src=0)
    check("scatter output is one of the root's inputs", views[rank], (torch.arange(float(n * k)) * 10)[own])
    col = torch.full((k, 2), -1.0)
    dist.scatter(col[:, 1], [torch.full((k,), float(r)) for r in range(n)] if rank == 0 else None, src=0)
    check("scatter into a column", col, torch.stack([torch.full((k,), -1.0), torch.full((k,), float(rank))], 1))

    flat = torch.full((n * k,), -1.0)
    flat[rank * k : (rank + 1) * k] = mine(rank)
    dist.gather(flat[rank * k : (rank + 1) * k], list(flat.split(k)) if rank == root else None, dst=root)
    if rank == root:
        check("gather input is one of the root's outputs", flat, gathered)
    grid = torch.stack([torch.full((k,), -1.0)] * 2, 1)
    grid[:, 0] = mine(rank)
    parts = [torch.empty(k) for _ in range(n)] if rank == root else None
    dist.gather(grid[:, 0], parts, dst=root)
    if parts is not None:
        check("gather from a column", torch.cat(parts), gathered)
    # Outputs that overlap one another (the first reaches one element into the second): staged, copied in rank order.
    wide = torch.full((n * k + 1,), -1.0)
    outs = [wide[1 : k + 1]] + [wide[r * k : r * k + k] for r in range(1, n)]
    dist.gather(mine(rank), outs if rank == root else None, dst=root)
    if rank == root:
        want = torch.full((n * k + 1,), -1.0)
        want[1 : k + 1] = mine(0)
        for r in range(1, n):
            want[r * k : r * k + k] = mine(r)
        check("gather outputs overlap one another", wide, want)

    # --- all_to_all_single in place and overlapping ----------------------------------
    def a2a_in(r: int) -> torch.Tensor:
        return torch.arange(float(2 * n)) + 100 * r

    want = torch.cat([a2a_in(r)[2 * rank : 2 * rank + 2] for r in range(n)])
    t = a2a_in(rank)
    dist.all_to_all_single(t, t)
    check("all_to_all_single in place", t, want)
    t = torch.cat([a2a_in(rank), torch.zeros(1)])
    dist.all_to_all_single(t[1:], t[:-1])
    check("all_to_all_single overlapping", t[1:], want)
    t = a2a_in(rank)
    outs = list(t.split(2))
    dist.all_to_all(outs, list(t.split(2)))
    check("all_to_all outputs are the inputs", torch.cat(outs), want)

    # --- PREMUL_SUM (FSDP2's set_gradient_divide_factor): scale, then sum -------------
    premul = dist._make_nccl_premul_sum(0.25)
    t = torch.arange(8.0).view(2, 4) + rank
    dist.all_reduce(t[:, 1:3], op=premul)
    expected = torch.arange(8.0).view(2, 4) + rank
    expected[:, 1:3] = ((torch.arange(8.0).view(2, 4) * n + sum(range(n))) * 0.25)[:, 1:3]
    check("premul_sum all_reduce on a view", t, expected)
    inp = contrib(rank)
    dist.reduce_scatter_tensor(inp[own], inp, op=premul)
    check("premul_sum reduce_scatter_tensor in place", inp[own], reduced[own] * 0.25)
    inp = contrib(rank)
    out = torch.empty(k)
    dist.reduce_scatter_tensor(out, inp, op=dist._make_nccl_premul_sum(torch.tensor(0.5)))
    check("premul_sum tensor factor", out, reduced[own] * 0.5)
    check("premul_sum leaves the input alone", inp, contrib(rank))
    out = torch.empty(k)
    dist.reduce_scatter(out, list(contrib(rank).split(k)), op=premul)
    check("premul_sum reduce_scatter list", out, reduced[own] * 0.25)
    rec.take()

    # --- the shared functions, as the shardwise MpiGroup calls them ------------------
    comm = pg.comm
    rec.take()
    out = torch.full((n * k,), -1.0)
    out[root * k : (root + 1) * k] = mine(root)
    src = out[root * k : (root + 1) * k] if rank == root else mine(rank)
    C.gatherv(comm, out if rank == root else None, src, [k] * n, root)
    if rank == root:
        check("gatherv root's input is its slot", out, gathered)
    in_place("gatherv root's input is its slot", rank == root)
    whole = torch.arange(float(n * k)) if rank == root else torch.empty(0)
    out = whole[root * k : (root + 1) * k] if rank == root else torch.full((k,), -1.0)
    C.scatterv(comm, out, whole if rank == root else None, [k] * n, root)
    check("scatterv root's output is its slot", out, torch.arange(float(n * k))[own])
    in_place("scatterv root's output is its slot", rank == root)
    if rank == root:
        whole = torch.arange(float(n * k))
        C.scatterv(comm, whole[:k], whole, [k] * n, root)  # the root's output overlaps another rank's slot
        got = whole[:k]
    else:
        got = torch.full((k,), -1.0)
        C.scatterv(comm, got, None, [k] * n, root)
    check("scatterv root's output overlaps another slot", got, torch.arange(float(n * k))[own])
    in_place("scatterv root's output overlaps another slot", False)
    counts = [r + 1 for r in range(n)]  # uneven: Allgatherv, with the input in its slot
    out = torch.full((sum(counts),), -1.0)
    start = sum(counts[:rank])
    out[start : start + counts[rank]] = float(rank)
    C.allgatherv(comm, out, out[start : start + counts[rank]], counts)
    check("allgatherv uneven own slot", out, torch.cat([torch.full((c,), float(r)) for r, c in enumerate(counts)]))
    in_place("allgatherv uneven own slot", True)
    rec.take()

    # --- object collectives (uint8 tensors through gather/broadcast/all_gather) -------
    objs: list[Any] = [None] * n
    dist.all_gather_object(objs, {"r": rank, "pad": "z" * (100 * rank)})
    assert objs == [{"r": r, "pad": "z" * (100 * r)} for r in range(n)], objs
    got_objs: list[Any] | None = [None] * n if rank == root else None
    dist.gather_object(list(range(rank * 7)), got_objs, dst=root)
    assert got_objs is None or got_objs == [list(range(r * 7)) for r in range(n)], got_objs
    lst: list[Any] = ["a" * 500, {"k": 1}] if rank == root else [None, None]
    dist.broadcast_object_list(lst, src=root)
    assert lst == ["a" * 500, {"k": 1}], lst
    one: list[Any] = [None]
    dist.scatter_object_list(one, [("to", r, "q" * (50 * r)) for r in range(n)] if rank == root else None, src=root)
    assert one == [("to", rank, "q" * (50 * rank))], one
    checks.append("object collectives with uneven sizes")

    pg.comm = rec.comm
    dist.destroy_process_group()
    print(f"CHECKS {rank} {','.join(checks)} END", flush=True)
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
