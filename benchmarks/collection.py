"""The demo's DLRM model, one training step, under five embedding layouts and two backends.

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/collection.py            # make bench-collection
    .venv/bin/mpiexec -n 4 .venv/bin/python benchmarks/collection.py            # make bench-collection RANKS=4
    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/collection.py --smoke --out /tmp/b   # tiny sizes

The model is ``examples/dlrm.py``'s (26 Criteo-sized tables of 3 to 10^6 rows x
16, 13 dense features, bottom and top MLPs, the global batch of 2048 samples
split over the ranks, bags of 1 to 3 ids). A step is forward, backward and
the optimizers' steps: ``RowWiseAdagrad`` for the tables (row-sparse;
:mod:`shardwise_embedding`), ``torch.optim.Adagrad`` for the MLPs after one
all-reduce of their gradients. The tables are laid out five ways:

* (a) **planned**: ``EmbeddingShardingPlanner(world_size, ...).plan(ebc)``, as
  the demo plans (with its memory budget of 190 MiB per rank; the plan's
  explanation is at the end of the results), run by ``shard_collection``;
* (b) every table **row-wise** over all ranks, by ``shard_collection``;
* (c) every table **table-wise**, largest first onto the rank holding the
  fewest bytes, by ``shard_collection``;
* (d) one **shardwise sharded ``nn.EmbeddingBag``** per table (what the
  project offered before collections: ``shardwise.shard_parameter`` with
  ``ChunkShardingSpec(dim=0)``, then ``F.embedding_bag`` per feature: one
  sharded op, with its own exchanges, per table);
* (e) **torch 2.13's ``torch.distributed._shard``**: the same with torch's own
  ``shard_parameter`` and ``ChunkShardingSpec`` (gloo only; its MLP
  gradients are all-reduced with ``torch.distributed.all_reduce``).

(a) to (d) run over gloo (shardwise over torch's gloo group, through
``shardwise.torch_group.wrap_process_group``) and over MPI
(``shardwise.init("mpi")``), each with shardwise's defaults (every
collective's arguments verified across ranks). (d) and (e) give each rank's
shard a dense gradient (the sharded ops do not support ``sparse=True``), which
the same ``RowWiseAdagrad`` then steps, scanning the shard for touched rows.

Before timing, each layout's first loss (the sum of the ranks' shares) is
compared with the one-process model's on the same global batch, so no row
can compute something else. Each cell is the slowest rank's median of the
timed steps after warm-up ones; a barrier precedes each step and the order of
the layouts is shuffled every round (``_timing.time_spread``). The step's
phases (forward, backward, optimizers including the MLP all-reduce) are
timed inside each step: the slowest rank's median of each.

**Bytes** are counted, in one extra untimed step, by wrapping the collectives:
the shardwise groups' methods (``all_to_all``, ``all_to_all_single``,
``all_reduce``, ``all_gather``, ``reduce_scatter``, ``broadcast``, ``gather``,
``scatter``, and the metadata calls ``exchange`` / ``agree``, which count as
calls of a few bytes) for (a) to (d), and torch's c10d ops (``allgather_``,
``reduce_scatter_``, ``allreduce_``, ``alltoall_base_`` ..., seen through a
``TorchDispatchMode``) for (e). A rank's bytes are what it hands to other
ranks and what it gets from them (its own share of an all-to-all or
all-gather is not counted); an all-reduce counts ``2 (W - 1) / W`` of its
buffer each way, as a ring moves. The per-collective verification
handshakes are not counted (tens of bytes each). For (a) to (c) the
collection's own figure, ``last_exchange_bytes`` (its forward's two
exchanges, its own share included) is shown beside it.

Last, rank 0 alone (the others wait without spinning) times one optimizer
step on a 10^7 x 16 float32 table with 10^4 touched rows (an uncoalesced
sparse gradient, as an embedding bag's backward makes): the row-sparse
optimizers against ``torch.optim.Adagrad`` on the dense gradient (and on the
sparse one), plus a 10^6-row table and 10^5 touched rows, to show what the
cost follows.

Rank 0 writes ``collection-<W>ranks.md`` under ``--out`` (default
``benchmarks/results``) and prints it.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import shardwise_mpi
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _timing import library_line, mpi, script_args, time_spread
from shardwise_embedding import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingShardingPlan,
    EmbeddingShardingPlanner,
    KeyedJaggedTensor,
    KeyedTensor,
    RowSparseAdagrad,
    RowWiseAdagrad,
    ShardedEmbeddingBagCollection,
    TablePlan,
    make_blocks,
    shard_collection,
)
from torch import nn
from torch.distributed._shard import shard_parameter as torch_shard_parameter
from torch.distributed._shard.sharding_spec import ChunkShardingSpec as TorchChunkSpec
from torch.utils._python_dispatch import TorchDispatchMode

import shardwise
from shardwise.torch_group import wrap_process_group

#: examples/: the demo's model, data and configuration.
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.append(str(EXAMPLES))

from _dlrm_data import MAX_BAG, ClickLog, criteo_tables, feature_names  # noqa: E402
from _dlrm_model import DLRM, batch_loss, build_collection, build_model, sum_dense_grads, table_weight  # noqa: E402
from _training import rank_rows  # noqa: E402
from dlrm import FULL, TINY, Config  # noqa: E402

MIB = 1 << 20
#: The layouts, in the table's order.
LAYOUTS = {
    "a": "(a) planned, collection",
    "b": "(b) all row-wise, collection",
    "c": "(c) all table-wise, collection",
    "d": "(d) shardwise nn.EmbeddingBag per table",
    "e": "(e) torch._shard nn.EmbeddingBag per table",
}
PHASES = ("forward", "backward", "step")


@dataclass(frozen=True)
class Sizes:
    """What one run measures."""

    config: Config = FULL
    batches: int = 4  # distinct global batches the steps cycle through
    warmup: int = 1
    repeats: int = 7
    optim_rows: tuple[int, ...] = (10_000_000, 1_000_000)
    optim_touched: tuple[int, ...] = (10_000, 100_000)
    optim_repeats: int = 5


SMOKE = Sizes(
    config=TINY, batches=2, warmup=1, repeats=2, optim_rows=(20_000, 2_000), optim_touched=(100, 1_000), optim_repeats=2
)


# -- counting bytes ------------------------------------------------------------------------------------


@dataclass
class Meter:
    """Collective calls and bytes of one step, per phase (only while ``phase`` is set)."""

    phase: Optional[str] = None
    depth: int = 0
    calls: dict[str, Counter] = field(default_factory=lambda: {p: Counter() for p in PHASES})
    sent: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    received: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    def note(self, op: str, sent: float, received: float) -> None:
        if self.phase is None:
            return
        self.calls[self.phase][op] += 1
        self.sent[self.phase] += sent
        self.received[self.phase] += received

    def reset(self) -> None:
        for p in PHASES:
            self.calls[p].clear()
            self.sent[p] = self.received[p] = 0.0


METER = Meter()


def _bytes(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_bytes(x) for x in t)
    return 0


def _ring(nbytes: int, size: int) -> float:
    return 2.0 * (size - 1) / size * nbytes


def _group_traffic(
    name: str, group: Any, out: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[float, float]:
    """Bytes this rank sends to and receives from other ranks in one call of a shardwise Group method."""
    size, rank = group.size, group.rank
    if name == "all_to_all":
        inputs = args[0]
        return (
            sum(_bytes(t) for r, t in enumerate(inputs) if r != rank),
            sum(_bytes(t) for r, t in enumerate(out) if r != rank),
        )
    if name == "all_to_all_single":
        tensor = args[0]
        splits = args[2] if len(args) > 2 else kwargs.get("input_split_sizes")
        rows = tensor.shape[0] if tensor.dim() else 1
        per_row = _bytes(tensor) / max(rows, 1)
        mine = (splits[rank] if splits else rows // size) * per_row
        return _bytes(tensor) - mine, _bytes(out) - mine
    if name == "all_reduce":
        return _ring(_bytes(args[0]), size), _ring(_bytes(args[0]), size)
    if name == "all_gather":
        return (size - 1) * _bytes(args[0]), _bytes(out) - _bytes(args[0])
    if name == "reduce_scatter":
        inputs = args[0]
        return sum(_bytes(t) for r, t in enumerate(inputs) if r != rank), (size - 1) * _bytes(out)
    if name == "broadcast":
        src = args[1] if len(args) > 1 else kwargs.get("src", 0)
        return ((size - 1) * _bytes(args[0]), 0.0) if rank == src else (0.0, _bytes(args[0]))
    if name in ("gather", "scatter"):
        return float(_bytes(args[0]) if name == "gather" else 0), float(_bytes(out) if name == "scatter" else 0)
    return 0.0, 0.0  # exchange / agree: metadata, a few bytes


GROUP_METHODS = (
    "all_to_all",
    "all_to_all_single",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "gather",
    "scatter",
    "exchange",
    "agree",
)


def instrument(group: Any) -> None:
    """Count every outermost collective ``group`` runs into :data:`METER` (nested calls belong to it)."""
    for name in GROUP_METHODS:
        method = getattr(group, name)

        def wrapped(*args: Any, _method: Callable[..., Any] = method, _name: str = name, **kwargs: Any) -> Any:
            if METER.depth:
                return _method(*args, **kwargs)
            METER.depth += 1
            try:
                out = _method(*args, **kwargs)
            finally:
                METER.depth -= 1
            METER.note(_name, *_group_traffic(_name, group, out, args, kwargs))
            return out

        setattr(group, name, wrapped)


class TorchCollectives(TorchDispatchMode):
    """Counts torch.distributed's c10d ops (what torch._shard and ``dist.all_reduce`` run) into :data:`METER`."""

    def __init__(self, size: int, rank: int) -> None:
        super().__init__()
        self.size, self.rank = size, rank

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        name = str(func)
        if name.startswith("c10d."):
            METER.note(name.split(".")[1], *self._traffic(name.split(".")[1], args))
        return func(*args, **(kwargs or {}))

    def _traffic(self, op: str, args: tuple[Any, ...]) -> tuple[float, float]:
        size = self.size
        if op in ("allgather_", "_allgather_base_"):
            out, inp = _bytes(args[0]), _bytes(args[1])
            return (size - 1) * inp, out - inp
        if op in ("reduce_scatter_", "_reduce_scatter_base_"):
            out, inp = _bytes(args[0]), _bytes(args[1])
            return inp - out, (size - 1) * out
        if op == "allreduce_":
            return _ring(_bytes(args[0]), size), _ring(_bytes(args[0]), size)
        if op == "alltoall_base_":
            out, inp = args[0], args[1]
            in_splits = list(args[4]) if len(args) > 4 and args[4] else None
            rows = inp.shape[0] if inp.dim() else 1
            per_row = _bytes(inp) / max(rows, 1)
            mine = (in_splits[self.rank] if in_splits else rows // size) * per_row
            return _bytes(inp) - mine, _bytes(out) - mine
        if op == "alltoall_":
            outs, ins = args[0], args[1]
            return _bytes(ins) - _bytes(ins[self.rank]), _bytes(outs) - _bytes(outs[self.rank])
        return 0.0, 0.0


# -- layouts -------------------------------------------------------------------------------------------


def planned(ebc: EmbeddingBagCollection, size: int, cfg: Config) -> EmbeddingShardingPlan:
    """(a): the planner's plan, with the arguments ``examples/dlrm.py`` gives it (one host, its memory budget)."""
    planner = EmbeddingShardingPlanner(
        size,
        memory_budget_bytes=cfg.memory_budget_mib << 20 if cfg.memory_budget_mib else None,
        batch_size=max(1, cfg.batch // size),
        default_pooling_factor=2.0,
        optimizer_state="rowwise_adagrad",
    )
    return planner.plan(ebc)


def uniform(tables: Sequence[EmbeddingBagConfig], size: int, kind: str) -> EmbeddingShardingPlan:
    """(b) every table row-wise over all ranks, or (c) every table whole on one rank.

    Table-wise puts the largest tables first, each onto the rank holding the fewest bytes so far.
    """
    owner: dict[str, int] = {}
    held = [0] * size
    for t in sorted(tables, key=lambda t: -t.bytes):
        owner[t.name] = min(range(size), key=lambda r: (held[r], r))
        held[owner[t.name]] += t.bytes
    plans = []
    for t in tables:
        ranks = list(range(size)) if kind == "row_wise" else [owner[t.name]]
        blocks = make_blocks(kind, t.num_embeddings, t.embedding_dim, ranks)
        plans.append(
            TablePlan(
                t.name,
                kind,
                tuple(b.rank for b in blocks),
                t.num_embeddings,
                t.embedding_dim,
                blocks,
                f"every table {kind}",
            )
        )
    return EmbeddingShardingPlan(world_size=size, tables=tuple(plans))


class PerTableBags(nn.Module):
    """(d) and (e): one ``nn.EmbeddingBag`` per table, pooled one feature at a time with ``F.embedding_bag``.

    With sharded weights each lookup is one sharded op (shardwise's or
    torch._shard's) with exchanges of its own. Starts from ``ebc``'s
    weights (shared until sharding replaces them).

    Args:
        ebc: The collection whose tables to copy.
        pad_to: None: pass each feature's bags as they are (1-D ids and
            offsets). A number: pass ``[batch, pad_to]`` ids, bags padded
            with id 0 of weight 0 (``per_sample_weights``), the same sums.
            torch._shard needs that: it all-gathers every rank's input
            assuming the same shape everywhere (ragged bags crash gloo with
            "Received data size doesn't match expected size").
    """

    def __init__(self, ebc: EmbeddingBagCollection, pad_to: Optional[int] = None) -> None:
        super().__init__()
        self._order = [(f, t) for t in ebc.embedding_bag_configs() for f in t.feature_names]
        self.pad_to = pad_to
        self.embedding_bags = nn.ModuleDict(
            {
                t.name: nn.EmbeddingBag.from_pretrained(table_weight(ebc, t.name).detach(), freeze=False, mode="sum")
                for t in ebc.embedding_bag_configs()
            }
        )

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        pooled = []
        for f, t in self._order:
            bags = features[f]
            weight: Any = self.embedding_bags[t.name].weight  # a ShardedTensor once sharded
            if self.pad_to is None:
                pooled.append(F.embedding_bag(bags.values(), weight, bags.offsets()[:-1], mode="sum"))
                continue
            used = torch.arange(self.pad_to) < bags.lengths().unsqueeze(1)  # [batch, pad_to]
            ids = torch.zeros(used.shape, dtype=torch.int64)
            ids[used] = bags.values()
            pooled.append(F.embedding_bag(ids, weight, mode="sum", per_sample_weights=used.to(torch.float32)))
        return KeyedTensor(
            [f for f, _ in self._order], [t.embedding_dim for _, t in self._order], torch.cat(pooled, dim=1)
        )

    def local_shards(self) -> list[torch.Tensor]:
        """This rank's shards of every table (leaves that get the gradients)."""
        out = []
        for bag in self.embedding_bags.values():
            weight: Any = bag.weight
            for shard in weight.local_shards():
                out.append(shard.tensor.requires_grad_(True))
        return out


def torch_sum_dense_grads(model: DLRM, loss: torch.Tensor) -> float:
    """``_dlrm_model.sum_dense_grads`` with ``torch.distributed.all_reduce``: (e) stays torch's own path."""
    params = model.dense_parameters()
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads] + [loss.detach().reshape(1)])
    dist.all_reduce(flat)
    for p, piece in zip(params, flat[:-1].split([p.numel() for p in params]), strict=True):
        p.grad = piece.view_as(p)
    return float(flat[-1])


