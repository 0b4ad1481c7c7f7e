"""GPU checks of shardwise, for a machine with CUDA (see README.md beside this file).

Checks (``--checks``, comma-separated; default all):

* ``nccl``: backend nccl: every collective of the group on CUDA tensors (and a
  CPU tensor staged through the GPU), autograd through
  ``shardwise.nn.functional``, then ``shard_tensor``, a pointwise op,
  ``reshard``, ``gather`` and ``full_tensor`` of a CUDA tensor; every result
  stays on the GPU and equals the CPU computation.
* ``mpi-cuda``: the same with backend mpi (meant for ``mpiexec -n 2``), and
  whether the MPI library took the CUDA pointers (CUDA-aware) or the tensors
  were staged through host memory.
* ``embedding``: sharded ``nn.Embedding`` and ``nn.EmbeddingBag`` (sum, mean,
  max), row-wise and column-wise, at the world size the program runs at:
  forward and backward against a dense module with the same weights (lookups
  exact, pooled bags and gradients within float32 tolerances).
* ``collection``: an embedding collection with a table of every sharding
  type (``shard_collection``, one exchange of ids and one of pooled vectors
  per step), tables and batches on the device: each rank's pooled output and
  its blocks' gradients against the dense ``EmbeddingBagCollection`` on every
  rank's batch (float32 tolerances).
* ``throughput``: at world size 1, a row-wise sharded ``F.embedding`` forward
  and forward+backward timed against the dense ``F.embedding`` on the same
  GPU (V=200000, D=128, 4096x32 ids, CUDA events); PASS when sharded/dense is
  at most ``--target`` (1.2) for both.

Every check prints one line from rank 0 starting with ``PASS``, ``FAIL`` or
``SKIP`` and its figures; the exit status is 1 when any check failed. Without
a CUDA device the program prints ``SKIP: no CUDA device`` and exits 0, unless
``--device cpu`` asks it to run its logic on the CPU (labelled as such; the
nccl check then skips, and the figures say nothing about GPUs)::

    python integration_tests/gpu/check_gpu.py                                  # world size 1 (nccl)
    mpiexec -n 2 python integration_tests/gpu/check_gpu.py --backend mpi       # MPI with CUDA tensors
    torchrun --standalone --nproc-per-node 2 integration_tests/gpu/check_gpu.py --backend nccl
    python integration_tests/gpu/check_gpu.py --device cpu --backend gloo --small   # the logic, on a CPU
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, cast

import torch
import torch.nn.functional as F
from torch import nn

import shardwise
import shardwise.nn.functional as swf
from shardwise import ChunkShardingSpec, Group, ShardedTensor

CHECKS = ("nccl", "mpi-cuda", "embedding", "collection", "throughput")

#: float32 tolerances for results whose sums run in another order than the dense op's.
RTOL, ATOL = 1e-5, 1e-5


# -- outcomes ----------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What one check concluded on one rank.

    Attributes:
        status: ``"PASS"``, ``"FAIL"`` or ``"SKIP"``.
        detail: The figures (PASS), what went wrong (FAIL) or why not (SKIP).
    """

    status: str
    detail: str


