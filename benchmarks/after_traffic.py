"""What the work before a call costs the call: shardwise over MPI right after other traffic (part of ``make bench``).

    .venv/bin/mpiexec -n 4 .venv/bin/python benchmarks/after_traffic.py

``bench.py`` interleaves its columns, so most of shardwise[mpi]'s calls
there follow another column's call: torch._shard's over gloo, shardwise's
over gloo, raw mpi4py's, each moving tens of MiB. Its 4-rank reshard took
twice what the same call takes in a loop of its own. This script asks
which part of that earlier work slows the call, and for how long: it times
shardwise[mpi]'s 64 MiB ``reshard`` (dim 0 <-> 1), ``shard_tensor`` and
``gather`` (to rank 0) right after each of these on every rank, then a
barrier:

* ``nothing``;
* ``torch._shard reshard [gloo]``: torch 2.13's reshard of the same 64 MiB
  over the gloo group (bench.py's torch._shard column);
* ``gloo all_to_all 16 MiB``: one ``all_to_all_single`` over the same gloo
  group, into a new output (traffic through gloo's threads and sockets);
* ``memcpy 16 MiB``: each rank copies 16 MiB between two tensors of its
  own (memory traffic with no communication and no allocation);
* ``read 64 MiB``: each rank sums a 64 MiB tensor (the caches filled with
  other data, nothing written).

and again with 50 ms of sleep (then a barrier) between that work and the
call: whatever the earlier work left behind that wears off within 50 ms
(cold caches, a rank's place on a core) is gone by then. Every (call, work
before, pause) entry runs once a round, all in a new order every round;
each cell is the slowest rank's median. The header says whether the ranks
are bound to cores (``mpiexec -bind-to core``): at 4 ranks on 2 cores the
scheduler's placement is part of what is measured. Rank 0 writes
``after-traffic-<W>ranks.md`` under ``--out`` (default
``benchmarks/results``) and prints it.
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import shardwise_mpi
import torch
import torch.distributed as dist
from _timing import library_line, mpi, publish, script_args
from bench import _size, places
from torch.distributed._shard import _shard_tensor
from torch.distributed._shard.sharding_spec import ChunkShardingSpec as TorchChunkSpec

import shardwise

PAUSES = (0.0, 0.05)


@dataclass(frozen=True)
class Sizes:
    """The full run's sizes, or the smoke run's tiny ones."""

    side: int = 4096  # side x side float32: 64 MiB
    side_traffic: int = 2048  # the memcpy's and all_to_all's 16 MiB
    repeats: int = 15
    warmup: int = 2


SMOKE = Sizes(side=128, side_traffic=64, repeats=2, warmup=1)


class Alternating:
    """A sharded tensor resharded dim 0 <-> 1 on every call (one for shardwise, one for torch._shard)."""

    def __init__(self, tensor: Any, specs: list[Any]) -> None:
        self.tensor, self.specs, self.dim = tensor, specs, 0

    def __call__(self) -> None:
        self.dim ^= 1
        self.tensor.reshard(self.specs[self.dim])


def before_calls(dense: torch.Tensor, size: int, sizes: Sizes) -> dict[str, Callable[[], Any]]:
    """The work run on every rank before a timed call, by name."""
    torch_specs = [TorchChunkSpec(dim=d, placements=places(size)) for d in (0, 1)]
    torch_reshard = Alternating(_shard_tensor(dense, torch_specs[0], src_rank=0), torch_specs)
    traffic = torch.randn(sizes.side_traffic, sizes.side_traffic)
    target = torch.empty_like(traffic)
    big = torch.randn(sizes.side, sizes.side)
    moved, read = _size(traffic.numel() * traffic.element_size()), _size(big.numel() * big.element_size())
    return {
        "nothing": lambda: None,
        "torch._shard reshard [gloo]": torch_reshard,
        f"gloo all_to_all {moved}": lambda: dist.all_to_all_single(torch.empty_like(traffic), traffic),
        f"memcpy {moved}": lambda: target.copy_(traffic),
        f"read {read}": lambda: big.sum(),
    }


def shardwise_calls(group: Any, dense: torch.Tensor, size: int) -> dict[str, Callable[[], Any]]:
    """shardwise[mpi]'s three calls of bench.py's movement rows."""
    specs = [shardwise.ChunkShardingSpec(dim=d, placements=places(size)) for d in (0, 1)]
    reshard = Alternating(shardwise.shard_tensor(dense, specs[0], src_rank=0, process_group=group), specs)
    kept = shardwise.shard_tensor(dense, specs[0], src_rank=0, process_group=group)
    out = torch.empty_like(dense) if group.rank == 0 else None
    return {
        "reshard": reshard,
        "shard_tensor": lambda: shardwise.shard_tensor(dense, specs[0], src_rank=0, process_group=group),
        "gather": lambda: kept.gather(dst=0, out=out),
    }


def measure(
    comm: Any, calls: dict[str, Callable[[], Any]], before: dict[str, Callable[[], Any]], sizes: Sizes
) -> dict[tuple[str, str, float], float]:
    """Milliseconds of each (call, work before, pause): the slowest rank's median, entries interleaved."""
    keys = [(c, b, p) for c in calls for b in before for p in PAUSES]
    for _ in range(sizes.warmup):
        for c in calls:
            for b in before:
                comm.Barrier()
                before[b]()
                comm.Barrier()
                calls[c]()
    times: dict[tuple[str, str, float], list[float]] = {k: [] for k in keys}
    for i in range(sizes.repeats):
        random.Random(i).shuffle(keys)  # the same seed on every rank: the same order
        for c, b, pause in keys:
            comm.Barrier()
            before[b]()
            comm.Barrier()
            if pause:
                time.sleep(pause)
                comm.Barrier()
            start = time.perf_counter()
            calls[c]()
            times[(c, b, pause)].append(time.perf_counter() - start)
    return {k: comm.allreduce(statistics.median(v), op=mpi().MAX) * 1e3 for k, v in times.items()}


