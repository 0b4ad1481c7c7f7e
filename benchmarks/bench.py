"""``make bench``: torch 2.13's ``torch.distributed._shard`` against shardwise, side by side in one run.

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/bench.py            # make bench
    .venv/bin/mpiexec -n 4 .venv/bin/python benchmarks/bench.py            # make bench-core RANKS=4
    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/bench.py --smoke --out /tmp/b   # tiny sizes

Columns: torch._shard over a torch gloo process group, shardwise over the same
gloo group (``wrap_process_group``) and shardwise over MPI
(``shardwise.init("mpi")``), all with their defaults (shardwise verifies each
collective's arguments across ranks).

Rows:

* data movement of a 64 MiB float32 tensor (4096 x 4096): scatter from rank 0
  (``shard_tensor`` / ``_shard_tensor``, chunked on dim 0); reshard between
  dim 0 and dim 1 chunks, alternating so that every call moves data; gather
  to rank 0; and ``full_tensor`` (shardwise only: torch._shard has none);
* sharded ``F.embedding`` and ``F.embedding_bag(mode="sum")``, V = 200,000 x
  D = 128, 4096 x 32 ids per rank, row-wise and column-wise, forward and
  forward + backward (see ``embedding.py``, whose cases these are).

Before timing, every embedding case's outputs and gradients are compared with
torch._shard's and the dense op's, and every data-movement result with the
dense tensor, so no column can compute something else.

The floor: the bytes that must leave or reach the busiest rank for the
workload (below), divided by the memcpy bandwidth measured in the same run
(all ranks copying 64 MiB at once, as they share the memory bus during the
collectives). Between processes on one machine every byte that moves is
copied at least once, so no implementation can beat it.

* scatter / gather: rank 0 sends / receives the other ranks' shares,
  ``(W - 1) / W`` of the tensor;
* reshard: each rank sends the part of its shard that it does not keep,
  ``(W - 1) / W**2`` of the tensor;
* full_tensor: each rank receives ``(W - 1) / W`` of the tensor;
* embedding, from the ids actually drawn: row-wise, the distinct ids a rank
  needs from other ranks (8 bytes each out, a D-float row back); column-wise,
  all its distinct ids out and the other ranks' column slices of them back;
  bags: the smaller of those rows and one pooled partial sum per bag. The
  backward moves the same bytes again the other way.

The bound, for data movement: every byte of the results (the new shards,
``out``) is written once by some rank, and the ranks share one memory bus,
so no rank can finish before its even share of those bytes is copied: the
larger of the floor and ``written / W`` bytes at the same memcpy bandwidth.
A reshard writes the whole tensor (the rows a rank keeps are copied into its
new shard too), so at 2 ranks its bound is twice its floor; ``full_tensor``
writes the tensor on every rank. A floor target below the bound is out of
reach by this measurement, and the checklist says so beside it.

Between ranks on one host both shardwise columns move data by cross-memory
attach (``shardwise._comm.box_moves``: one copy straight from the sender's
shard into the receiver's, by whichever end has the time);
``SHARDWISE_LOCAL_COPY=0`` turns
that off. The header also gives the bare ``process_vm_readv`` bandwidth with
every rank reading at once, which bounds that path as memcpy bounds any.

Each cell is the slowest rank's median of ``--repeats`` calls after warm-up
ones; a barrier precedes each call and the order of the columns is shuffled
every round. Peak RSS is the highest resident set of any rank during one
extra call of the cell (``VmHWM`` after resetting it); ``extra`` is the most
memory the call added: that peak minus the resident set just before, or,
if larger, the most bytes of shardwise's large buffers in use at once during
the call minus those before (shardwise reuses freed buffers, which RSS does
not see; see ``_timing.peak_memory``). Rank 0 writes
``bench-<W>ranks.md`` and ``.png`` under ``--out`` (default
``benchmarks/results``) and prints the table and the targets.

The chart (``_chart.py``) shows each workload's speedup over torch._shard:
torch._shard over gloo as 1, shardwise over the same gloo group and over
MPI beside it, each bar's ratio written on it, whiskers from the column's
fastest to its slowest call, and "n/a" where torch._shard has no such call.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import shardwise_mpi
import torch
import torch.distributed as dist
from _chart import speedup_chart
from _timing import Spread, library_line, mpi, peak_memory, script_args, time_spread
from embedding import OPS, check, forward, forward_backward, make_weights
from torch.distributed._shard import _shard_tensor
from torch.distributed._shard.sharding_spec import ChunkShardingSpec as TorchChunkSpec

import shardwise
from shardwise.torch_group import wrap_process_group

COLUMNS = ("torch", "gloo", "mpi")
MIB = 1 << 20
#: examples/: the progress display the demo uses (a bar on a terminal, a few plain lines in a log).
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@dataclass(frozen=True)
class Sizes:
    """The workload sizes: the full run's, or the smoke run's tiny ones."""

    side: int = 4096  # data movement: side x side float32 (64 MiB)
    vocab: int = 200_000
    dim: int = 128
    batch: int = 4096
    bag: int = 32
    repeats: int = 9
    warmup: int = 2


SMOKE = Sizes(side=128, vocab=2000, dim=16, batch=64, bag=4, repeats=2, warmup=1)


@dataclass
class Row:
    """One benchmark row: its name, the floor's bytes, and per column the times and memory."""

    name: str
    floor_bytes: float
    #: Bytes the busiest rank must copy at the least, however the work is shared (see the module docstring).
    bound_bytes: float = 0.0
    spread_ms: dict[str, Spread] = field(default_factory=dict)
    peak_mib: dict[str, float] = field(default_factory=dict)
    extra_mib: dict[str, float] = field(default_factory=dict)

    @property
    def ms(self) -> dict[str, float]:
        """Per column, the median milliseconds per call (the table's figure)."""
        return {col: spread.median for col, spread in self.spread_ms.items()}


