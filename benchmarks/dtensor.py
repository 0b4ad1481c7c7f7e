"""torch-native code over MPI against gloo: DTensor and torch.distributed collectives, side by side in one run.

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/dtensor.py            # 2 ranks
    .venv/bin/mpiexec -n 4 .venv/bin/python benchmarks/dtensor.py            # 4 ranks
    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/dtensor.py --quick --out /tmp/b   # smoke run (< 30 s)

One process group of each torch backend over the same processes: gloo
(the default group, its rendezvous through MPI) and shardwise-mpi's
``"mpi4py"`` (``dist.new_group(backend="mpi4py")``), plus shardwise's own
MPI group (``shardwise.init("mpi")``) and shardwise over the gloo group
(``wrap_process_group``). Four columns:

* **DTensor[gloo]** / **DTensor[mpi4py]**: a 64 MiB float32 tensor (4096 x
  4096) through ``distribute_tensor(t, mesh, [Shard(0)])`` (a scatter from
  rank 0), ``redistribute`` between ``Shard(0)`` and ``Shard(1)``
  (alternating, so every call moves data) and ``full_tensor`` of a
  ``Shard(0)`` DTensor, on a 1-D ``DeviceMesh.from_group`` of the group;
* **shardwise[gloo]** / **shardwise[mpi]**: ``shard_tensor`` (dim-0 chunks
  from rank 0), ``reshard`` between dim 0 and dim 1 chunks, ``full_tensor``,
  with shardwise's defaults (arguments verified across ranks).

Then each ``torch.distributed`` collective the ``"mpi4py"`` backend
implements, called the same way on the gloo group and on the mpi4py group,
for a "full" tensor of 4 KiB, 1 MiB and 64 MiB float32: ``broadcast`` and
``all_reduce`` of it, ``all_gather_into_tensor`` / ``all_gather`` into it,
``reduce_scatter_tensor`` of it, ``all_to_all_single`` of it,
``scatter`` of it from / ``gather`` of it to rank 0, ``reduce`` of it to
rank 0, ``send``/``recv`` of it (even rank to the next odd one), and
``barrier``. A collective a backend does not implement shows "n/a".

Every DTensor and shardwise result is compared with the dense tensor before
timing. Each cell is the slowest rank's median of the timed calls after
warm-up ones; a barrier precedes each call and the order of the columns is
shuffled every round (``_timing.time_spread``).

The floors: DTensor's ``full_tensor`` all-gathers into a tensor it has just
allocated, and on a CPU mesh it redistributes ``Shard(0)`` <-> ``Shard(1)``
as such an all-gather plus a local copy into another new tensor (torch's
``shard_dim_alltoall``: "Gloo does not support alltoall"), whatever the
backend. So the table also shows raw mpi4py's ``Allgather`` of the whole
tensor into a new tensor and that local copy alone: what no backend can go
under. shardwise keeps its buffers between calls and does neither.

Rank 0 writes ``dtensor-<W>ranks.md`` under ``--out`` (default
``benchmarks/results``) with the tables and the targets, and prints it.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import shardwise_mpi
import torch
import torch.distributed as dist
from _timing import library_line, mpi, publish, time_all
from shardwise_mpi._c10d_buffers import prefer_huge_pages
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import shardwise
from shardwise.torch_group import wrap_process_group

KIB, MIB = 1 << 10, 1 << 20
#: Columns of the DTensor table, in order.
COLUMNS = ("DTensor[gloo]", "DTensor[mpi4py]", "shardwise[gloo]", "shardwise[mpi]")
#: DTensor's over-mpi4py time may be at most this many times shardwise's over mpi (issue 20, section 4).
DTENSOR_RATIO = 1.5


@dataclass(frozen=True)
class Sizes:
    """The full run's sizes, or the quick run's."""

    side: int = 4096  # DTensor / shardwise: side x side float32 (64 MiB)
    collective_bytes: tuple[int, ...] = (4 * KIB, MIB, 64 * MIB)
    warmup: int = 2
    #: Timed calls per collective size (more for small ones: they are fast and noisy).
    repeats: tuple[tuple[int, int], ...] = ((64 * KIB, 41), (4 * MIB, 21), (1 << 62, 9))

    def repeats_for(self, nbytes: int) -> int:
        return next(n for limit, n in self.repeats if nbytes <= limit)


QUICK = Sizes(side=256, collective_bytes=(4 * KIB, 256 * KIB), warmup=1, repeats=((1 << 62, 3),))


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", "--smoke", action="store_true", help="small sizes, few repeats: checks that it runs")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results", help="results directory")
    return parser.parse_args(argv)


# --- DTensor and shardwise -------------------------------------------------
class DTensorCalls:
    """DTensor's three operations on one process group."""

    def __init__(self, pg: Any, dense: torch.Tensor) -> None:
        self.mesh = DeviceMesh.from_group(pg, "cpu")
        self.dense = dense
        self.fixed = self.distribute()  # Shard(0), for full_tensor
        self.moving = self.distribute()  # alternates between Shard(0) and Shard(1)
        self.dim = 0

    def distribute(self) -> DTensor:
        return distribute_tensor(self.dense, self.mesh, [Shard(0)])

    def redistribute(self) -> DTensor:
        self.dim = 1 - self.dim
        self.moving = self.moving.redistribute(self.mesh, [Shard(self.dim)])
        return self.moving

    def full_tensor(self) -> torch.Tensor:
        result: torch.Tensor = self.fixed.full_tensor()
        return result

    def verify(self) -> list[str]:
        problems = []
        for dim in (1, 0):
            dt = self.redistribute()
            want = self.dense.chunk(self.mesh.size(), dim=dim)[self.mesh.get_local_rank()]
            if not torch.equal(dt.to_local(), want):
                problems.append(f"redistribute to Shard({dim}) gave other values")
        if not torch.equal(self.full_tensor(), self.dense):
            problems.append("full_tensor gave other values")
        return problems