def report(ms: dict[tuple[str, str, float], float], calls: list[str], before: list[str], size: int,
           sizes: Sizes, bound: bool, total: str) -> str:
    """The markdown table: ms after each work, and the ratio to the same call after nothing."""
    lines = [
        f"shardwise[mpi] right after other work, {size} ranks, {total} calls: the slowest rank's median of "
        f"{sizes.repeats} after {sizes.warmup} warm-up, every entry interleaved in a new order each round; "
        f"ranks {'bound to one core each (mpiexec -bind-to core)' if bound else 'not bound to cores'}; "
        f"{library_line()}.",
        "",
        "| call | work before | ms right after | x after nothing | ms 50 ms later | x after nothing |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for c in calls:
        base = {p: ms[(c, "nothing", p)] for p in PAUSES}
        for b in before:
            now, later = ms[(c, b, PAUSES[0])], ms[(c, b, PAUSES[1])]
            lines.append(f"| {c} | {b} | {now:.2f} | {now / base[PAUSES[0]]:.2f} | {later:.2f} | "
                         f"{later / base[PAUSES[1]]:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = script_args(__doc__ or "", argv)
    sizes = SMOKE if args.smoke else Sizes()
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch._shard's deprecation, on every call
    # This script makes torch.distributed's default group itself (gloo, below).
    os.environ["SHARDWISE_MPI_TORCH_DIST"] = "0"
    group = shardwise.init("mpi")
    comm = mpi().COMM_WORLD
    size = comm.Get_size()
    shardwise_mpi.register_torch_backend()  # env:// rendezvous through MPI: no MASTER_ADDR needed
    dist.init_process_group("gloo")
    dense = torch.randn(sizes.side, sizes.side, generator=torch.Generator().manual_seed(7))
    calls = shardwise_calls(group, dense, size)
    before = before_calls(dense, size, sizes)
    ms = measure(comm, calls, before, sizes)
    bound = all(comm.allgather(len(os.sched_getaffinity(0)) == 1))
    if group.rank == 0:
        text = report(ms, list(calls), list(before), size, sizes, bound, _size(dense.numel() * dense.element_size()))
        publish(args.out, f"after-traffic-{size}ranks.md", text)
    dist.destroy_process_group()
    shardwise.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