def places(size: int) -> list[str]:
    return [f"rank:{r}/cpu" for r in range(size)]


def memcpy_bandwidth(comm: Any, nbytes: int, repeats: int) -> float:
    """Bytes per second of one ``copy_`` of ``nbytes`` while every rank copies (the slowest rank's median)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(max(repeats, 5)):
        comm.Barrier()
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return nbytes / comm.allreduce(statistics.median(times), op=mpi().MAX)


def cma_bandwidth(comm: Any, nbytes: int, repeats: int) -> float:
    """Bytes per second of one ``process_vm_readv`` of ``nbytes`` from the next rank, every rank reading at once.

    What shardwise's one-copy path between ranks on one host costs at best
    (``shardwise._comm.local_copy``, reading by ``shardwise._comm.cross_memory``):
    the source is a huge-page buffer, as shardwise's shards are. 0 where the
    kernel refuses the read.
    """
    from shardwise._comm import buffers, cross_memory

    if cross_memory.probe() is not None:
        return 0.0
    src = buffers.empty((nbytes,), torch.uint8, torch.device("cpu")).fill_(1)
    dst = buffers.empty((nbytes,), torch.uint8, torch.device("cpu")).fill_(0)
    rank, size = comm.Get_rank(), comm.Get_size()
    peer = comm.allgather((os.getpid(), src.data_ptr()))[(rank + 1) % size]
    runs = cross_memory.runs([dst.data_ptr()], [peer[1]], [nbytes])
    times = []
    for _ in range(max(repeats, 5)):
        comm.Barrier()
        start = time.perf_counter()
        cross_memory.read_runs(peer[0], runs)
        times.append(time.perf_counter() - start)
    comm.Barrier()
    return nbytes / comm.allreduce(statistics.median(times), op=mpi().MAX)


class Movement:
    """The data-movement calls of one column, each holding its own state."""

    def __init__(self, label: str, group: Any, dense: torch.Tensor, rank: int, size: int) -> None:
        self.label, self.group, self.dense, self.rank = label, group, dense, rank
        self.specs = [self._spec(dim, size) for dim in (0, 1)]
        self.st = self.scatter()
        self.dim = 0
        self.out = torch.empty_like(dense) if rank == 0 else None

    def _spec(self, dim: int, size: int) -> Any:
        if self.label == "torch":
            return TorchChunkSpec(dim=dim, placements=places(size))
        return shardwise.ChunkShardingSpec(dim=dim, placements=places(size))

    def scatter(self) -> Any:
        if self.label == "torch":
            return _shard_tensor(self.dense, self.specs[0], src_rank=0)
        return shardwise.shard_tensor(self.dense, self.specs[0], src_rank=0, process_group=self.group)

    def reshard(self) -> Any:
        self.dim = 1 - self.dim
        return self.st.reshard(self.specs[self.dim])

    def gather(self) -> None:
        self.st.gather(dst=0, out=self.out)

    def full_tensor(self) -> torch.Tensor:
        result: torch.Tensor = self.st.full_tensor()
        return result

    def verify(self) -> list[str]:
        """Untimed: the scatter, both reshards, the gather and full_tensor give the dense tensor's values."""
        problems = []
        st = self.scatter()
        self.st = st
        for dim in (1, 0):
            self.reshard()
            local = self.st.local_shards()[0]
            offsets, sizes = local.metadata.shard_offsets, local.metadata.shard_sizes
            want = self.dense[offsets[0]:offsets[0] + sizes[0], offsets[1]:offsets[1] + sizes[1]]
            if not torch.equal(local.tensor, want):
                problems.append(f"{self.label}: reshard to dim {dim} gave other values")
        self.gather()
        if self.out is not None and not torch.equal(self.out, self.dense):
            problems.append(f"{self.label}: gather gave other values")
        if self.label != "torch" and not torch.equal(self.full_tensor(), self.dense):
            problems.append(f"{self.label}: full_tensor gave other values")
        return problems