@dataclass
class Tally:
    """Comparisons of one check that never raise, so a mismatch never leaves the ranks out of step.

    A check does all its collective work whatever an earlier comparison
    found; the failures are reported together at the end.
    """

    device: torch.device
    compared: int = 0
    worst: float = 0.0
    failures: list[str] = field(default_factory=list)

    def _where(self, what: str, got: torch.Tensor, device: Optional[torch.device]) -> bool:
        self.compared += 1
        want = self.device if device is None else device
        if got.device != want:
            self.failures.append(f"{what}: on {got.device}, expected on {want}")
            return False
        return True

    def exact(self, what: str, got: torch.Tensor, want: torch.Tensor, device: Optional[torch.device] = None) -> None:
        """``got`` is on ``device`` (default the check's) and equals ``want`` (any device) exactly."""
        if not self._where(what, got, device):
            return
        have = got.detach().cpu()
        expected = want.detach().cpu()
        if have.dtype != expected.dtype or have.shape != expected.shape or not torch.equal(have, expected):
            self.failures.append(f"{what}: got {_short(have)}, expected {_short(expected)}")

    def close(self, what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        """``got`` is on the check's device and within float32 tolerances of ``want``."""
        if not self._where(what, got, None):
            return
        have, expected = got.detach().cpu().double(), want.detach().cpu().double()
        if have.shape != expected.shape:
            self.failures.append(f"{what}: shape {tuple(have.shape)}, expected {tuple(expected.shape)}")
            return
        if have.numel():
            self.worst = max(self.worst, float((have - expected).abs().max()))
        if not torch.allclose(have, expected, rtol=RTOL, atol=ATOL):
            diff = float((have - expected).abs().max())
            self.failures.append(f"{what}: max |difference| {diff:.3g} beyond rtol={RTOL:g}, atol={ATOL:g}")

    def outcome(self, summary: str) -> Outcome:
        """FAIL with the first failures, or PASS with ``summary`` when every comparison held."""
        if self.failures:
            more = f" (and {len(self.failures) - 3} more)" if len(self.failures) > 3 else ""
            return Outcome("FAIL", f"{len(self.failures)} of {self.compared} results wrong: "
                           + "; ".join(self.failures[:3]) + more)
        return Outcome("PASS", summary)


def _short(t: torch.Tensor) -> str:
    """A tensor's dtype, shape and first values, for a failure message."""
    values = t.reshape(-1)[:6].tolist()
    return f"{t.dtype} {list(t.shape)} {values}{' ...' if t.numel() > 6 else ''}"


# -- the run -----------------------------------------------------------------------------------------


@dataclass
class Run:
    """Everything a check needs.

    Attributes:
        group: The default group.
        device: This rank's device for the checks' tensors.
        devices: Every rank's device, as placements name them (``cuda:0``).
        args: The command line.
    """

    group: Group
    device: torch.device
    devices: list[str]
    args: argparse.Namespace

    @property
    def on_cpu(self) -> bool:
        """Whether this is a ``--device cpu`` run (the program's logic, not a GPU check)."""
        return self.device.type == "cpu"

    def placements(self, ranks: Sequence[int]) -> list[str]:
        """``rank:R/DEVICE`` for each of ``ranks``, on that rank's device."""
        return [f"rank:{r}/{self.devices[r]}" for r in ranks]


def _device_name(device: torch.device) -> str:
    """``cuda:0 (NVIDIA H100 ...)``, or the device itself for a CPU."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def _pick_device(group: Group, wanted: str) -> torch.device:
    """The device this rank checks on: the nccl group's own GPU, else one GPU per local rank (shared if too few)."""
    if wanted == "cpu":
        return torch.device("cpu")
    if group.device.type == "cuda":
        return group.device
    from shardwise._session.runtime import detect  # the launch information shardwise.init used

    local_rank = detect().local_rank
    return torch.device("cuda", local_rank % torch.cuda.device_count())


# -- collectives, shard, reshard, gather (nccl and mpi-cuda) ----------------------------------------


def collective_suite(run: Run, tally: Tally) -> list[str]:
    """Every collective and the data movement of a ShardedTensor on ``run.device``, checked against the CPU.

    Returns:
        The names of what ran.
    """
    group, dev = run.group, run.device
    w, r = group.size, group.rank
    tri = w * (w + 1) // 2  # 1 + 2 + ... + w
    done = []

    t = torch.full((4,), float(r + 1), device=dev)
    group.all_reduce(t)
    tally.exact("all_reduce sum float32", t, torch.full((4,), float(tri)))
    t = torch.tensor([r, -r, 7], device=dev)
    group.all_reduce(t, "max")
    tally.exact("all_reduce max int64", t, torch.tensor([w - 1, 0, 7]))
    t = torch.full((3,), float(r + 1), dtype=torch.bfloat16, device=dev)  # MPI has no bfloat16: reduced in float32
    group.all_reduce(t, "avg")
    tally.exact("all_reduce avg bfloat16", t, torch.full((3,), tri / w, dtype=torch.bfloat16))
    done.append("all_reduce")

    t = torch.arange(5, dtype=torch.float64, device=dev) + 100 * r
    group.broadcast(t, src=w - 1)
    tally.exact("broadcast", t, torch.arange(5, dtype=torch.float64) + 100 * (w - 1))
    done.append("broadcast")

    pieces = group.all_gather(torch.full((r + 1, 3), float(r), device=dev))  # uneven: rank s sends s + 1 rows
    for s, piece in enumerate(pieces):
        tally.exact(f"all_gather (uneven) from rank {s}", piece, torch.full((s + 1, 3), float(s)))
    out = torch.empty(2 * w, dtype=torch.int32, device=dev)
    group.all_gather(torch.full((2,), r, dtype=torch.int32, device=dev), out=out)
    tally.exact("all_gather out=", out, torch.arange(w, dtype=torch.int32).repeat_interleave(2))
    done.append("all_gather")

    # Rank q sends q + 1 + s to rank s, in s + 1 rows: rank r receives the sum over q.
    inputs = [torch.full((s + 1, 2), float(r + 1 + s), device=dev) for s in range(w)]
    got = group.reduce_scatter(inputs)
    tally.exact("reduce_scatter (uneven)", got, torch.full((r + 1, 2), float(tri + w * r)))
    whole = torch.arange(4 * w, dtype=torch.float32, device=dev).reshape(2 * w, 2) * (r + 1)
    got = group.reduce_scatter(list(whole.split(2)))  # consecutive pieces of one tensor: sent in place
    expected = torch.arange(4 * w, dtype=torch.float32).reshape(2 * w, 2)[2 * r : 2 * r + 2] * tri
    tally.exact("reduce_scatter (pieces of one tensor)", got, expected)
    done.append("reduce_scatter")

    # Rank q sends q + d + 1 rows of 10 q + d to rank d.
    got_list = group.all_to_all([torch.full((r + d + 1, 2), float(10 * r + d), device=dev) for d in range(w)])
    for s, piece in enumerate(got_list):
        tally.exact(f"all_to_all from rank {s}", piece, torch.full((s + r + 1, 2), float(10 * s + r)))
    ins = [r + d + 1 for d in range(w)]
    outs = [s + r + 1 for s in range(w)]
    x = torch.cat([torch.full((ins[d], 2), float(10 * r + d), device=dev) for d in range(w)])
    y = group.all_to_all_single(x, output_split_sizes=outs, input_split_sizes=ins)
    tally.exact("all_to_all_single", y, torch.cat([torch.full((outs[s], 2), float(10 * s + r)) for s in range(w)]))
    done.append("all_to_all")

    src = w - 1
    pieces_out = [torch.full((q + 1, 2), float(q), device=dev) for q in range(w)] if r == src else None
    got = group.scatter(pieces_out, src=src)
    # The source's piece stays on its device; elsewhere no tensor names one, so it is the group's.
    tally.exact("scatter", got, torch.full((r + 1, 2), float(r)), dev if r == src else group.device)
    gathered = group.gather(torch.full((r + 1, 2), float(r), device=dev), dst=0)
    for s, piece in enumerate(gathered or []):
        tally.exact(f"gather from rank {s}", piece, torch.full((s + 1, 2), float(s)))
    group.barrier()
    done += ["scatter", "gather", "barrier"]

    x = torch.full((2,), float(r + 1), device=dev, requires_grad=True)
    z = swf.all_reduce(x)
    z.sum().backward()
    tally.exact("nn.functional.all_reduce", z, torch.full((2,), float(tri)))
    assert x.grad is not None
    tally.exact("nn.functional.all_reduce gradient", x.grad, torch.full((2,), float(w)))
    done.append("nn.functional.all_reduce backward")

    # A whole tensor on rank 0, scattered by rows, changed pointwise, resharded by columns (placements
    # reversed), gathered to rank 0 and to every rank; each step against the same steps on the CPU.
    dense = torch.arange(13 * 6, dtype=torch.float32).reshape(13, 6)
    rows = ChunkShardingSpec(dim=0, placements=run.placements(range(w)))
    st = shardwise.shard_tensor(dense.to(dev) if r == 0 else torch.empty(0, device=dev), rows)
    for shard in st.local_shards():
        (o, _), (n, _) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        tally.exact(f"shard_tensor rows {o}..{o + n - 1}", shard.tensor, dense[o : o + n])
    st2 = cast(ShardedTensor, torch.relu(st * 2 - 7))  # pointwise ops on a ShardedTensor give one
    dense2 = torch.relu(dense * 2 - 7)
    cols = ChunkShardingSpec(dim=1, placements=run.placements(list(reversed(range(w)))))
    st2.reshard(cols)
    for shard in st2.local_shards():
        (_, o), (_, n) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        tally.exact(f"reshard columns {o}..{o + n - 1}", shard.tensor, dense2[:, o : o + n])
    full = torch.empty(13, 6, device=dev) if r == 0 else None
    st2.gather(dst=0, out=full)
    if full is not None:
        tally.exact("gather to rank 0", full, dense2)
    tally.exact("full_tensor", st2.full_tensor(), dense2)
    done += ["shard_tensor", "pointwise", "reshard", "ShardedTensor.gather", "full_tensor"]
    return done


def check_nccl(run: Run) -> Outcome:
    """Backend nccl: :func:`collective_suite` on the group's GPU, plus a CPU tensor staged through it."""
    group = run.group
    if run.on_cpu:
        return Outcome("SKIP", "NCCL moves CUDA tensors only; --device cpu")
    if group.backend != "nccl":
        return Outcome("SKIP", f"the group's backend is {group.backend!r}; run with --backend nccl")
    started = time.perf_counter()
    tally = Tally(run.device)
    done = collective_suite(run, tally)
    # A CPU tensor given to an nccl group travels through the GPU and comes back to the CPU.
    h = torch.full((3,), float(group.rank + 1), dtype=torch.bfloat16)
    group.all_reduce(h)
    tally.exact("all_reduce of a CPU tensor (staged)", h, torch.full((3,), float(group.size * (group.size + 1) // 2),
                                                                    dtype=torch.bfloat16), torch.device("cpu"))
    torch.cuda.synchronize(run.device)
    took = time.perf_counter() - started
    return tally.outcome(
        f"world size {group.size}, {_device_name(run.device)}: {tally.compared} results on the GPU equal the CPU "
        f"computation ({', '.join(done)}; plus a CPU tensor staged through the GPU) in {took:.2f} s"
    )


def check_mpi_cuda(run: Run) -> Outcome:
    """Backend mpi: :func:`collective_suite` on CUDA tensors, and whether MPI took them as they are or staged."""
    group = run.group
    if group.backend != "mpi":
        return Outcome("SKIP", f"the group's backend is {group.backend!r}; run under mpiexec -n 2 with --backend mpi")
    from mpi4py import MPI
    from shardwise_mpi._collectives import cuda_aware  # what the mpi plugin itself decides by

    library = " ".join(MPI.Get_library_version().strip().splitlines()[0].split())
    if run.on_cpu:
        how = "CPU tensors (no CUDA path taken)"
    elif cuda_aware():
        how = "CUDA-aware MPI: device pointers passed to MPI"
    else:
        how = "MPI is not CUDA-aware: tensors staged through host memory"
    started = time.perf_counter()
    tally = Tally(run.device)
    done = collective_suite(run, tally)
    if run.device.type == "cuda":
        torch.cuda.synchronize(run.device)
    took = time.perf_counter() - started
    return tally.outcome(
        f"world size {group.size}, {_device_name(run.device)}, {library}; {how}: {tally.compared} results on "
        f"{run.device.type} equal the CPU computation ({', '.join(done)}) in {took:.2f} s"
    )


# -- sharded embeddings against dense ----------------------------------------------------------------


@dataclass(frozen=True)
class EmbCase:
    """One sharded module to compare with its dense twin.

    Attributes:
        name: For messages.
        dim: 0 (row-wise) or 1 (column-wise).
        mode: None for ``nn.Embedding``, else the ``nn.EmbeddingBag`` mode.
        offsets: Bags as 1-D ids with offsets (uneven and empty bags) rather than 2-D ids.
    """

    name: str
    dim: int
    mode: Optional[str] = None
    offsets: bool = False


EMB_CASES = [
    EmbCase("Embedding row-wise", 0),
    EmbCase("Embedding column-wise", 1),
    EmbCase("EmbeddingBag sum row-wise", 0, "sum"),
    EmbCase("EmbeddingBag sum column-wise", 1, "sum"),
    EmbCase("EmbeddingBag mean row-wise (offsets)", 0, "mean", offsets=True),
    EmbCase("EmbeddingBag mean column-wise (offsets)", 1, "mean", offsets=True),
    EmbCase("EmbeddingBag max row-wise", 0, "max"),
    EmbCase("EmbeddingBag max column-wise", 1, "max"),
]

#: Sizes of the embedding check: uneven over 2, 3 and 4 ranks in both dims.
EMB_ROWS, EMB_COLS, EMB_BAGS, EMB_BAG_LEN = 997, 19, 64, 8
PADDING = 3


def _batch(case: EmbCase, rank: int, device: torch.device) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Rank ``rank``'s inputs for ``case`` and the gradient of its output, the same wherever they are made."""
    gen = torch.Generator().manual_seed(1000 + rank)
    if case.mode is None or not case.offsets:
        ids = torch.randint(0, EMB_ROWS, (EMB_BAGS, EMB_BAG_LEN), generator=gen)
        if case.mode is None:
            ids[0, :2] = PADDING  # the padding row is looked up, and gets no gradient
        inputs: tuple[torch.Tensor, ...] = (ids,)
    else:
        lengths = torch.randint(0, 2 * EMB_BAG_LEN, (EMB_BAGS,), generator=gen)
        lengths[1] = 0  # an empty bag
        ids = torch.randint(0, EMB_ROWS, (int(lengths.sum()),), generator=gen)
        inputs = (ids, lengths.cumsum(0) - lengths)
    out_shape = (*inputs[0].shape, EMB_COLS) if case.mode is None else (EMB_BAGS, EMB_COLS)
    grad = torch.randn(out_shape, generator=gen)
    return tuple(t.to(device) for t in inputs), grad.to(device)


def _modules(case: EmbCase, device: torch.device) -> nn.Module:
    """The dense module of ``case``, with the same weights on every rank."""
    torch.manual_seed(7)  # the same dense table on every rank
    if case.mode is None:
        module: nn.Module = nn.Embedding(EMB_ROWS, EMB_COLS, padding_idx=PADDING)
    else:
        module = nn.EmbeddingBag(EMB_ROWS, EMB_COLS, mode=case.mode)
    return module.to(device)


def check_embedding(run: Run) -> Outcome:
    """Sharded embedding modules against their dense twins, forward and backward, at this world size."""
    group, dev = run.group, run.device
    w, me = group.size, group.rank
    started = time.perf_counter()
    tally = Tally(dev)
    for case in EMB_CASES:
        dense = _modules(case, dev)
        sharded = copy.deepcopy(dense)
        spec = ChunkShardingSpec(dim=case.dim, placements=run.placements(range(w)))
        shardwise.shard_parameter(sharded, "weight", spec)
        inputs, grad = _batch(case, me, dev)
        out = sharded(*inputs)
        out.backward(grad)  # collective: every rank calls it
        # The dense twin sees every rank's batch: each rank's shard gradient is that slice of the whole's.
        mine = dense(*inputs)
        for rank in range(w):
            theirs, their_grad = _batch(case, rank, dev)
            (mine if rank == me else dense(*theirs)).backward(their_grad)
        if case.mode is None:
            tally.exact(f"{case.name} forward", out, mine)  # a lookup moves values: exact
        else:
            tally.close(f"{case.name} forward", out, mine)
        weight, dense_grad = sharded.weight, dense.weight.grad
        assert isinstance(weight, ShardedTensor) and isinstance(dense_grad, torch.Tensor)
        for shard in weight.local_shards():
            offsets, sizes = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            window = tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))
            if shard.tensor.grad is None:
                tally.failures.append(f"{case.name}: no gradient on the shard at {offsets}")
                continue
            tally.close(f"{case.name} gradient of the shard at {offsets}", shard.tensor.grad, dense_grad[window])
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    took = time.perf_counter() - started
    return tally.outcome(
        f"world size {w}, {_device_name(dev)}: {len(EMB_CASES)} sharded modules (nn.Embedding; nn.EmbeddingBag "
        f"sum, mean, max; row-wise and column-wise; V={EMB_ROWS}, D={EMB_COLS}) against dense twins, "
        f"{tally.compared} results: lookups exact, bags and gradients max |difference| {tally.worst:.2g} "
        f"(rtol={RTOL:g}, atol={ATOL:g}) in {took:.2f} s"
    )