class ShardwiseCalls:
    """shardwise's ``shard_tensor`` / ``reshard`` / ``full_tensor`` on one group."""

    def __init__(self, group: Any, dense: torch.Tensor, size: int) -> None:
        self.group, self.dense = group, dense
        places = [f"rank:{r}/cpu" for r in range(size)]
        self.specs = [shardwise.ChunkShardingSpec(dim=d, placements=places) for d in (0, 1)]
        self.fixed = self.distribute()
        self.moving = self.distribute()
        self.dim = 0

    def distribute(self) -> Any:
        return shardwise.shard_tensor(self.dense, self.specs[0], src_rank=0, process_group=self.group)

    def redistribute(self) -> Any:
        self.dim = 1 - self.dim
        self.moving = self.moving.reshard(self.specs[self.dim])
        return self.moving

    def full_tensor(self) -> torch.Tensor:
        result: torch.Tensor = self.fixed.full_tensor()
        return result

    def verify(self) -> list[str]:
        problems = []
        for dim in (1, 0):
            local = self.redistribute().local_shards()[0]
            offsets, sizes = local.metadata.shard_offsets, local.metadata.shard_sizes
            want = self.dense[offsets[0] : offsets[0] + sizes[0], offsets[1] : offsets[1] + sizes[1]]
            if not torch.equal(local.tensor, want):
                problems.append(f"reshard to dim {dim} gave other values")
        if not torch.equal(self.full_tensor(), self.dense):
            problems.append("full_tensor gave other values")
        return problems