class RawMPI:
    """The same transfers in raw mpi4py on preallocated buffers: what MPI itself costs, for reference.

    No allocation, no packing, no checks: scatter is one ``Scatterv`` of
    dim-0 chunks, gather one ``Gatherv``, full_tensor one ``Allgatherv``, and
    reshard one ``Alltoallv`` of the bytes a reshard must move (already
    packed).
    """

    def __init__(self, comm: Any, dense: torch.Tensor) -> None:
        self.comm, self.dense = comm, dense
        rank, size = comm.Get_rank(), comm.Get_size()
        rows = [len(c) for c in torch.arange(dense.shape[0]).chunk(size)]
        self.counts = [r * dense.shape[1] for r in rows]
        self.displs = [sum(self.counts[:r]) for r in range(size)]
        self.chunk = torch.empty(self.counts[rank])
        self.whole = torch.empty_like(dense)
        # Reshard: each rank keeps 1/size of its chunk and swaps the rest evenly.
        moved = self.counts[rank] // size
        self.a2a_counts = [0 if r == rank else moved for r in range(size)]
        self.a2a_displs = [sum(self.a2a_counts[:r]) for r in range(size)]
        self.send = torch.ones(sum(self.a2a_counts))
        self.recv = torch.empty(sum(self.a2a_counts))

    def _v(self, t: torch.Tensor, counts: list[int], displs: list[int]) -> list[Any]:
        return [t.numpy(), counts, displs, mpi().FLOAT]

    def scatter(self) -> None:
        src = self._v(self.dense.reshape(-1), self.counts, self.displs) if self.comm.Get_rank() == 0 else None
        self.comm.Scatterv(src, self.chunk.numpy(), root=0)

    def reshard(self) -> None:
        self.comm.Alltoallv(self._v(self.send, self.a2a_counts, self.a2a_displs),
                            self._v(self.recv, self.a2a_counts, self.a2a_displs))

    def gather(self) -> None:
        dst = self._v(self.whole.reshape(-1), self.counts, self.displs) if self.comm.Get_rank() == 0 else None
        self.comm.Gatherv(self.chunk.numpy(), dst, root=0)

    def full_tensor(self) -> None:
        self.comm.Allgatherv(self.chunk.numpy(), self._v(self.whole.reshape(-1), self.counts, self.displs))