@dataclass
class Variant:
    """One layout over one backend, ready to step."""

    key: str
    backend: str
    model: DLRM
    tables_opt: Any
    mlp_opt: torch.optim.Optimizer
    table_params: list[torch.Tensor]
    sync: Callable[[DLRM, torch.Tensor], float]
    collection: Optional[ShardedEmbeddingBagCollection] = None
    phases: list[tuple[float, float, float]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.key}-{self.backend}"


@dataclass(frozen=True)
class Local:
    """This rank's slice of one global batch, ready to feed."""

    dense: torch.Tensor
    features: KeyedJaggedTensor
    labels: torch.Tensor


def build_variants(
    ebc: EmbeddingBagCollection, tables: list[EmbeddingBagConfig], groups: dict[str, Any], cfg: Config
) -> tuple[list[Variant], EmbeddingShardingPlan]:
    """Every layout over every backend, each from ``ebc``'s weights and the same initial MLPs."""
    size = next(iter(groups.values())).size
    plans = {
        "a": planned(ebc, size, cfg),
        "b": uniform(tables, size, "row_wise"),
        "c": uniform(tables, size, "table_wise"),
    }
    variants = []

    def finish(
        key: str,
        backend: str,
        embeddings: nn.Module,
        params: list[torch.Tensor],
        sync: Any,
        collection: Optional[ShardedEmbeddingBagCollection] = None,
    ) -> None:
        model = build_model(embeddings, tables, cfg.bottom, cfg.top, seed=0)
        variants.append(
            Variant(
                key,
                backend,
                model,
                RowWiseAdagrad(params, lr=cfg.table_lr, eps=cfg.eps),
                torch.optim.Adagrad(model.dense_parameters(), lr=cfg.mlp_lr, eps=cfg.eps),
                params,
                sync,
                collection,
            )
        )

    for backend, group in groups.items():

        def sync(model: DLRM, loss: torch.Tensor, _group: Any = group) -> float:
            return sum_dense_grads(model, loss, _group)

        for key, plan in plans.items():
            sharded = shard_collection(ebc, plan, group)
            finish(key, backend, sharded, list(sharded.parameters()), sync, sharded)
        bags = PerTableBags(ebc)
        spec = shardwise.ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(size)])
        for bag in bags.embedding_bags.values():
            shardwise.shard_parameter(bag, "weight", spec, src_rank=0, process_group=group)
        finish("d", backend, bags, bags.local_shards(), sync)
    bags = PerTableBags(ebc, pad_to=MAX_BAG)
    torch_spec = TorchChunkSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(size)])
    for bag in bags.embedding_bags.values():
        torch_shard_parameter(bag, "weight", torch_spec, src_rank=0)
    finish("e", "gloo", bags, bags.local_shards(), lambda model, loss: torch_sum_dense_grads(model, loss))
    return variants, plans["a"]