# -- embedding collection ------------------------------------------------------------------------------


def _collection_batch(tables: Any, rank: int, device: torch.device) -> Any:
    # Imported here: only this check needs shardwise-embedding, and the others run without it.
    from shardwise_embedding import KeyedJaggedTensor

    g = torch.Generator().manual_seed(1000 + rank)
    keys, values, lengths = [], [], []
    for t in tables:
        for f in t.feature_names:
            n = torch.randint(0, 4, (3 + rank,), generator=g)
            keys.append(f)
            lengths.append(n)
            values.append(torch.randint(0, t.num_embeddings, (int(n.sum()),), generator=g))
    weights = torch.rand(int(sum(int(x.sum()) for x in lengths)), generator=g) + 0.5
    kjt = KeyedJaggedTensor.from_lengths_sync(keys, torch.cat(values), torch.cat(lengths), weights=weights)
    return kjt.to(device)


def check_collection(run: Run) -> Outcome:
    """A sharded embedding collection (every sharding type) against the dense one, forward and backward."""
    from shardwise_embedding import (
        EmbeddingBagCollection,
        EmbeddingBagConfig,
        EmbeddingShardingPlan,
        TablePlan,
        make_blocks,
        shard_collection,
    )

    group, dev = run.group, run.device
    w, me = group.size, group.rank
    started = time.perf_counter()
    tally = Tally(dev)
    ranks = list(range(w))
    layouts = {
        "dp": ("data_parallel", ranks, 1),
        "tw": ("table_wise", [w - 1], 1),
        "rw": ("row_wise", ranks, 1),
        "cw": ("column_wise", ranks[::-1], 1),
        "twrw": ("table_row_wise", ranks[: max(1, w // 2)], 1),
        "grid": ("grid", ranks[: 2 * (w // 2)] or [0], 2 if w > 1 else 1),
    }
    sizes = {"dp": (7, 4), "tw": (200, 16), "rw": (5000, 32), "cw": (300, 64), "twrw": (4001, 8), "grid": (999, 32)}
    tables = [
        EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=d, feature_names=[f"{n}_a", f"{n}_b"])
        for n, (r, d) in sizes.items()
    ]
    plans = []
    for t in tables:
        kind, rs, cols = layouts[t.name]
        blocks = make_blocks(kind, t.num_embeddings, t.embedding_dim, rs, cols)
        used = tuple(sorted({b.rank for b in blocks})) if blocks else tuple(ranks)
        plans.append(TablePlan(t.name, kind, used, t.num_embeddings, t.embedding_dim, blocks))
    torch.manual_seed(0)
    dense = EmbeddingBagCollection(tables, device=dev)
    sharded = shard_collection(dense, EmbeddingShardingPlan(w, tuple(plans)), group)
    out = sharded(_collection_batch(tables, me, dev))
    out.values().sum().backward()  # collective: every rank calls it
    for rank in range(w):
        theirs = dense(_collection_batch(tables, rank, dev))
        theirs.values().sum().backward()
        if rank == me:
            tally.close("pooled output", out.values(), theirs.values())
    for t in tables:
        local = sharded.embedding_bags[t.name]
        (r0, r1), (c0, c1) = local.local_block.rows, local.local_block.cols
        if not local.weight.numel():
            continue
        grad = local.weight.grad
        if grad is None:
            tally.failures.append(f"{t.name}: no gradient on this rank's block")
            continue
        grad = grad.to_dense() if grad.is_sparse else grad
        tally.close(f"{t.name} block gradient", grad, dense.embedding_bags[t.name].weight.grad[r0:r1, c0:c1])
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    took = time.perf_counter() - started
    return tally.outcome(
        f"world size {w}, {_device_name(dev)}: {len(tables)} tables (data-parallel, table-wise, row-wise, "
        f"column-wise, table-row-wise, grid; 2 features each, weighted bags) against the dense collection, "
        f"{tally.compared} results, max |difference| {tally.worst:.2g} in {took:.2f} s"
    )


# -- throughput --------------------------------------------------------------------------------------


def _time_per_call(fn: Callable[[], Any], device: torch.device, inner: int) -> float:
    """Milliseconds per call of ``fn``, over ``inner`` calls back to back (CUDA events on a GPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # nothing queued from before counts
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / inner
    begin = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - begin) * 1000 / inner


def _medians(fns: dict[str, Callable[[], Any]], device: torch.device, reps: int, inner: int,
             warmup: int) -> dict[str, float]:
    """Median milliseconds per call of each function; repetitions interleaved so drift hits all alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for rep in range(reps):
        for name in names if rep % 2 == 0 else reversed(names):
            times[name].append(_time_per_call(fns[name], device, inner))
    return {name: statistics.median(ts) for name, ts in times.items()}


def check_throughput(run: Run) -> Outcome:
    """Row-wise sharded ``F.embedding`` timed against the dense op at world size 1; PASS within ``--target``."""
    group, dev, args = run.group, run.device, run.args
    if group.size != 1:
        return Outcome("SKIP", f"measures world size 1; this run has {group.size} ranks (run it under plain python)")
    rows, cols, batch, bag = (50_000, 64, 1024, 32) if args.small else (200_000, 128, 4096, 32)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(rows, cols, generator=gen).to(dev).requires_grad_()
    ids = torch.randint(0, rows, (batch, bag), generator=gen).to(dev)
    grad = torch.randn(batch, bag, cols, generator=gen).to(dev)
    spec = ChunkShardingSpec(dim=0, placements=run.placements([0]))
    st = shardwise.shard_tensor(weight.detach().clone().requires_grad_(), spec)
    (shard,) = [s.tensor for s in st.local_shards()]

    # The timed calls compute the right thing: the same rows, and gradients within tolerance.
    tally = Tally(dev)
    tally.exact("sharded forward", F.embedding(ids, st), F.embedding(ids, weight))
    F.embedding(ids, st).backward(grad)
    F.embedding(ids, weight).backward(grad)
    assert shard.grad is not None and weight.grad is not None
    tally.close("sharded gradient", shard.grad, weight.grad)
    if tally.failures:
        return tally.outcome("")

    def dense_fwd() -> None:
        with torch.no_grad():
            F.embedding(ids, weight)

    def sharded_fwd() -> None:
        with torch.no_grad():
            F.embedding(ids, st)

    def dense_step() -> None:
        weight.grad = None  # both sides allocate a fresh gradient: no accumulation on either
        F.embedding(ids, weight).backward(grad)

    def sharded_step() -> None:
        shard.grad = None
        F.embedding(ids, st).backward(grad)

    inner = args.inner if args.inner else (10 if dev.type == "cuda" else 2)
    fwd = _medians({"dense": dense_fwd, "sharded": sharded_fwd}, dev, args.reps, inner, args.warmup)
    step = _medians({"dense": dense_step, "sharded": sharded_step}, dev, args.reps, inner, args.warmup)
    ratio_fwd, ratio_step = fwd["sharded"] / fwd["dense"], step["sharded"] / step["dense"]
    figures = (
        f"row-wise V={rows} D={cols} ids {batch}x{bag} on {_device_name(dev)}, median of {args.reps} reps x {inner} "
        f"calls ({'CUDA events' if dev.type == 'cuda' else 'wall clock'}): forward dense {fwd['dense']:.3f} ms, "
        f"sharded {fwd['sharded']:.3f} ms, ratio {ratio_fwd:.2f}; forward+backward dense {step['dense']:.3f} ms, "
        f"sharded {step['sharded']:.3f} ms, ratio {ratio_step:.2f}; target <= {args.target:g}"
    )
    if max(ratio_fwd, ratio_step) <= args.target:
        return Outcome("PASS", figures)
    return Outcome("FAIL", figures)


RUNNERS: dict[str, Callable[[Run], Outcome]] = {
    "nccl": check_nccl,
    "mpi-cuda": check_mpi_cuda,
    "embedding": check_embedding,
    "collection": check_collection,
    "throughput": check_throughput,
}


# -- main --------------------------------------------------------------------------------------------


def _say(line: str) -> None:
    """One line in one write, flushed (ranks' lines do not interleave, launchers forward it at once)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _run_one(name: str, run: Run) -> Outcome:
    """Run check ``name``; an exception is its FAIL (with the traceback on stderr), not the program's end."""
    try:
        return RUNNERS[name](run)
    except Exception as exc:  # noqa: BLE001 - any error is this check's failure, reported with the others
        traceback.print_exc(file=sys.stderr)
        return Outcome("FAIL", f"{type(exc).__name__}: {' '.join(str(exc).split())}")


def _verdict(name: str, everyone: list[dict[str, str]], label: str) -> tuple[str, str]:
    """One line for a check from every rank's outcome."""
    statuses = {o["status"] for o in everyone}
    if "FAIL" in statuses:
        details = "; ".join(f"rank {r}: {o['detail']}" for r, o in enumerate(everyone) if o["status"] == "FAIL")
        return "FAIL", f"FAIL {name}: {details}{label}"
    if statuses == {"SKIP"}:
        return "SKIP", f"SKIP {name}: {everyone[0]['detail']}{label}"
    where = "" if len(everyone) == 1 else " (every rank; rank 0's figures)"
    return "PASS", f"PASS {name}: {everyone[0]['detail']}{where}{label}"


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line (see the module docstring), with ``checks`` as a list of names."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--backend", choices=("nccl", "mpi", "gloo"), default=None,
                        help="backend for shardwise.init (default: shardwise's automatic choice)")
    parser.add_argument("--checks", default=",".join(CHECKS),
                        help=f"comma-separated checks to run, of {', '.join(CHECKS)} (default: all)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (default); cpu only exercises this program's logic on a machine without a GPU")
    parser.add_argument("--small", action="store_true", help="small throughput sizes (seconds on a CPU)")
    parser.add_argument("--target", type=float, default=1.2,
                        help="largest sharded/dense time ratio the throughput check accepts (default 1.2)")
    parser.add_argument("--reps", type=int, default=25, help="timed repetitions per variant (median; default 25)")
    parser.add_argument("--inner", type=int, default=0,
                        help="calls per timed repetition (default 10 on a GPU, 2 on a CPU)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls per variant first (default 5)")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds a rendezvous or collective waits for a peer (default 120)")
    args = parser.parse_args(argv)
    checks = [c.strip() for c in args.checks.split(",") if c.strip()]
    unknown = [c for c in checks if c not in CHECKS]
    if unknown or not checks:
        parser.error(f"--checks: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(CHECKS)}")
    if args.reps < 20:
        parser.error("--reps must be at least 20 (the throughput check reports a median)")
    args.checks = checks
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the checks on every rank; rank 0 prints one line per check.

    Returns:
        0 when no check failed (SKIPs included; also without a CUDA device
        and without ``--device cpu``), 1 otherwise.
    """
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only torch build" if torch.version.cuda is None else "no GPU visible"
        _say(f"SKIP: no CUDA device ({build}, torch {torch.__version__}); nothing checked. "
             "--device cpu runs this program's logic on the CPU")
        return 0
    try:
        group = shardwise.init(args.backend, timeout=args.timeout)
    except Exception as exc:  # noqa: BLE001 - reported as the run's failure, with the reason
        _say(f"FAIL init: shardwise.init({args.backend!r}) raised {type(exc).__name__}: {' '.join(str(exc).split())}")
        return 1
    try:
        device = _pick_device(group, args.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        run = Run(group, device, [str(d) for d in group.exchange(str(device))], args)
        label = " [--device cpu: the program's logic on the CPU, not a GPU check]" if run.on_cpu else ""
        if group.rank == 0:
            cuda = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA"
            _say(f"check_gpu: torch {torch.__version__} ({cuda}), backend {group.backend}, world size {group.size}, "
                 f"devices {', '.join(run.devices)}{label}")
        failed = False
        for name in args.checks:
            outcome = _run_one(name, run)
            everyone = group.exchange({"status": outcome.status, "detail": outcome.detail})
            status, line = _verdict(name, everyone, label)
            failed = failed or status == "FAIL"
            if group.rank == 0:
                _say(line)
    finally:
        shardwise.destroy()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