def movement_rows(comm: Any, groups: dict[str, Any], sizes: Sizes, bar: Any) -> list[Row]:
    rank, size = comm.Get_rank(), comm.Get_size()
    dense = torch.randn(sizes.side, sizes.side, generator=torch.Generator().manual_seed(7))
    total = dense.numel() * dense.element_size()
    movers: dict[str, Any] = {label: Movement(label, groups.get(label), dense, rank, size) for label in COLUMNS}
    problems = [p for mover in movers.values() for p in mover.verify()]
    _raise_if_any(comm, problems)
    movers["raw"] = RawMPI(comm, dense)
    share = (size - 1) / size
    # (name, floor bytes, bytes every rank together writes into results, the call)
    cases: list[tuple[str, float, float, Callable[[Any], Callable[[], Any]]]] = [
        ("scatter", share * total, total, lambda m: m.scatter),
        ("reshard dim 0 <-> 1", share / size * total, total, lambda m: m.reshard),
        ("gather to rank 0", share * total, total, lambda m: m.gather),
        ("full_tensor", share * total, size * total, lambda m: m.full_tensor),
    ]
    rows = []
    for name, floor_bytes, written, pick in cases:
        label = f"{name} {_size(total)}"
        calls = {col: pick(m) for col, m in movers.items() if not (col == "torch" and name == "full_tensor")}
        row = Row(label, floor_bytes, max(floor_bytes, written / size))
        rows.append(measure(comm, row, calls, sizes, bar))
    return rows


def embedding_rows(comm: Any, groups: dict[str, Any], sizes: Sizes, bar: Any) -> list[Row]:
    rank, size = comm.Get_rank(), comm.Get_size()
    dense = torch.randn(sizes.vocab, sizes.dim, generator=torch.Generator().manual_seed(0))
    every = [torch.randint(0, sizes.vocab, (sizes.batch, sizes.bag), generator=torch.Generator().manual_seed(1000 + r))
             for r in range(size)]
    ids = every[rank]
    rows = []
    for dim, sharding in ((0, "row-wise"), (1, "column-wise")):
        weights = make_weights(dense, dim, size, groups)
        for op_name, op in OPS.items():
            check(comm, f"{op_name} {sharding}", op, ids, dense, weights)
            moved = embedding_bytes(every, dim, op_name, sizes)
            for mode, make in (("fwd", forward), ("fwd+bwd", forward_backward)):
                calls = {col: make(op, ids, weights[col]) for col in COLUMNS}
                row = Row(f"{op_name} {sharding} {mode}", moved * (2 if mode == "fwd+bwd" else 1))
                rows.append(measure(comm, row, calls, sizes, bar))
        del weights
    return rows