def make_step(v: Variant, batches: Sequence[Local], global_batch: int, meter: bool = False) -> Callable[[], float]:
    """One training step of ``v`` on the next batch; records its phases' seconds (and, with ``meter``, its traffic)."""
    state = {"i": 0}

    @contextlib.contextmanager
    def phase(name: str) -> Iterator[None]:
        if meter:
            METER.phase = name
        try:
            yield
        finally:
            METER.phase = None

    def step() -> float:
        b = batches[state["i"] % len(batches)]
        state["i"] += 1
        for p in v.table_params + v.model.dense_parameters():
            p.grad = None
        t0 = time.perf_counter()
        with phase("forward"):
            loss = batch_loss(v.model(b.dense, b.features), b.labels, global_batch)
        t1 = time.perf_counter()
        with phase("backward"):
            loss.backward()
        t2 = time.perf_counter()
        with phase("step"):
            total = v.sync(v.model, loss)
            v.tables_opt.step()
            v.mlp_opt.step()
        t3 = time.perf_counter()
        v.phases.append((t1 - t0, t2 - t1, t3 - t2))
        return total

    return step


# -- measuring -----------------------------------------------------------------------------------------


@dataclass
class Traffic:
    """What one step of a variant ran on this rank: collective calls per phase, bytes out and in."""

    calls: dict[str, dict[str, int]]
    sent: float
    received: float
    collection: tuple[int, int]  # the collection's last_exchange_bytes (0, 0) for (d), (e)