def movement(comm: Any, pgs: dict[str, Any], groups: dict[str, Any], sizes: Sizes) -> dict[str, dict[str, float]]:
    """Operation -> column -> median seconds (DTensor and shardwise), after checking every column's values."""
    size = comm.Get_size()
    dense = torch.randn(sizes.side, sizes.side, generator=torch.Generator().manual_seed(7))
    callers: dict[str, Any] = {
        "DTensor[gloo]": DTensorCalls(pgs["gloo"], dense),
        "DTensor[mpi4py]": DTensorCalls(pgs["mpi4py"], dense),
        "shardwise[gloo]": ShardwiseCalls(groups["gloo"], dense, size),
        "shardwise[mpi]": ShardwiseCalls(groups["mpi"], dense, size),
    }
    problems = [f"{col}: {p}" for col, caller in callers.items() for p in caller.verify()]
    reports = comm.allgather(problems)
    if any(reports):
        raise AssertionError(
            "results differ:\n" + "\n".join(f"rank {r}: {p}" for r, ps in enumerate(reports) for p in ps)
        )
    # What DTensor's full_tensor and redistribute cannot go under over any backend: an all-gather
    # of the whole tensor into a new tensor (DTensor allocates it: its pages are new to the process,
    # given the same transparent-huge-page advice as the "mpi4py" backend gives them).
    MPI = mpi()
    whole = torch.empty_like(dense)
    mine = dense.chunk(size)[comm.Get_rank()].clone()

    def raw() -> None:
        new = torch.empty_like(dense)
        prefer_huge_pages(new)
        comm.Allgather([mine.numpy(), MPI.FLOAT], [new.numpy(), MPI.FLOAT])

    comm.Allgather([mine.numpy(), MPI.FLOAT], [whole.numpy(), MPI.FLOAT])
    # ... plus DTensor's local step after it, alternating as redistribute does: Shard(0) -> Shard(1)
    # copies this rank's column block out of the gathered rows; Shard(1) -> Shard(0) concatenates the
    # gathered column blocks into rows (torch's all_gather_single on dim 1). Both into new tensors.
    rows_gathered = whole.view(size * sizes.side, sizes.side // size)
    rank: int = comm.Get_rank()
    step = [0]

    def local_step() -> torch.Tensor:
        step[0] ^= 1
        if step[0]:
            return whole.chunk(size, dim=1)[rank].contiguous()
        return torch.cat(rows_gathered.chunk(size, dim=0), dim=1)

    result = {}
    for op in ("distribute", "redistribute", "full_tensor"):
        calls = {col: getattr(caller, op) for col, caller in callers.items()}
        if op in ("redistribute", "full_tensor"):
            calls["raw allgather"] = raw
        if op == "redistribute":
            calls["local step"] = local_step
        result[op] = time_all(comm, calls, sizes.repeats_for(dense.numel() * 4), sizes.warmup)
    return result


# --- torch.distributed collectives -----------------------------------------
def collective_cases(nbytes: int, rank: int, size: int) -> dict[str, Callable[[Any], Callable[[], Any]]]:
    """Collective -> make(pg), which returns the call to time on ``pg`` (buffers made once, per group)."""
    n = max(nbytes // 4 // size, 1) * size
    chunk = n // size

    def broadcast(pg: Any) -> Callable[[], Any]:
        t = torch.full((n,), float(rank))
        return lambda: dist.broadcast(t, src=0, group=pg)

    def all_reduce(pg: Any) -> Callable[[], Any]:
        t = torch.ones(n)
        return lambda: dist.all_reduce(t, group=pg)

    def reduce(pg: Any) -> Callable[[], Any]:
        t = torch.ones(n)
        return lambda: dist.reduce(t, dst=0, group=pg)

    def all_gather_into_tensor(pg: Any) -> Callable[[], Any]:
        out, inp = torch.empty(n), torch.ones(chunk)
        return lambda: dist.all_gather_into_tensor(out, inp, group=pg)

    # The list forms get separate tensors, as torch code usually passes them ([torch.empty_like(x) ...]).
    def all_gather(pg: Any) -> Callable[[], Any]:
        outs, inp = [torch.empty(chunk) for _ in range(size)], torch.ones(chunk)
        return lambda: dist.all_gather(outs, inp, group=pg)

    def reduce_scatter_tensor(pg: Any) -> Callable[[], Any]:
        out, inp = torch.empty(chunk), torch.ones(n)
        return lambda: dist.reduce_scatter_tensor(out, inp, group=pg)

    def all_to_all_single(pg: Any) -> Callable[[], Any]:
        out, inp = torch.empty(n), torch.ones(n)
        return lambda: dist.all_to_all_single(out, inp, group=pg)

    def scatter(pg: Any) -> Callable[[], Any]:
        out = torch.empty(chunk)
        pieces = [torch.ones(chunk) for _ in range(size)] if rank == 0 else None
        return lambda: dist.scatter(out, pieces, src=0, group=pg)

    def gather(pg: Any) -> Callable[[], Any]:
        inp = torch.ones(chunk)
        outs = [torch.empty(chunk) for _ in range(size)] if rank == 0 else None
        return lambda: dist.gather(inp, outs, dst=0, group=pg)

    def send_recv(pg: Any) -> Callable[[], Any]:
        t = torch.ones(n)
        peer = rank + 1 if rank % 2 == 0 else rank - 1
        if peer >= size:
            return lambda: None
        if rank % 2 == 0:
            return lambda: dist.send(t, dst=peer, group=pg)
        return lambda: dist.recv(t, src=peer, group=pg)

    return {
        "broadcast": broadcast,
        "all_reduce": all_reduce,
        "reduce": reduce,
        "all_gather_into_tensor": all_gather_into_tensor,
        "all_gather": all_gather,
        "reduce_scatter_tensor": reduce_scatter_tensor,
        "all_to_all_single": all_to_all_single,
        "scatter": scatter,
        "gather": gather,
        "send/recv": send_recv,
    }


def _works(comm: Any, make: Callable[[], Callable[[], Any]]) -> Optional[Callable[[], Any]]:
    """The call, or None where any rank could not make or run it (a backend without the collective)."""
    try:
        call: Optional[Callable[[], Any]] = make()
        assert call is not None
        call()
        ok = True
    except (RuntimeError, NotImplementedError, ValueError):
        call, ok = None, False
    return call if all(comm.allgather(ok)) else None


def collectives(comm: Any, pgs: dict[str, Any], sizes: Sizes) -> list[tuple[str, int, dict[str, Optional[float]]]]:
    """(collective, bytes, backend -> median seconds or None) for every collective and size, and the barrier."""
    rank, size = comm.Get_rank(), comm.Get_size()
    rows: list[tuple[str, int, dict[str, Optional[float]]]] = []
    barrier: dict[str, Callable[[], Any]] = {
        name: functools.partial(dist.barrier, group=pg) for name, pg in pgs.items()
    }
    rows.append(("barrier", 0, dict(time_all(comm, barrier, sizes.repeats_for(0), sizes.warmup))))
    for nbytes in sizes.collective_bytes:
        for name, make in collective_cases(nbytes, rank, size).items():
            made = {backend: _works(comm, functools.partial(make, pg)) for backend, pg in pgs.items()}
            calls = {backend: call for backend, call in made.items() if call is not None}
            timed = time_all(comm, calls, sizes.repeats_for(nbytes), sizes.warmup) if calls else {}
            rows.append((name, nbytes, {backend: timed.get(backend) for backend in pgs}))
    return rows


# --- report ------------------------------------------------------------------
def _size(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes >= MIB else f"{nbytes // KIB} KiB" if nbytes else "—"


def _ms(seconds: Optional[float]) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.3f}" if seconds < 1e-2 else f"{seconds * 1e3:.1f}"


def report(
    size: int, sizes: Sizes, moved: dict[str, dict[str, float]], rows: list[tuple[str, int, dict[str, Optional[float]]]]
) -> str:
    shard_ops = {"distribute": "shard_tensor", "redistribute": "reshard", "full_tensor": "full_tensor"}
    lines = [
        f"{size} ranks, CPU, one machine; slowest rank's median of the timed calls after {sizes.warmup} warm-up "
        f"(a barrier before each, columns shuffled every round); {library_line()}. See benchmarks/dtensor.py.",
        "",
        f"## DTensor and shardwise, {sizes.side} x {sizes.side} float32 ({_size(sizes.side**2 * 4)})",
        "",
        "DTensor: `distribute_tensor(t, mesh, [Shard(0)])`, `redistribute` Shard(0) <-> Shard(1), `full_tensor`. "
        "shardwise: `shard_tensor` (dim 0), `reshard` dim 0 <-> 1, `full_tensor`. DTensor on a CPU mesh "
        "redistributes as an all-gather of the whole tensor plus a local copy. `raw allgather` is mpi4py's "
        "`Allgather` of the whole tensor into a new tensor (as DTensor allocates one; with the huge-page advice "
        "the backend gives), `local step` DTensor's copy after it (into a new tensor, as DTensor does): the "
        "first bounds DTensor's full_tensor over any backend from below, their sum its redistribute.",
        "",
        "| operation | "
        + " | ".join(f"{c} ms" for c in COLUMNS)
        + " | mpi4py / gloo | DTensor[mpi4py] / shardwise[mpi] | raw allgather ms | local step ms |",
        "|---|" + "---:|" * (len(COLUMNS) + 4),
    ]
    for op, t in moved.items():
        cells = [_ms(t[c]) for c in COLUMNS]
        cells += [
            f"{t['DTensor[mpi4py]'] / t['DTensor[gloo]']:.2f}",
            f"{t['DTensor[mpi4py]'] / t['shardwise[mpi]']:.2f}",
            _ms(t.get("raw allgather")),
            _ms(t.get("local step")),
        ]
        lines.append(f"| {op} / {shard_ops[op]} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## torch.distributed collectives, gloo vs mpi4py",
        "",
        "Size = the whole tensor: what `broadcast`/`all_reduce`/`reduce`/`send` move, the output of "
        "`all_gather_into_tensor`/`all_gather` and the root's of `gather`, the input of `reduce_scatter_tensor` "
        "and the root's of `scatter`, each side of `all_to_all_single`. Ratio < 1: mpi4py is faster.",
        "",
        "| collective | size | gloo ms | mpi4py ms | mpi4py / gloo |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, nbytes, timed in rows:
        gloo, ours = timed.get("gloo"), timed.get("mpi4py")
        shown = f"{ours / gloo:.2f}" if gloo and ours else "—"
        lines.append(f"| {name} | {_size(nbytes)} | {_ms(gloo)} | {_ms(ours)} | {shown} |")
    checks: list[tuple[str, bool, str]] = []
    for name, nbytes, timed in rows:
        gloo, ours = timed.get("gloo"), timed.get("mpi4py")
        if gloo is None or ours is None:
            continue
        label = f"{name} {_size(nbytes)}" if nbytes else name
        checks.append((f"mpi4py {label} not slower than gloo", ours <= gloo, f"{ours / gloo:.2f}x"))
    for op, t in moved.items():
        ratio: float = t["DTensor[mpi4py]"] / t["shardwise[mpi]"]
        figure = f"{ratio:.2f}x"
        if "local step" in t:
            floor = (t["raw allgather"] + t["local step"]) / t["shardwise[mpi]"]
            figure += f" (floor for any backend: raw allgather + local step = {floor:.2f}x)"
        elif "raw allgather" in t:
            floor = t["raw allgather"] / t["shardwise[mpi]"]
            figure += f" (floor for any backend: raw allgather = {floor:.2f}x)"
        checks.append(
            (
                f"DTensor[mpi4py] {op} within {DTENSOR_RATIO}x of shardwise[mpi] {shard_ops[op]}",
                ratio <= DTENSOR_RATIO,
                figure,
            )
        )
    for op, t in moved.items():
        ratio = t["DTensor[mpi4py]"] / t["DTensor[gloo]"]
        checks.append((f"DTensor[mpi4py] {op} not slower than DTensor[gloo]", ratio <= 1, f"{ratio:.2f}x"))
    lines += ["", "## Targets", ""]
    lines += [f"- [{'x' if ok else ' '}] {what}: {figure}" for what, ok, figure in checks]
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    sizes = QUICK if args.quick else Sizes()
    warnings.filterwarnings("ignore", category=UserWarning)  # DTensor's "falling back with allgather + chunk"
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch 2.13 renames of the *_tensor collectives
    # This script makes torch.distributed's groups itself, so the mpi backend must leave it alone.
    os.environ["SHARDWISE_MPI_TORCH_DIST"] = "0"
    mpi_group = shardwise.init("mpi")
    comm = mpi().COMM_WORLD
    size = comm.Get_size()
    # Makes env:// fall back to MPI under mpiexec (gloo then needs no MASTER_ADDR) and registers "mpi4py".
    shardwise_mpi.register_torch_backend()
    dist.init_process_group("gloo")
    pgs = {"gloo": dist.group.WORLD, "mpi4py": dist.new_group(backend="mpi4py")}
    groups = {"gloo": wrap_process_group(pgs["gloo"]), "mpi": mpi_group}
    moved = movement(comm, pgs, groups, sizes)
    rows = collectives(comm, pgs, sizes)
    if comm.Get_rank() == 0:
        text = report(size, sizes, moved, rows)
        publish(args.out, f"dtensor-{size}ranks.md", text)
    dist.destroy_process_group()
    shardwise.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
