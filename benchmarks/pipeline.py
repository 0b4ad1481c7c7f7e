"""The demo's training, blocking loop vs SparseDistPipeline, side by side (`make bench-pipeline`).

Trains the demo's DLRM model (examples/dlrm.py: 26 Criteo-sized tables, the
planner's plan, RowWiseAdagrad, batches made as the demo makes them) on the
ranks of one ``mpiexec`` launch, over MPI and over gloo, in two ways from the
same initial weights:

- **blocking**: the demo's plain loop (make the batch, forward, backward,
  optimizers);
- **pipelined**: the same steps through ``SparseDistPipeline`` — the next
  batch is made on a background thread, and its ids travel to the tables'
  owners (the collection's input exchange, an asynchronous ``all_to_all``)
  while this batch runs its dense layers, backward and optimizer steps.

Each round trains ``steps`` steps of each loop, in an order that alternates
between rounds, so drift hits both alike; the figure is the median over the
rounds of the slowest rank's steps/s. Every round also checks that both loops
produced bit-for-bit the same losses. Also measured, to show what bounds the
gain: the time of each phase of a blocking step (making the batch, the
collection's forward, the rest), since only the batch making and the input
exchange can be hidden. Writes benchmarks/results/pipeline-<N>ranks.md.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

import shardwise_mpi
import torch
import torch.distributed as dist
from _timing import library_line, mpi, publish, script_args
from shardwise_embedding import RowWiseAdagrad, SparseDistPipeline, shard_collection

import shardwise
from shardwise.torch_group import wrap_process_group

#: examples/: the demo's model, data and configuration.
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.append(str(EXAMPLES))

from _dlrm_data import ClickLog, criteo_tables, feature_names  # noqa: E402
from _dlrm_model import batch_loss, build_collection, build_model, sum_dense_grads  # noqa: E402
from _training import rank_rows  # noqa: E402
from dlrm import FULL, TABLE_OPTIMIZERS, TINY, Config, History, make_plan  # noqa: E402

TARGET = 1.2  # the issue's: pipelined steps/s over blocking, 2 ranks


@dataclass(frozen=True)
class Sizes:
    config: Config
    steps: int  # per loop and round
    rounds: int


FULL_SIZES = Sizes(FULL, steps=12, rounds=5)
SMOKE = Sizes(TINY, steps=3, rounds=2)


class Trainer:
    """The demo's model and optimizers over one group, rebuilt from the same weights for each run."""

    def __init__(self, group: shardwise.Group, cfg: Config, plan: Any) -> None:
        self.group, self.cfg, self.plan = group, cfg, plan
        self.tables = criteo_tables(cfg.max_rows, cfg.dim)
        self.data = ClickLog(self.tables, seed=0)
        self.rows = rank_rows(cfg.batch, group.rank, group.size)
        self.keys = feature_names()

    def batches(self, first: int, steps: int) -> Iterable[tuple[Any, Any]]:
        for step in range(first, first + steps):
            local = self.data.global_batch(step, self.cfg.batch)[self.rows]
            yield local, local.features(self.keys)

    def run(self, steps: int, pipelined: bool, phases: Optional[dict[str, float]] = None) -> tuple[float, list[float]]:
        """Seconds for ``steps`` steps from the initial weights, and the losses."""
        cfg, group = self.cfg, self.group
        sharded = shard_collection(build_collection(self.tables, seed=0), self.plan, group)
        model = build_model(sharded, self.tables, cfg.bottom, cfg.top, seed=0)
        optimizers = (
            RowWiseAdagrad(sharded.parameters(), lr=cfg.table_lr, eps=cfg.eps),
            torch.optim.Adagrad(model.dense_parameters(), lr=cfg.mlp_lr, eps=cfg.eps),
        )
        batches = self.batches(0, steps)
        if pipelined:
            batches = SparseDistPipeline(sharded, batches, features=lambda b: b[1])
        losses = []
        clock = time.perf_counter
        entered = [0.0]
        if phases is not None:
            # The collection's forward is timed from inside the model's, by hooks around it.
            sharded.register_forward_pre_hook(lambda *_: entered.__setitem__(0, clock()))
            sharded.register_forward_hook(
                lambda *_: phases.__setitem__("collection forward", phases["collection forward"] + clock() - entered[0])
            )
        group.barrier()
        began = mark = clock()
        cpu = time.process_time()  # every thread of this rank: how busy its cores were
        for local, features in batches:
            if phases is not None:
                phases["make the batch"] += clock() - mark
                mark = clock()
                before = phases["collection forward"]
            loss = batch_loss(model(local.dense, features), local.labels, cfg.batch)
            for opt in optimizers:
                opt.zero_grad()
            loss.backward()
            losses.append(sum_dense_grads(model, loss, group))
            for opt in optimizers:
                opt.step()
            if phases is not None:
                inside = phases["collection forward"] - before
                phases["dense forward, backward, optimizers"] += clock() - mark - inside
                mark = clock()
        group.barrier()
        wall = clock() - began
        if phases is not None:
            phases["cpu"] = (time.process_time() - cpu) / wall
        return wall, losses