def count_and_check(
    comm: Any, variants: list[Variant], batches: Sequence[Local], global_batch: int, expected: float
) -> dict[str, Traffic]:
    """One untimed, counted step of every variant; its loss must be the one-process model's.

    Raises:
        AssertionError: (on every rank) a variant's loss differs from the reference by more than float rounding.
    """
    traffic = {}
    problems = []
    torch_mode = TorchCollectives(comm.Get_size(), comm.Get_rank())
    for v in variants:
        METER.reset()
        step = make_step(v, batches, global_batch, meter=True)
        if v.key == "e":
            with torch_mode:
                loss = step()
        else:
            loss = step()
        if abs(loss - expected) > 1e-5 * abs(expected):
            problems.append(f"{v.name}: first loss {loss:.7f}, one-process model {expected:.7f}")
        exchanged = v.collection.last_exchange_bytes if v.collection is not None else (0, 0)
        traffic[v.name] = Traffic(
            {p: dict(METER.calls[p]) for p in PHASES},
            sum(METER.sent.values()),
            sum(METER.received.values()),
            (int(exchanged[0]), int(exchanged[1])),
        )
        v.phases.clear()
    reports = comm.allgather(problems)
    if any(reports):
        raise AssertionError(
            "results differ:\n" + "\n".join(f"rank {r}: {p}" for r, ps in enumerate(reports) for p in ps)
        )
    return traffic


