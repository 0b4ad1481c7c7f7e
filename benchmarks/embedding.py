"""Sharded embedding lookups: torch 2.13's ``torch.distributed._shard`` against shardwise, side by side in one run.

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/embedding.py

The weight is V = 200,000 x D = 128 float32, sharded by ``ChunkShardingSpec``
row-wise (dim 0) or column-wise (dim 1) over the two ranks. Each rank looks up
its own 4096 x 32 int64 ids (uniformly random, seeded per rank): with
``F.embedding`` and with ``F.embedding_bag(mode="sum")`` (4096 bags of 32 ids,
2-D input). Each case is timed forward only (autograd on, as in training) and
forward plus the backward of ``out.sum()`` (the local shard's gradient is reset
to None after each call).

Columns: ``torch.distributed._shard`` over a torch gloo process group; shardwise
over the same gloo group (``shardwise.torch_group.wrap_process_group``); and
shardwise over MPI (``shardwise.init("mpi")``). The shardwise columns are timed
with the default ``verify=True`` (a cross-rank handshake per collective that
makes a mismatched call raise instead of hang) and with ``verify=False``.
Before timing, each case's outputs and local shard gradients are compared
(untimed) with torch._shard's, and the outputs with the dense lookup, so the
columns cannot silently compute different things.

The last columns time the local work alone: the dense op (torch's kernels,
with its backward for fwd+bwd) on this rank's own shard over exactly the ids
that shard serves (row-wise: every rank's ids that fall in its rows, in their
bags; column-wise: every rank's ids), with no communication. That is what
torch._shard computes locally, so ``torch._shard ms / local ms`` shows how
much of its time is communication and overhead. shardwise can beat it: it
deduplicates ids, and its results and gradients avoid page faults (see
``shardwise._comm.buffers``) and use a faster bag backward.

Each cell is the median of the timed calls after warm-up ones, with a barrier
before each call; the order of the implementations rotates between calls so
that none always runs right after another's traffic. Every figure is the
slowest rank's median. Rank 0 writes a markdown table to
benchmarks/results/embedding.md and prints it.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any, Callable

import shardwise_mpi
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _timing import library_line, mpi, publish, script_args, time_all, with_verify
from torch.distributed._shard import _shard_tensor
from torch.distributed._shard.sharding_spec import ChunkShardingSpec as TorchChunkSpec

import shardwise
from shardwise.torch_group import wrap_process_group

V, D = 200_000, 128
BATCH, BAG = 4096, 32
WARMUP = 2
REPEATS = 11
SHARDWISE = ("gloo", "gloo-noverify", "mpi", "mpi-noverify")
COLUMNS = ("torch", *SHARDWISE)
OPS: dict[str, Callable[[torch.Tensor, Any], torch.Tensor]] = {
    "embedding": lambda ids, w: F.embedding(ids, w),
    "embedding_bag sum": lambda ids, w: F.embedding_bag(ids, w, mode="sum"),
}
DIMS = {0: "row-wise", 1: "column-wise"}






def local_shard(weight: Any) -> torch.Tensor:
    """The one local shard tensor of a torch._shard or shardwise ShardedTensor."""
    shards = weight.local_shards()
    assert len(shards) == 1, f"expected one local shard, got {len(shards)}"
    return shards[0].tensor


def make_weights(dense: torch.Tensor, dim: int, size: int, groups: dict[str, Any]) -> dict[str, Any]:
    """Shard ``dense`` on ``dim`` with torch._shard and with shardwise over each group; shards require grad."""
    placements = [f"rank:{r}/cpu" for r in range(size)]
    weights = {"torch": _shard_tensor(dense, TorchChunkSpec(dim=dim, placements=placements), src_rank=0)}
    spec = shardwise.ChunkShardingSpec(dim=dim, placements=placements)
    for label, group in groups.items():
        weights[label] = shardwise.shard_tensor(dense, spec, src_rank=0, process_group=group)
    for w in weights.values():
        local_shard(w).requires_grad_(True)
    return weights


def forward(op: Callable[[torch.Tensor, Any], torch.Tensor], ids: torch.Tensor, w: Any) -> Callable[[], Any]:
    """The forward-only call to time."""
    return lambda: op(ids, w)


def forward_backward(op: Callable[[torch.Tensor, Any], torch.Tensor], ids: torch.Tensor, w: Any) -> Callable[[], Any]:
    """The forward + backward call to time; drops the gradient afterwards so calls do not accumulate."""
    shard = local_shard(w)

    def call() -> None:
        op(ids, w).sum().backward()
        shard.grad = None

    return call


def served(every: torch.Tensor, dim: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids this rank's shard serves (local row numbers for row-wise) and their bag offsets.

    ``every`` is all ranks' ids, ``[size * BATCH, BAG]``; bags keep their
    structure (a bag holds the ids of one original bag that the shard serves).
    """
    if dim == 1:
        flat = every.reshape(-1)
        return flat, torch.arange(0, flat.numel(), BAG)
    rows = -(-V // size)
    first = rank * rows
    mine = (every >= first) & (every < first + rows)
    per_bag = mine.sum(1)
    return every[mine] - first, per_bag.cumsum(0) - per_bag


def local_call(
    op_name: str, mode: str, shard: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor
) -> Callable[[], Any]:
    """The local dense op on the served ids (see the module docstring), forward or forward + backward."""
    w = shard.detach().clone().requires_grad_(True)

    def call() -> None:
        if op_name == "embedding":
            out = F.embedding(ids, w)
        else:
            out = F.embedding_bag(ids, w, offsets, mode="sum")
        if mode == "fwd+bwd":
            out.sum().backward()
            w.grad = None

    return call


def check(
    comm: Any,
    name: str,
    op: Callable[[torch.Tensor, Any], torch.Tensor],
    ids: torch.Tensor,
    dense: torch.Tensor,
    weights: dict[str, Any],
) -> None:
    """Untimed: every column's output and local shard gradient equal torch._shard's (and the output the dense one).

    Raises on every rank (after all of them have compared) if any rank found a mismatch.
    """
    outs, grads = {}, {}
    for label, w in weights.items():
        out = op(ids, w)
        out.sum().backward()
        shard = local_shard(w)
        outs[label], grads[label] = out.detach(), shard.grad
        shard.grad = None
    problems = []
    expected = {"dense": op(ids, dense)}
    for label in weights:
        expected["torch"] = outs["torch"]
        for ref, want in expected.items():
            if label == ref:
                continue
            try:
                torch.testing.assert_close(outs[label], want)
            except AssertionError as exc:
                problems.append(f"{name}: {label} output != {ref} output: {exc}")
        if label != "torch":
            try:
                torch.testing.assert_close(grads[label], grads["torch"])
            except AssertionError as exc:
                problems.append(f"{name}: {label} local shard grad != torch._shard's: {exc}")
    reports = comm.allgather(problems)
    if any(reports):
        text = "\n".join(f"rank {r}: {p}" for r, ps in enumerate(reports) for p in ps)
        raise AssertionError(f"results differ:\n{text}")


def main() -> int:
    global V, D, BATCH, BAG, WARMUP, REPEATS
    args = script_args(__doc__)
    if args.smoke:
        V, D, BATCH, BAG, WARMUP, REPEATS = 2000, 16, 64, 4, 1, 2
    # torch._shard warns on every call that it is deprecated in favour of DTensor (and so do its collectives).
    warnings.filterwarnings("ignore", category=FutureWarning)
    # This script makes torch.distributed's default group itself (gloo, below), so the mpi
    # backend must leave torch.distributed alone (by default it brings up "mpi4py" there).
    os.environ["SHARDWISE_MPI_TORCH_DIST"] = "0"
    mpi_group = shardwise.init("mpi")
    comm = mpi().COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    # Makes env:// fall back to MPI under mpiexec: gloo then needs no MASTER_ADDR.
    shardwise_mpi.register_torch_backend()
    dist.init_process_group("gloo")  # rendezvous through MPI: no MASTER_ADDR needed
    gloo = wrap_process_group(dist.group.WORLD)
    groups = {"gloo": gloo, "mpi": mpi_group}
    dense = torch.randn(V, D, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, V, (BATCH, BAG), generator=torch.Generator().manual_seed(1000 + rank))
    every = torch.cat([torch.randint(0, V, (BATCH, BAG), generator=torch.Generator().manual_seed(1000 + r))
                       for r in range(size)])
    rows = []
    for dim, sharding in DIMS.items():
        weights = make_weights(dense, dim, size, groups)
        served_ids, served_offsets = served(every, dim, rank, size)
        for op_name, op in OPS.items():
            for grp in groups.values():
                grp.verify = True
            check(comm, f"{op_name} {sharding}", op, ids, dense, weights)
            for mode, make in (("fwd", forward), ("fwd+bwd", forward_backward)):
                calls = {"torch": make(op, ids, weights["torch"])}
                for label, grp in groups.items():
                    calls[label] = with_verify(grp, True, make(op, ids, weights[label]))
                    calls[label + "-noverify"] = with_verify(grp, False, make(op, ids, weights[label]))
                calls["local"] = local_call(op_name, mode, local_shard(weights["torch"]), served_ids, served_offsets)
                rows.append((op_name, sharding, mode, time_all(comm, calls, REPEATS, WARMUP)))
        del weights
    if rank == 0:
        text = table(rows, size)
        publish(args.out, "embedding.md", text)
    dist.destroy_process_group()
    shardwise.destroy()
    return 0




def table(rows: list[tuple[str, str, str, dict[str, float]]], size: int) -> str:
    lines = [
        f"{size} ranks, CPU; weight {V:,} x {D} float32; per rank {BATCH} x {BAG} int64 ids (embedding) or "
        f"{BATCH} bags of {BAG} ids (embedding_bag, 2-D input, mode sum); median of {REPEATS} calls after "
        f"{WARMUP} warm-up, slowest rank's median; {library_line()}.",
        "Speedup = torch._shard ms / shardwise ms (> 1: shardwise is faster). `no verify` = `group.verify = False` "
        "(the default is True: a cross-rank handshake per collective). fwd+bwd = forward + backward of out.sum(). "
        "Local = torch's dense op on the rank's own shard over the ids it serves, no communication (see "
        "benchmarks/embedding.py): the local work torch._shard does.",
        "",
        "| op | sharding | pass | torch._shard gloo ms | shardwise gloo ms | speedup | gloo no verify ms | speedup "
        "| shardwise mpi ms | speedup | mpi no verify ms | speedup | local dense op ms | torch._shard / local |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for op_name, sharding, mode, t in rows:
        cells = [f"{t['torch'] * 1e3:.1f}"]
        for col in SHARDWISE:
            cells += [f"{t[col] * 1e3:.1f}", f"{t['torch'] / t[col]:.2f}"]
        cells += [f"{t['local'] * 1e3:.1f}", f"{t['torch'] / t['local']:.2f}"]
        lines.append(f"| {op_name} | {sharding} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