def measure(comm: Any, trainer: Trainer, sizes: Sizes) -> dict[str, Any]:
    rates: dict[str, list[float]] = {"blocking": [], "pipelined": []}
    same = True
    for r in range(sizes.rounds):
        order = ("blocking", "pipelined") if r % 2 == 0 else ("pipelined", "blocking")
        losses: dict[str, list[float]] = {}
        for name in order:
            seconds, losses[name] = trainer.run(sizes.steps, pipelined=name == "pipelined")
            slowest = comm.allreduce(seconds, op=mpi().MAX)
            rates[name].append(sizes.steps / slowest)
        same = same and losses["blocking"] == losses["pipelined"]
    phases = dict.fromkeys(("make the batch", "collection forward", "dense forward, backward, optimizers"), 0.0)
    trainer.run(sizes.steps, pipelined=False, phases=phases)
    busy = comm.allreduce(phases.pop("cpu"), op=mpi().MIN)
    worst = {k: comm.allreduce(v / sizes.steps, op=mpi().MAX) for k, v in phases.items()}
    return {
        "blocking": statistics.median(rates["blocking"]),
        "pipelined": statistics.median(rates["pipelined"]),
        "same": comm.allreduce(same, op=mpi().LAND),
        "phases": worst,
        "busy": busy,
    }


def report(found: dict[str, dict[str, Any]], size: int, sizes: Sizes) -> str:
    cfg = sizes.config
    lines = [
        f"# The demo's training: blocking loop vs SparseDistPipeline, {size} ranks",
        "",
        f"`mpiexec -n {size} python benchmarks/pipeline.py`: the demo's model ({cfg.name}: 26 tables, batch "
        f"{cfg.batch}, the planner's plan), {sizes.steps} steps per loop and round, {sizes.rounds} rounds "
        "alternating the order; median over rounds of the slowest rank's steps/s. " + library_line(),
        "",
        "| backend | blocking steps/s | pipelined steps/s | ratio | losses bit-identical |",
        "|---|---:|---:|---:|---|",
    ]
    for backend, f in found.items():
        ratio = f["pipelined"] / f["blocking"]
        lines.append(
            f"| {backend} | {f['blocking']:.2f} | {f['pipelined']:.2f} | {ratio:.2f} | {'yes' if f['same'] else 'NO'} |"
        )
    lines += ["", "Where a blocking step's time goes (ms per step, slowest rank):", ""]
    names = list(next(iter(found.values()))["phases"])
    lines += [
        "| backend | " + " | ".join(names) + " | hideable share | CPU busy (least busy rank) |",
        "|---|" + "---:|" * (len(names) + 2),
    ]
    for backend, f in found.items():
        ph = f["phases"]
        total = sum(ph.values())
        hideable = ph["make the batch"] / total if total else 0.0
        cells = " | ".join(f"{v * 1e3:.1f}" for v in ph.values())
        lines.append(f"| {backend} | {cells} | {hideable:.0%} | {f['busy']:.0%} |")
    lines += [
        "",
        "Only the batch making and the input exchange (a part of the collection's forward) can run beside the "
        "step, and only on a core that would otherwise wait. CPU busy is the rank's CPU time (every thread) over "
        "the wall time of the blocking loop: with one rank per core and the ranks busy most of the step, the "
        "background work has no idle core to run on, and the pipeline can gain at most 1 / busy (over MPI, whose "
        "waits spin, busy counts the waiting too).",
        "",
        "Targets:",
        "",
    ]
    for backend, f in found.items():
        ratio = f["pipelined"] / f["blocking"]
        ok = ratio >= TARGET and f["same"]
        lines.append(
            f"- [{'x' if ok else ' '}] pipelined ≥ {TARGET}× the blocking loop's steps/s, same losses ({backend}): "
            f"×{ratio:.2f}, losses {'bit-identical' if f['same'] else 'DIFFER'}"
        )
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    args = script_args(__doc__, argv)
    sizes = SMOKE if args.smoke else FULL_SIZES
    warnings.filterwarnings("ignore", category=FutureWarning)
    # This script makes torch.distributed's default group itself (gloo, below).
    os.environ["SHARDWISE_MPI_TORCH_DIST"] = "0"
    mpi_group = shardwise.init("mpi")
    comm = mpi().COMM_WORLD
    size = comm.Get_size()
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // size))
    shardwise_mpi.register_torch_backend()
    dist.init_process_group("gloo")
    world = dist.group.WORLD
    assert world is not None
    groups: dict[str, Any] = {"mpi": mpi_group, "gloo": wrap_process_group(world)}
    cfg = sizes.config
    history = History(config=cfg.name, seed=0, batch=cfg.batch, table_optimizer=TABLE_OPTIMIZERS[0], losses=[], runs=[])
    tables = criteo_tables(cfg.max_rows, cfg.dim)
    plan = make_plan(build_collection(tables, seed=0), mpi_group, history, cfg.memory_budget_mib)
    found = {name: measure(comm, Trainer(group, cfg, plan), sizes) for name, group in groups.items()}
    if comm.Get_rank() == 0:
        text = report(found, size, sizes)
        publish(args.out, f"pipeline-{size}ranks.md", text)
    dist.destroy_process_group()
    shardwise.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