def reference_loss(ebc: EmbeddingBagCollection, tables: list[EmbeddingBagConfig], cfg: Config, data: ClickLog) -> float:
    """The one-process model's loss on global batch 0 (what every layout's first step must report)."""
    model = build_model(ebc, tables, cfg.bottom, cfg.top, seed=0)
    samples = data.global_batch(0, cfg.batch)
    with torch.no_grad():
        logits = model(samples.dense, samples.features(feature_names()))
        return float(F.binary_cross_entropy_with_logits(logits, samples.labels))


@dataclass(frozen=True)
class Result:
    """One row of the table: a variant's figures, every rank's taken into account."""

    key: str
    backend: str
    step_s: float  # the slowest rank's median step
    phases_s: tuple[float, float, float]  # the slowest rank's median of each phase
    calls: dict[str, dict[str, int]]  # rank 0's
    sent: float  # the most any rank sent
    received: float
    collection: tuple[int, int]  # the most any rank's last_exchange_bytes showed (sent, received)


def results(
    comm: Any, variants: list[Variant], spreads: dict[str, Any], traffic: dict[str, Traffic], warmup: int
) -> list[Result]:
    out = []
    for v in variants:
        timed = v.phases[warmup:]
        phases = tuple(comm.allreduce(statistics.median(p[i] for p in timed), op=mpi().MAX) for i in range(3))
        t = traffic[v.name]
        out.append(
            Result(
                v.key,
                v.backend,
                spreads[v.name].median,
                phases,
                t.calls,
                comm.allreduce(t.sent, op=mpi().MAX),
                comm.allreduce(t.received, op=mpi().MAX),
                (comm.allreduce(t.collection[0], op=mpi().MAX), comm.allreduce(t.collection[1], op=mpi().MAX)),
            )
        )
    return out