def embedding_bytes(every: list[torch.Tensor], dim: int, op_name: str, sizes: Sizes) -> float:
    """The floor's bytes for one forward pass at the busiest rank (see the module docstring)."""
    size, row_bytes = len(every), sizes.dim * 4
    rows_per_rank = -(-sizes.vocab // size)
    busiest = 0.0
    for rank, ids in enumerate(every):
        distinct = torch.unique(ids)
        if dim == 0:
            foreign = int(((distinct // rows_per_rank) != rank).sum())
            moved = foreign * (8 + row_bytes)
            if op_name != "embedding":
                moved = min(moved, (size - 1) * sizes.batch * row_bytes)
        else:
            moved = distinct.numel() * (8 + row_bytes * (size - 1) / size)
            if op_name != "embedding":
                moved = min(moved, sizes.batch * row_bytes * (size - 1) / size)
        busiest = max(busiest, moved)
    return busiest


def measure(comm: Any, row: Row, calls: dict[str, Callable[[], Any]], sizes: Sizes, bar: Any) -> Row:
    row.spread_ms = {col: t.scaled(1e3) for col, t in time_spread(comm, calls, sizes.repeats, sizes.warmup).items()}
    for col, fn in calls.items():
        comm.Barrier()
        peak, extra = peak_memory(fn)
        row.peak_mib[col] = comm.allreduce(peak, op=mpi().MAX) / MIB
        row.extra_mib[col] = comm.allreduce(extra, op=mpi().MAX) / MIB
    bar.set_postfix_str(f"last: {row.name}", refresh=False)
    bar.update(1)
    return row


def progress_bar(rows: int, disable: bool) -> Any:
    """The demo's progress display over ``rows`` rows (examples/_progress.py), on stderr.

    Imported from examples/ when needed rather than copied here, so that
    the benchmarks and the demo show progress, and write logs, alike.
    """
    if str(EXAMPLES) not in sys.path:
        sys.path.append(str(EXAMPLES))
    from _progress import progress

    return progress(rows, "bench", "row", disable=disable)


def _raise_if_any(comm: Any, problems: list[str]) -> None:
    reports = comm.allgather(problems)
    if any(reports):
        raise AssertionError("results differ:\n" + "\n".join(f"rank {r}: {p}" for r, ps in enumerate(reports)
                                                             for p in ps))


def table(rows: list[Row], size: int, bandwidth: float, sizes: Sizes, cma: float = 0.0) -> str:
    lines = [
        f"{size} ranks, CPU; median of {sizes.repeats} calls after {sizes.warmup} warm-up, slowest rank's median; "
        f"memcpy bandwidth {bandwidth / 1e9:.2f} GB/s (all ranks copying); cross-memory attach "
        f"(process_vm_readv from the next rank's huge-page buffer, all ranks reading) {cma / 1e9:.2f} GB/s; "
        f"{library_line()}.",
        "Speedup = torch._shard ms / shardwise ms (> 1: shardwise is faster). Floor = bytes that must reach or "
        "leave the busiest rank / memcpy bandwidth; `x floor` = ms / floor ms. Bound = the larger of the floor and "
        "the bytes all ranks write into the results, shared evenly, / memcpy bandwidth (every result byte is written "
        "once, the ranks sharing the memory bus), as a multiple of the floor. Peak = highest RSS of any rank "
        "during one call; extra = memory the call added (RSS, or shardwise's buffers in use if more). "
        "Raw mpi4py = the same transfer with preallocated buffers and no packing (what MPI itself costs). "
        "See benchmarks/bench.py.",
        "",
        "| workload | torch._shard gloo ms | shardwise gloo ms | speedup | shardwise mpi ms | speedup | floor ms "
        "| mpi x floor | bound x floor | raw mpi4py ms | peak RSS MiB (torch / gloo / mpi) "
        "| extra MiB (torch / gloo / mpi) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        floor_ms = row.floor_bytes / bandwidth * 1e3
        torch_ms = row.ms.get("torch")
        cells = [_fmt(torch_ms)]
        for col in ("gloo", "mpi"):
            cells += [_fmt(row.ms[col]), "—" if torch_ms is None else f"{torch_ms / row.ms[col]:.2f}"]
        cells += [f"{floor_ms:.2f}", f"{row.ms['mpi'] / floor_ms:.2f}" if floor_ms else "—"]
        cells += [f"{row.bound_bytes / row.floor_bytes:.2f}" if row.bound_bytes else "—", _fmt(row.ms.get("raw"), 2)]
        cells.append(" / ".join(_fmt(row.peak_mib.get(c), 0) for c in COLUMNS))
        cells.append(" / ".join(_fmt(row.extra_mib.get(c), 0) for c in COLUMNS))
        lines.append(f"| {row.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _size(nbytes: int) -> str:
    return f"{nbytes / MIB:g} MiB" if nbytes >= MIB else f"{nbytes / 1024:g} KiB"


def _fmt(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def targets(rows: list[Row], bandwidth: float, shard_mib: float) -> list[tuple[str, bool, str]]:
    """The issue's performance targets, each with whether it holds and the figures behind it."""
    found = []
    moving = [r for r in rows if r.name.split()[0] in ("scatter", "reshard", "gather")]
    for row in moving:
        ratio = row.ms["torch"] / row.ms["mpi"]
        found.append((f"mpi >= 5x torch._shard: {row.name}", ratio >= 5, f"{ratio:.2f}x"))
    for row in rows:
        if "fwd+bwd" in row.name:
            ratio = row.ms["torch"] / row.ms["mpi"]
            found.append((f"mpi >= 3x torch._shard: {row.name}", ratio >= 3, f"{ratio:.2f}x"))
    for row in rows:
        if "torch" in row.ms:
            ratio = row.ms["torch"] / row.ms["gloo"]
            found.append((f"gloo not slower than torch._shard: {row.name}", ratio >= 1, f"{ratio:.2f}x"))
    for row in rows:
        if row.name.startswith("embedding row-wise fwd") and "bwd" not in row.name:
            ratio = row.ms["torch"] / row.ms["gloo"]
            found.append((f"gloo >= 2x torch._shard: {row.name}", ratio >= 2, f"{ratio:.2f}x"))
    for row in moving:
        floor_ms = row.floor_bytes / bandwidth * 1e3
        ratio = row.ms["mpi"] / floor_ms
        over = row.bound_bytes / row.floor_bytes
        bound = f"; the bound: {over:.2f}x floor" if over > 1 else ""
        found.append((f"mpi within 1.5x of the floor: {row.name}", ratio <= 1.5, f"{ratio:.2f}x floor{bound}"))
    for row in moving:
        if row.ms.get("raw"):
            ratio = row.ms["raw"] / row.ms["mpi"]
            found.append((f"mpi >= 1.5x faster than raw mpi4py: {row.name}", ratio >= 1.5, f"{ratio:.2f}x"))
    for row in rows:
        if row.name.startswith("reshard"):
            worst = max(row.extra_mib["gloo"], row.extra_mib["mpi"]) / shard_mib
            found.append(("reshard peak extra memory <= 2x the local shard", worst <= 2,
                          f"{worst:.2f}x ({shard_mib:.0f} MiB shard)"))
    return found


def chart(rows: list[Row], size: int, sizes: Sizes, path: Path) -> bool:
    """Draw the speedups over torch._shard (see ``_chart``) into the PNG ``path``; False without matplotlib."""
    workloads = [(row.name, {col: row.spread_ms[col] for col in COLUMNS if col in row.spread_ms}) for row in rows]
    try:
        fig = speedup_chart(
            workloads,
            f"Speedup over torch._shard, {size} ranks on CPU (higher is better)",
            f"bars: median of {sizes.repeats} calls (slowest rank), torch._shard over gloo = 1; whiskers: fastest "
            "to slowest call against torch._shard's median; n/a: torch._shard has no such call",
        )
    except ImportError:
        return False
    fig.savefig(path, dpi=110)
    return True


def main(argv: list[str] | None = None) -> int:
    args = script_args(__doc__, argv)
    sizes = SMOKE if args.smoke else Sizes()
    # torch._shard warns on every call that it is deprecated in favour of DTensor.
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
    groups = {"gloo": wrap_process_group(dist.group.WORLD), "mpi": mpi_group}
    bandwidth = memcpy_bandwidth(comm, sizes.side * sizes.side * 4, sizes.repeats)
    cma = cma_bandwidth(comm, sizes.side * sizes.side * 4 // size, sizes.repeats)
    bar = progress_bar(4 + 8, disable=rank != 0)
    rows = movement_rows(comm, groups, sizes, bar) + embedding_rows(comm, groups, sizes, bar)
    bar.close()
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        text = table(rows, size, bandwidth, sizes, cma)
        shard_mib = sizes.side * sizes.side * 4 / size / MIB
        checks = targets(rows, bandwidth, shard_mib)
        text += "\nTargets:\n\n" + "\n".join(f"- [{'x' if ok else ' '}] {what}: {figure}"
                                              for what, ok, figure in checks) + "\n"
        (args.out / f"bench-{size}ranks.md").write_text(text)
        picture = args.out / f"bench-{size}ranks.png"
        print(text)
        if chart(rows, size, sizes, picture):
            print(f"chart: {picture}")
        else:
            print("chart: not drawn, matplotlib is not installed (`make install` installs it)")
    dist.destroy_process_group()
    shardwise.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