# -- the optimizer step on a big table -----------------------------------------------------------------


@dataclass(frozen=True)
class OptimRow:
    rows: int
    touched: int
    times_ms: dict[str, float]


def optimizer_rows(comm: Any, sizes: Sizes) -> list[OptimRow]:
    """Rank 0 times one optimizer step per optimizer on big tables; the other ranks wait without spinning."""
    out: list[OptimRow] = []
    if comm.Get_rank() != 0:
        request = comm.Ibarrier()
        while not request.Test():
            time.sleep(0.02)
        received: list[OptimRow] = comm.bcast(None)
        return received
    big, small = sizes.optim_rows
    few, many = sizes.optim_touched
    dim = 16
    for rows, touched in ((big, few), (big, many), (small, few)):
        weight = torch.empty(rows, dim).uniform_(-0.1, 0.1)
        g = torch.Generator().manual_seed(rows + touched)
        # An embedding bag's sparse gradient: one entry per looked-up id, repeats not yet summed.
        ids = torch.randint(0, rows, (touched,), generator=g)
        sparse = torch.sparse_coo_tensor(
            ids.unsqueeze(0), torch.randn(touched, dim, generator=g), (rows, dim), check_invariants=False
        )
        cases: dict[str, tuple[Callable[[list[torch.Tensor]], Any], Optional[torch.Tensor]]] = {
            "RowWiseAdagrad, sparse grad": (lambda ps: RowWiseAdagrad(ps, lr=0.01), sparse),
            "RowSparseAdagrad, sparse grad": (lambda ps: RowSparseAdagrad(ps, lr=0.01), sparse),
            "torch.optim.Adagrad, sparse grad": (lambda ps: torch.optim.Adagrad(ps, lr=0.01), sparse),
            "torch.optim.Adagrad, dense grad": (lambda ps: torch.optim.Adagrad(ps, lr=0.01), None),
        }
        times = {}
        for name, (make, grad) in cases.items():
            param = nn.Parameter(weight)
            opt = make([param])
            dense = sparse.to_dense() if grad is None else None
            samples = []
            for i in range(1 + sizes.optim_repeats):  # the first step allocates the state: not timed
                param.grad = grad if grad is not None else dense
                start = time.perf_counter()
                opt.step()
                if i:
                    samples.append(time.perf_counter() - start)
            times[name] = statistics.median(samples) * 1e3
            del opt, dense, param
        out.append(OptimRow(rows, touched, times))
        del weight, sparse
    comm.Ibarrier().Wait()
    out = comm.bcast(out)
    return out


# -- the report ----------------------------------------------------------------------------------------


def _mib(n: float) -> str:
    return f"{n / MIB:.2f}"


def _calls(calls: dict[str, int]) -> str:
    return ", ".join(f"{n}× {op}" for op, n in sorted(calls.items())) or "none"


def _rate(r: Result, batch: int) -> float:
    return batch / r.step_s


def best_uniform(rows: list[Result], backend: str, batch: int) -> Result:
    """The faster of (b) and (c) on ``backend``."""
    return max((r for r in rows if r.key in "bc" and r.backend == backend), key=lambda r: _rate(r, batch))


def table(
    rows: list[Result],
    optim: list[OptimRow],
    size: int,
    sizes: Sizes,
    plan: EmbeddingShardingPlan,
    tables: list[EmbeddingBagConfig],
) -> str:
    cfg = sizes.config
    batch = cfg.batch
    torch_row = next(r for r in rows if r.key == "e")
    total = sum(t.bytes for t in tables)
    kinds = Counter(t.sharding_type for t in plan.tables)
    lines = [
        f"{size} ranks on one 2-core machine ({'oversubscribed: ' if size > 2 else ''}{size} processes), CPU; "
        f"{library_line()}.",
        f"Model: examples/dlrm.py ({cfg.name}): 26 tables of {min(t.num_embeddings for t in tables)} to "
        f"{max(t.num_embeddings for t in tables):,} rows x {cfg.dim} float32 ({total / MIB:.0f} MiB), 13 dense "
        f"features, bottom MLP {cfg.bottom}, top MLP {cfg.top}; global batch {batch} ({batch // size} per rank), "
        "bags of 1-3 ids.",
        "A step = forward + backward + RowWiseAdagrad on the tables + Adagrad on the MLPs after one all-reduce of "
        f"their gradients. Step ms: the slowest rank's median of {sizes.repeats} steps after {sizes.warmup} "
        "warm-up (layouts interleaved, shuffled each round); fwd / bwd / opt: the slowest rank's median of each "
        "phase. samples/s = global batch / step.",
        "Bytes: what a rank sends to / receives from other ranks in all collectives of one step (fwd + bwd + "
        "opt), the busiest rank's, counted by wrapping the collectives (see benchmarks/collection.py; an "
        "all-reduce counts 2(W-1)/W of its buffer each way; handshakes not counted). Collection fwd: "
        "`last_exchange_bytes` of the collection's forward (its two exchanges, own share included).",
        "(e) is fed each bag padded to 3 ids (padding: id 0 with per-sample weight 0, the same sums): "
        "torch._shard all-gathers every rank's input assuming the same shape on every rank, and ragged bags "
        "abort gloo. (d) and (e) give each rank's shard a dense gradient (their ops refuse sparse=True), which "
        "RowWiseAdagrad scans for touched rows: most of their opt time.",
        f"Plan (a): {', '.join(f'{n} {k}' for k, n in kinds.most_common())} (explanation below).",
        "",
        "| layout | backend | step ms | samples/s | × (e) | × best uniform | fwd / bwd / opt ms | MiB sent / "
        "received per rank per step | collection fwd MiB sent / received |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        uniform_best = best_uniform(rows, r.backend, batch)
        coll = f"{_mib(r.collection[0])} / {_mib(r.collection[1])}" if r.key in "abc" else "n/a"
        lines.append(
            f"| {LAYOUTS[r.key]} | {r.backend} | {r.step_s * 1e3:.1f} | {_rate(r, batch):,.0f} | "
            f"{torch_row.step_s / r.step_s:.2f} | {uniform_best.step_s / r.step_s:.2f} | "
            + " / ".join(f"{p * 1e3:.1f}" for p in r.phases_s)
            + f" | {_mib(r.sent)} / {_mib(r.received)} | {coll} |"
        )
    lines += [
        "",
        "Collectives per step (rank 0's calls, by phase):",
        "",
        "| layout | backend | forward | backward | opt |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {LAYOUTS[r.key]} | {r.backend} | " + " | ".join(_calls(r.calls[p]) for p in PHASES) + " |")
    lines += [
        "",
        "One optimizer step on one table of rows x 16 float32 (rank 0 alone; median of "
        f"{sizes.optim_repeats} steps after one that allocates the state). The gradient: touched ids drawn "
        "uniformly, as an uncoalesced sparse tensor (repeats not summed), or that tensor made dense.",
        "",
        "| rows | touched ids | " + " | ".join(f"{name} ms" for name in optim[0].times_ms) + " |",
        "|---:|---:|" + "---:|" * len(optim[0].times_ms),
    ]
    for o in optim:
        lines.append(f"| {o.rows:,} | {o.touched:,} | " + " | ".join(f"{t:.2f}" for t in o.times_ms.values()) + " |")
    lines += ["", "Targets:", ""]
    lines += [f"- [{'x' if ok else ' '}] {what}: {figure}" for what, ok, figure in targets(rows, optim, batch)]
    lines += [
        "",
        "<details><summary>Plan (a): plan.explain()</summary>",
        "",
        "```",
        plan.explain(),
        "```",
        "",
        "</details>",
    ]
    return "\n".join(lines) + "\n"


def targets(rows: list[Result], optim: list[OptimRow], batch: int) -> list[tuple[str, bool, str]]:
    """The issue's targets: (what, met, the figures)."""
    out = []
    planned_rows = [r for r in rows if r.key == "a"]
    fwd_ok = all(r.calls["forward"] == {"all_to_all": 1, "all_to_all_single": 1} for r in planned_rows)
    bwd = "; ".join(f"{r.backend}: {_calls(r.calls['backward'])}" for r in planned_rows)
    out.append(
        (
            "the collection issues exactly one input and one output exchange per step",
            fwd_ok,
            "forward of (a) " + ("is" if fwd_ok else "is NOT") + " one all_to_all (ids) and one all_to_all_single "
            f"(pooled vectors) on every backend; backward: {bwd} (the vectors' gradients retrace the output exchange; "
            "an all_reduce sums the replicated tables' gradients when the plan has any)",
        )
    )
    for r in planned_rows:
        best = best_uniform(rows, r.backend, batch)
        ok = _rate(r, batch) >= _rate(best, batch)
        out.append(
            (
                f"planned layout at least as fast as the best uniform layout ({r.backend})",
                ok,
                f"(a) {_rate(r, batch):,.0f} samples/s, best uniform {LAYOUTS[best.key][:3]} "
                f"{_rate(best, batch):,.0f} samples/s: ×{best.step_s / r.step_s:.2f}",
            )
        )
    torch_row = next(r for r in rows if r.key == "e")
    for r in planned_rows:
        ratio = torch_row.step_s / r.step_s
        out.append(
            (
                f"planned layout ≥ 3× faster than torch._shard per table (e) ({r.backend})",
                ratio >= 3,
                f"(a) {_rate(r, batch):,.0f} samples/s, (e) {_rate(torch_row, batch):,.0f}: ×{ratio:.2f}",
            )
        )
    big_few, big_many, small_few = optim
    row_wise = "RowWiseAdagrad, sparse grad"
    dense = "torch.optim.Adagrad, dense grad"
    speedup = big_few.times_ms[dense] / big_few.times_ms[row_wise]
    size_ratio = big_few.times_ms[row_wise] / small_few.times_ms[row_wise]
    touched_ratio = big_many.times_ms[row_wise] / big_few.times_ms[row_wise]
    ok = speedup >= 10 and size_ratio <= 2
    out.append(
        (
            "row-sparse optimizer steps cost O(touched rows)",
            ok,
            f"RowWiseAdagrad on {big_few.rows:,} rows with {big_few.touched:,} touched: "
            f"{big_few.times_ms[row_wise]:.2f} ms, a dense torch.optim.Adagrad step "
            f"{big_few.times_ms[dense]:.1f} ms (×{speedup:.0f}); "
            f"{small_few.rows:,} rows, same touched: {small_few.times_ms[row_wise]:.2f} ms (×{size_ratio:.2f} for "
            f"{big_few.rows // small_few.rows}× the rows); {big_many.touched:,} touched: "
            f"{big_many.times_ms[row_wise]:.2f} ms (×{touched_ratio:.1f} for {big_many.touched // big_few.touched}× "
            "the rows touched)",
        )
    )
    return out


def main(argv: Optional[list[str]] = None) -> int:
    args = script_args(__doc__, argv)
    sizes = SMOKE if args.smoke else Sizes()
    cfg = sizes.config
    # torch._shard warns on every call that it is deprecated in favour of DTensor.
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed._shard")
    # This script makes torch.distributed's default group itself (gloo, below), so the mpi
    # backend must leave torch.distributed alone (by default it brings up "mpi4py" there).
    os.environ["SHARDWISE_MPI_TORCH_DIST"] = "0"
    mpi_group = shardwise.init("mpi")
    comm = mpi().COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    # Each rank gets its share of the cores for torch's threads, as the demo does.
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // size))
    # Makes env:// fall back to MPI under mpiexec: gloo then needs no MASTER_ADDR.
    shardwise_mpi.register_torch_backend()
    dist.init_process_group("gloo")
    world = dist.group.WORLD
    assert world is not None
    groups = {"gloo": wrap_process_group(world), "mpi": mpi_group}
    for group in groups.values():
        instrument(group)

    tables = criteo_tables(cfg.max_rows, cfg.dim)
    ebc = build_collection(tables, seed=0)
    data = ClickLog(tables, seed=0)
    expected = reference_loss(ebc, tables, cfg, data)
    rows = rank_rows(cfg.batch, rank, size)
    keys = feature_names()
    batches = []
    for i in range(sizes.batches):
        local = data.global_batch(i, cfg.batch)[rows]
        batches.append(Local(local.dense, local.features(keys), local.labels))
    variants, plan = build_variants(ebc, tables, groups, cfg)
    del ebc
    traffic = count_and_check(comm, variants, batches, cfg.batch, expected)
    steps = {v.name: make_step(v, batches[1:] or batches, cfg.batch) for v in variants}
    spreads = time_spread(comm, steps, sizes.repeats, sizes.warmup)
    found = results(comm, variants, spreads, traffic, sizes.warmup)
    del variants, steps
    optim = optimizer_rows(comm, sizes)
    if rank == 0:
        text = table(found, optim, size, sizes, plan, tables)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"collection-{size}ranks.md").write_text(text)
        sys.stdout.write(text)
        sys.stdout.flush()
    dist.destroy_process_group()
    shardwise.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
