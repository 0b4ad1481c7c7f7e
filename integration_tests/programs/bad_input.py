"""A battery of bad calls across the public API, run by every rank of a real launch.

    torchrun --standalone --nproc-per-node 2 bad_input.py [WORKDIR]   # backend gloo
    mpiexec -n 2 python bad_input.py [WORKDIR]                         # backend mpi

Each entry of :data:`CASES` makes one bad call (specs, placements, metadata,
shard/reshard/gather, plans and Sharders, embedding ops, checkpoints,
backend selection, exchange, collectives) together with what every rank
must raise. Many are *rank-divergent*: only one rank passes the bad value,
and then that rank must raise the real error while its peers raise
:class:`~shardwise.errors.PeerError` naming it (or every rank raises the
same error, where the library agrees on the verdict) — never one rank
raising while another waits.

The program runs the cases one after another and prints one line per case
and rank, each in a single ``write``::

    CASE <name> rank <r> <seconds>s: <ExceptionType>: <message on one line>
    CASE <name> rank <r> <seconds>s: NO ERROR
    CASE <name> rank <r> 0.000s: SKIPPED: <why>

then ``rank <r>: battery done, <n> cases``. A barrier between cases keeps
the ranks in step, so a case that leaves a rank stuck ends the job (the
group's timeout, ``SHARDWISE_TIMEOUT``, or the test's hard limit) and is
the first case without every rank's line, never a later case's failure.
The program does not judge the outcomes: ``integration_tests/test_bad_input.py``
imports :data:`CASES` and checks every line against :func:`expected` —
the one place the expectations live. A case the library does not pass yet
says why in ``known_bug`` (the test makes it a strict xfail).

Cases tagged ``before_init`` run before ``shardwise.init()`` (backend
selection must fail before any process group exists); the others run after
it, on the default group of 2 ranks.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

import shardwise
import shardwise.checkpoint
import shardwise.nn.functional as swf
from shardwise import (
    ChunkShardingSpec,
    EnumerableShardingSpec,
    Group,
    Shard,
    ShardMetadata,
    ShardedTensor,
    Sharder,
    ShardingPlan,
    shard_module,
    shard_parameter,
    shard_tensor,
)
from shardwise._session.runtime import detect
from shardwise.sharded_tensor import init_from_local_shards, zeros

__all__ = ["CASES", "LINE", "SOME_RANK", "Case", "Ctx", "Expect", "culprit_of", "expected", "main"]

#: How a case line looks; the test parses it with this pattern.
LINE = r"^CASE (?P<name>\S+) rank (?P<rank>\d+) (?P<elapsed>[0-9.]+)s: (?P<outcome>.*)$"
#: The rank with the bad input in rank-divergent cases (the last rank of 2, so rank 0 is the peer).
CULPRIT = 1
#: ``Case.culprit`` for a failure on exactly one rank that the library picks (which rank writes a value).
SOME_RANK = -1
#: Rows and columns of the tensors the cases shard (both even over 2 ranks: any unevenness is a case's own).
ROWS, COLS = 6, 4


@dataclass(frozen=True)
class Expect:
    """What one rank must raise.

    Attributes:
        error: A regex the exception's class name must match in full (a subclass's name does not pass).
        pattern: A regex searched (``re.search``, case-insensitive) in the message.
    """

    error: str
    pattern: str


@dataclass
class Ctx:
    """What a case may use: this rank, its group, a work directory and shared fixtures."""

    rank: int
    size: int
    group: Optional[Group]
    workdir: Path

    @property
    def places(self) -> list[str]:
        return [f"rank:{r}/cpu" for r in range(self.size)]

    def rows(self) -> ChunkShardingSpec:
        return ChunkShardingSpec(0, self.places)

    def cols(self) -> ChunkShardingSpec:
        return ChunkShardingSpec(1, self.places)

    def dense(self) -> torch.Tensor:
        return torch.arange(float(ROWS * COLS)).view(ROWS, COLS)

    def sharded(self, spec: Optional[ChunkShardingSpec] = None) -> ShardedTensor:
        """A fresh ``[ROWS, COLS]`` ShardedTensor (row-wise unless ``spec``); every rank calls it."""
        return shard_tensor(self.dense(), spec or self.rows(), src_rank=0)

    @property
    def checkpoint(self) -> Path:
        """A checkpoint of ``{"w": sharded(), "step": 3}`` saved by :func:`_save_checkpoint`."""
        return self.workdir / "ckpt"

    def culprit(self) -> bool:
        return self.rank == CULPRIT


@dataclass(frozen=True)
class Case:
    """One bad call and what every rank must raise.

    Attributes:
        name: Unique, ``area_what``.
        run: Called on every rank with the :class:`Ctx`; it makes the bad call.
        expect: What the rank(s) at fault raise; with ``culprit=None``, every rank.
        culprit: The only rank with bad input, None when every rank raises ``expect``, or
            :data:`SOME_RANK` when exactly one rank fails but the library decides which.
        peers: What the other ranks raise when there is a culprit; None means
            :class:`~shardwise.errors.PeerError` naming the culprit.
        before_init: Run before ``shardwise.init()`` (no group exists yet).
        needs: Modules that must be importable; otherwise the case is skipped.
        known_bug: Why the library does not meet ``expect`` yet (the test marks the case
            as a strict xfail, so fixing the bug makes it fail until this is removed).
    """

    name: str
    run: Callable[[Ctx], Any]
    expect: Expect
    culprit: Optional[int] = None
    peers: Optional[Expect] = None
    before_init: bool = False
    needs: tuple[str, ...] = ()
    known_bug: str = ""


def culprit_of(case: Case, raised: dict[int, str]) -> Optional[int]:
    """The rank at fault in ``case``, given the class name each rank raised (for :data:`SOME_RANK` cases)."""
    if case.culprit != SOME_RANK:
        return case.culprit
    peer = (case.peers or Expect("PeerError", "")).error
    at_fault = [r for r, kind in sorted(raised.items()) if kind != peer]
    return at_fault[0] if len(at_fault) == 1 else None  # else every rank is held to ``expect``: a failure


def expected(case: Case, rank: int, culprit: Optional[int]) -> Expect:
    """What ``rank`` must raise in ``case`` when ``culprit`` (from :func:`culprit_of`) is at fault."""
    if culprit is None or rank == culprit:
        return case.expect
    if case.peers is not None:
        return Expect(case.peers.error, case.peers.pattern.replace("{culprit}", str(culprit)))
    return Expect("PeerError", rf"\brank {culprit}\b")


def _on_culprit(ctx: Ctx, bad: Any, good: Any) -> Any:
    """``bad`` on the culprit rank, ``good`` elsewhere."""
    return bad if ctx.culprit() else good


def _per_rank(ctx: Ctx, *values: Any) -> Any:
    """``values[rank]``: every rank passes its own value."""
    return values[ctx.rank]


# -- backend selection (before init) --------------------------------------------------------------------------


def _init_with(**env: str) -> Callable[[Ctx], Any]:
    def run(ctx: Ctx) -> Any:
        return shardwise.init(environ={**os.environ, **env})

    return run


def _init_twice(ctx: Ctx) -> Any:
    return shardwise.init()


# -- specs, placements, metadata --------------------------------------------------------------------------------


def _enumerable(*boxes: tuple[int, int]) -> Callable[[Ctx], EnumerableShardingSpec]:
    """A spec of row blocks ``(start, length)`` of a ``[ROWS, COLS]`` tensor, placed round robin."""

    def build(ctx: Ctx) -> EnumerableShardingSpec:
        return EnumerableShardingSpec(
            [ShardMetadata([start, 0], [n, COLS], ctx.places[i % ctx.size]) for i, (start, n) in enumerate(boxes)]
        )

    return build


def _shard_with(spec_of: Callable[[Ctx], Any], src_rank: Callable[[Ctx], Any] = lambda ctx: 0) -> Callable[[Ctx], Any]:
    def run(ctx: Ctx) -> Any:
        return shard_tensor(ctx.dense(), spec_of(ctx), src_rank=src_rank(ctx))

    return run


def _local_shards(ctx: Ctx, boxes: dict[int, list[tuple[list[int], list[int]]]], *size: int, **kw: Any) -> Any:
    """``init_from_local_shards`` with rank r passing shards at ``boxes[r]`` ``(offsets, sizes)``."""
    dtype = kw.get("dtype", torch.float32)
    place = kw.get("place", ctx.rank)
    shards = [
        Shard(torch.zeros(sizes, dtype=dtype), ShardMetadata(offsets, sizes, f"rank:{place}/cpu"))
        for offsets, sizes in boxes.get(ctx.rank, [])
    ]
    return init_from_local_shards(shards, *size)


def _no_such_cuda() -> str:
    """A CUDA device no rank has on this host: ``cuda:0`` without CUDA, else one past the last GPU."""
    return f"cuda:{torch.cuda.device_count()}"


def _cuda_everywhere(ctx: Ctx) -> ChunkShardingSpec:
    """Row chunks, every rank's on a CUDA device it does not have."""
    return ChunkShardingSpec(0, [f"rank:{r}/{_no_such_cuda()}" for r in range(ctx.size)])


def _cuda_on_culprit(ctx: Ctx) -> ChunkShardingSpec:
    """Row chunks, the same spec on every rank: rank 0's on the CPU, the culprit's on a CUDA device it lacks."""
    return ChunkShardingSpec(0, ["rank:0/cpu", f"rank:{CULPRIT}/{_no_such_cuda()}"])


def _cuda_enumerable_on_culprit(ctx: Ctx) -> EnumerableShardingSpec:
    return EnumerableShardingSpec(
        [
            ShardMetadata([0, 0], [3, COLS], "rank:0/cpu"),
            ShardMetadata([3, 0], [3, COLS], f"rank:{CULPRIT}/{_no_such_cuda()}"),
        ]
    )


#: What the rank given a CUDA placement it cannot use raises: it names the placement and why.
NO_CUDA = rf"placement 'rank:{CULPRIT}/cuda:\d+' names device cuda:\d+, which rank {CULPRIT} cannot use: "


# -- reshard / gather -----------------------------------------------------------------------------------------


def _reshard_to(spec_of: Callable[[Ctx], Any]) -> Callable[[Ctx], Any]:
    def run(ctx: Ctx) -> Any:
        st = ctx.sharded()
        return st.reshard(spec_of(ctx))

    return run


def _gather(dst: Callable[[Ctx], Any], out: Callable[[Ctx, Any], Any]) -> Callable[[Ctx], Any]:
    def run(ctx: Ctx) -> Any:
        st = ctx.sharded()
        d = dst(ctx)
        return st.gather(dst=d, out=out(ctx, d))

    return run


def _full_out(ctx: Ctx, dst: Any) -> Optional[torch.Tensor]:
    return torch.empty(ROWS, COLS) if dst == ctx.rank else None


def _int_out(ctx: Ctx, dst: Any) -> Optional[torch.Tensor]:
    return torch.empty(ROWS, COLS, dtype=torch.int32) if dst == ctx.rank else None


def _size_differs_then(op: str) -> Callable[[Ctx], Any]:
    """Every rank builds "the same" ShardedTensor with its own size (no communication), then calls ``op``."""

    def run(ctx: Ctx) -> Any:
        st = zeros(ctx.rows(), ROWS + ctx.rank, COLS)
        if op == "reshard":
            return st.reshard(ctx.cols())
        if op == "gather":
            return st.gather(dst=0, out=torch.empty(tuple(st.size())) if ctx.rank == 0 else None)
        return st.full_tensor()

    return run


# -- plans and Sharders ---------------------------------------------------------------------------------------


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(COLS, ROWS)
        self.fc2 = nn.Linear(ROWS, COLS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x))


class _NotAModuleSharder(Sharder):
    """A broken Sharder: returns a tensor instead of the replacement module."""

    def shard(self, module: nn.Module) -> Any:
        return torch.zeros(1)


class _IdentitySharder(Sharder):
    def shard(self, module: nn.Module) -> nn.Module:
        return module


def _shard_module(plan_of: Callable[[Ctx], Any]) -> Callable[[Ctx], Any]:
    def run(ctx: Ctx) -> Any:
        return shard_module(_Net(), plan_of(ctx))

    return run


# -- embedding ------------------------------------------------------------------------------------------------


def _embedding(ids_of: Callable[[Ctx], Any], spec: Callable[[Ctx], str] = lambda ctx: "rows", **kw: Any) -> Any:
    def run(ctx: Ctx) -> Any:
        weight = ctx.sharded(ctx.rows() if spec(ctx) == "rows" else ctx.cols())
        options = {k: (v(ctx) if callable(v) else v) for k, v in kw.items()}
        return F.embedding(ids_of(ctx), weight, **options)

    return run


def _bag(ids_of: Callable[[Ctx], Any], offsets_of: Callable[[Ctx], Any], **kw: Any) -> Callable[[Ctx], Any]:
    def run(ctx: Ctx) -> Any:
        weight = ctx.sharded()
        options = {k: (v(ctx) if callable(v) else v) for k, v in kw.items()}
        return F.embedding_bag(ids_of(ctx), weight, offsets_of(ctx), **options)

    return run


def _good_ids(ctx: Ctx) -> torch.Tensor:
    return torch.tensor([[0, 5], [3, 2]]) if ctx.rank == 0 else torch.tensor([1, 4, 4])


def _good_bag_ids(ctx: Ctx) -> torch.Tensor:
    return torch.tensor([0, 5, 3, 2]) if ctx.rank == 0 else torch.tensor([1, 4, 4])


def _good_offsets(ctx: Ctx) -> torch.Tensor:
    return torch.tensor([0, 2])


def _embedding_enumerable(ctx: Ctx) -> Any:
    spec = _enumerable((0, 3), (3, 3))(ctx)
    return F.embedding(_good_ids(ctx), shard_tensor(ctx.dense(), spec))


# -- checkpoints ----------------------------------------------------------------------------------------------


def _save_checkpoint(ctx: Ctx) -> None:
    """The checkpoint the load cases read (saved once, before the cases)."""
    shardwise.checkpoint.save({"w": ctx.sharded(), "step": 3}, ctx.checkpoint)


def _load(path_of: Callable[[Ctx], Path], state_of: Callable[[Ctx], dict[str, Any]]) -> Callable[[Ctx], Any]:
    def run(ctx: Ctx) -> Any:
        return shardwise.checkpoint.load(state_of(ctx), path_of(ctx))

    return run


def _other_size_state(ctx: Ctx) -> dict[str, Any]:
    return {"w": shard_tensor(torch.zeros(ROWS + 2, COLS), ctx.rows()), "step": 0}


def _save_under_a_file(ctx: Ctx) -> Any:
    blocker = ctx.workdir / "a_file"
    if ctx.rank == 0:
        blocker.write_text("not a directory")
    assert ctx.group is not None
    ctx.group.barrier()  # the file exists before any rank tries to save under it
    return shardwise.checkpoint.save({"w": ctx.sharded()}, blocker / "ckpt")


def _save_unpicklable(ctx: Ctx) -> Any:
    # A plain (non-tensor) value is written by the lowest rank only: the failure is on rank 0.
    return shardwise.checkpoint.save({"w": ctx.sharded(), "fn": (lambda: None)}, ctx.workdir / "ckpt_fn")


# -- collectives ----------------------------------------------------------------------------------------------


def _group(ctx: Ctx) -> Group:
    assert ctx.group is not None
    return ctx.group


def _different_collectives(ctx: Ctx) -> Any:
    g = _group(ctx)
    return g.barrier() if ctx.rank == 0 else g.all_reduce(torch.ones(4))


def _all_to_all_single_wrong_receive(ctx: Ctx) -> Any:
    # Every rank sends 2 rows to each; rank 1 claims it will receive 3 from rank 0.
    outs = [2, 2] if ctx.rank == 0 else [3, 1]
    return _group(ctx).all_to_all_single(torch.zeros(4), output_split_sizes=outs, input_split_sizes=[2, 2])


def _after_bad_peer(ctx: Ctx) -> Any:
    """A bad all_reduce on rank 1 and then a good one: the group stays usable (no error at all)."""
    g = _group(ctx)
    try:
        g.all_reduce(torch.ones(2), op="median" if ctx.culprit() else "sum")
    except Exception:  # noqa: BLE001 - the earlier cases check this error; here only what follows matters
        pass
    t = g.all_reduce(torch.full((3,), float(ctx.rank + 1)))
    if t.tolist() != [3.0, 3.0, 3.0]:
        raise AssertionError(f"all_reduce after a rejected call gave {t.tolist()}")
    raise LookupError("group still usable")  # a marker: the test expects exactly this


def _allclose_layout_differs(ctx: Ctx) -> Any:
    """Two zero tensors, laid out alike except on the culprit: it alone knows the answer is False."""
    other = zeros(_on_culprit(ctx, ctx.cols(), ctx.rows()), ROWS, COLS)
    return _report("allclose", torch.allclose(zeros(ctx.rows(), ROWS, COLS), other))


def _report(what: str, value: Any) -> Any:
    """Make a value the case's outcome (the battery records exceptions): ``LookupError: <what> returned <value>``."""
    raise LookupError(f"{what} returned {value}")


# -- the table ------------------------------------------------------------------------------------------------

E = Expect

CASES: list[Case] = [
    # -- backend selection ---------------------------------------------------------------------------------------
    Case(
        "init_unknown_backend",
        lambda ctx: shardwise.init("no-such-backend"),
        E("BackendNotFoundError", r"'no-such-backend' is not installed; installed: .*\bgloo\b"),
        before_init=True,
    ),
    Case(
        "init_unknown_backend_env",
        _init_with(SHARDWISE_BACKEND="no-such-backend"),
        E("BackendNotFoundError", r"'no-such-backend' is not installed; installed: .*\bgloo\b"),
        before_init=True,
    ),
    Case(
        "init_negative_timeout",
        lambda ctx: shardwise.init(timeout=-5),
        E("ValueError", r"timeout must be positive, got -5 s"),
        before_init=True,
    ),
    Case(
        "init_bad_timeout_env",
        _init_with(SHARDWISE_TIMEOUT="soon"),
        E("LaunchError", r"SHARDWISE_TIMEOUT='soon' is not a number"),
        before_init=True,
    ),
    Case(
        "init_rank_outside_world",
        _init_with(RANK="5", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="1"),
        # "torchrun: ..." under torchrun, "env: ..." (RANK set by hand) under mpiexec.
        E("LaunchError", r"^(torchrun|env): rank 5 is outside \[0, 2\) \(from the torchrun launcher's environment"),
        before_init=True,
    ),
    Case(
        "default_group_before_init",
        lambda ctx: shardwise.get_default_group(),
        E("LaunchError", r"no default group: call shardwise.init\(\) first"),
        before_init=True,
    ),
    Case("init_twice", _init_twice, E("LaunchError", r"already called \(backend '\w+', rank \d of 2\)")),
    # -- sharding specs ----------------------------------------------------------------------------------------
    Case(
        "spec_chunk_dim_not_int",
        lambda ctx: ChunkShardingSpec(0.5, ctx.places),  # type: ignore[arg-type]
        # A TypeError and, as torch raises here, a ValueError.
        E("InvalidArgumentError", r"dim must be an int, got 0\.5"),
    ),
    Case(
        "spec_chunk_empty_placements",
        lambda ctx: ChunkShardingSpec(0, []),
        E("ValueError", r"needs at least one placement"),
    ),
    Case(
        "spec_chunk_placements_not_a_list",
        lambda ctx: ChunkShardingSpec(0, "rank:0/cpu"),
        E("TypeError", r"placements must be a list"),
    ),
    Case(
        "spec_chunk_dim_out_of_range",
        _shard_with(lambda ctx: ChunkShardingSpec(2, ctx.places)),
        E("ValueError", r"cannot shard a tensor of size \[6, 4\] with ChunkShardingSpec\(dim=2.*cannot shard dim 2"),
    ),
    Case(
        "spec_enumerable_overlap",
        _enumerable((0, 4), (3, 3)),
        E("ValueError", r"shards 0 \(offsets=\[0, 0\] sizes=\[4, 4\].*\) and 1 \(offsets=\[3, 0\] .*\) overlap"),
    ),
    Case(
        "spec_enumerable_gap",
        _shard_with(_enumerable((0, 2), (3, 3))),
        E("ValueError", r"do not cover the tensor of size \[6, 4\]: they hold 20 of its 24 elements"),
    ),
    Case(
        "spec_enumerable_ndims_differ",
        lambda ctx: EnumerableShardingSpec([ShardMetadata([0, 0], [3, 4]), ShardMetadata([3], [3])]),
        E("ValueError", r"same number of dimensions"),
    ),
    Case(
        "spec_differs_between_ranks",
        _shard_with(lambda ctx: ctx.cols() if ctx.culprit() else ctx.rows()),
        E("ValueError", r"ranks disagree on the sharding spec"),
    ),
    # -- placements --------------------------------------------------------------------------------------------
    Case(
        "placement_malformed",
        # ("rank0/cpu" names an RPC worker, a form torch accepts; "rnk:0" is no form at all.)
        lambda ctx: ChunkShardingSpec(0, ["rnk:0/cpu", "rank:1/cpu"]),
        E("ValueError", r"invalid placement 'rnk:0/cpu': expected 'rank:R' before the '/'"),
    ),
    Case(
        "placement_bad_device",
        lambda ctx: ChunkShardingSpec(0, ["rank:0/gpu", "rank:1/cpu"]),
        # A ValueError and, as torch raises for a bad device, a RuntimeError.
        E("PlacementError", r"invalid placement 'rank:0/gpu': 'gpu' is not a torch device"),
    ),
    Case(
        "placement_negative_rank",
        lambda ctx: ChunkShardingSpec(0, ["rank:-1/cpu"]),
        E("ValueError", r"invalid placement 'rank:-1/cpu': rank must be >= 0"),
    ),
    Case(
        "placement_rank_outside_group",
        _shard_with(lambda ctx: ChunkShardingSpec(0, ["rank:0/cpu", "rank:2/cpu"])),
        E("ValueError", r"placed on rank 2, but the group has 2 rank\(s\)"),
    ),
    Case(
        "placement_rank_outside_group_on_creation",
        lambda ctx: zeros(ChunkShardingSpec(0, ["rank:0/cpu", "rank:7/cpu"]), ROWS, COLS),
        E("ValueError", r"placed on rank 7, but the group has 2 rank\(s\)"),
    ),
    Case(
        "placement_device_unusable_everywhere",
        # Every rank is given a CUDA device it does not have: each raises before any data moves.
        _shard_with(_cuda_everywhere),
        E(
            "PlacementError",
            r"placement 'rank:\d/cuda:\d+' names device cuda:\d+, which rank \d cannot use: "
            r"(this torch .* was built without CUDA \(Torch not compiled with CUDA enabled\)|"
            r".*invalid device ordinal)",
        ),
    ),
    Case(
        "placement_device_unusable_on_one_rank",
        _shard_with(_cuda_on_culprit),
        E("PlacementError", NO_CUDA),
        culprit=CULPRIT,
        peers=E("PeerError", r"^shard_tensor: rank 1 \(ValueError\) rejected its arguments.*cuda:\d+, which rank 1 "),
    ),
    Case(
        "placement_device_unusable_enumerable_on_one_rank",
        _shard_with(_cuda_enumerable_on_culprit),
        E("PlacementError", NO_CUDA),
        culprit=CULPRIT,
        peers=E("PeerError", r"^shard_tensor: rank 1 \(ValueError\) rejected its arguments"),
    ),
    Case(
        "placement_device_unusable_on_creation_on_one_rank",
        lambda ctx: zeros(_cuda_on_culprit(ctx), ROWS, COLS),
        E("PlacementError", NO_CUDA),
        culprit=CULPRIT,
        peers=E("PeerError", r"^ShardedTensor: rank 1 \(ValueError\) rejected its arguments"),
    ),
    Case(
        "placement_device_unusable_on_reshard_on_one_rank",
        _reshard_to(_cuda_on_culprit),
        E("PlacementError", NO_CUDA),
        culprit=CULPRIT,
        peers=E("PeerError", r"^reshard: rank 1 \(ValueError\) rejected its arguments"),
    ),
    Case(
        "placement_device_unusable_shard_parameter_on_one_rank",
        lambda ctx: shard_parameter(_Net().fc1, "weight", _cuda_on_culprit(ctx)),
        E("PlacementError", NO_CUDA),
        culprit=CULPRIT,
        peers=E("PeerError", r"^shard_tensor: rank 1 \(ValueError\) rejected its arguments"),
    ),
    # -- metadata ----------------------------------------------------------------------------------------------
    Case(
        "metadata_negative_size",
        lambda ctx: ShardMetadata([0, 0], [-1, COLS], "rank:0/cpu"),
        # torch 2.13 raises ValueError("shard_sizes should be >= 0"); the message carries its wording too.
        E("ValueError", r"shard_sizes must be >= 0 \(shard_sizes should be >= 0\), got \[-1, 4\]"),
    ),
    Case(
        "metadata_ndims_differ",
        lambda ctx: ShardMetadata([0], [ROWS, COLS], "rank:0/cpu"),
        E("ValueError", r"same number of dimensions.*offsets \[0\] and sizes \[6, 4\]"),
    ),
    Case(
        "metadata_not_integers",
        lambda ctx: ShardMetadata([0, 0.5], [ROWS, COLS]),
        E("TypeError", r"shard_offsets must be integers, got 0\.5"),
    ),
    Case(
        "local_shards_global_size_differs",
        lambda ctx: _local_shards(ctx, {0: [([0, 0], [3, 4])], 1: [([3, 0], [3, 4])]}, ROWS + ctx.rank, COLS),
        E("ValueError", r"ranks disagree on the global size"),
    ),
    Case(
        "local_shards_dtype_differs",
        lambda ctx: _local_shards(
            ctx, {0: [([0, 0], [3, 4])], 1: [([3, 0], [3, 4])]}, ROWS, COLS,
            dtype=torch.float64 if ctx.culprit() else torch.float32,
        ),
        E("ValueError", r"ranks disagree on the tensor properties.*float64"),
    ),
    Case(
        "local_shards_placed_on_other_rank",
        lambda ctx: _local_shards(ctx, {0: [([0, 0], [3, 4])], 1: [([3, 0], [3, 4])]}, ROWS, COLS, place=0),
        E("ValueError", r"placed on rank:0/cpu, but it was passed on rank 1"),
        culprit=CULPRIT,
    ),
    Case(
        "local_shards_overlap",
        lambda ctx: _local_shards(ctx, {0: [([0, 0], [4, 4])], 1: [([3, 0], [3, 4])]}, ROWS, COLS),
        E("ValueError", r"overlap"),
    ),
    Case(
        "local_shards_gap",
        lambda ctx: _local_shards(ctx, {0: [([0, 0], [2, 4])], 1: [([3, 0], [3, 4])]}, ROWS, COLS),
        E("ValueError", r"do not cover the tensor of size \[6, 4\]"),
    ),
    # -- shard_tensor ------------------------------------------------------------------------------------------
    Case(
        "shard_src_rank_outside_group",
        _shard_with(lambda ctx: ctx.rows(), lambda ctx: 2),
        E("ValueError", r"src_rank=2 is not a rank of the group \(size 2"),
    ),
    Case(
        "shard_src_rank_outside_group_on_one_rank",
        _shard_with(lambda ctx: ctx.rows(), lambda ctx: _on_culprit(ctx, 7, 0)),
        E("ValueError", r"src_rank=7 is not a rank of the group"),
        culprit=CULPRIT,
        peers=E("PeerError", r"^shard_tensor: rank 1 \(ValueError\) rejected its arguments"),
    ),
    Case(
        "shard_src_rank_differs",
        _shard_with(lambda ctx: ctx.rows(), lambda ctx: ctx.rank),
        E("ValueError", r"ranks disagree on the src_rank: rank 0 passed 0, rank 1 passed 1"),
    ),
    Case(
        "shard_spec_not_a_spec_on_one_rank",
        _shard_with(lambda ctx: _on_culprit(ctx, "rows", ctx.rows())),
        E("TypeError", r"sharding_spec must be a ShardingSpec, got str"),
        culprit=CULPRIT,
    ),
    Case(
        "shard_not_a_tensor_on_one_rank",
        lambda ctx: shard_tensor(_on_culprit(ctx, [1.0, 2.0], ctx.dense()), ctx.rows()),
        E("TypeError", r"shard_tensor takes a plain torch.Tensor, got list"),
        culprit=CULPRIT,
    ),
    Case(
        "shard_non_contiguous_on_one_rank",
        lambda ctx: shard_tensor(_on_culprit(ctx, ctx.dense().t(), ctx.dense()), ctx.rows()),
        E("ValueError", r"input tensor on rank 1 is not a contiguous Tensor"),
        culprit=CULPRIT,
    ),
    # -- reshard / gather / full_tensor --------------------------------------------------------------------------
    Case(
        "reshard_rank_outside_group",
        _reshard_to(lambda ctx: ChunkShardingSpec(1, ["rank:0/cpu", "rank:2/cpu"])),
        E("ValueError", r"cannot reshard a tensor of size \[6, 4\].*placed on rank 2, but the group has 2"),
    ),
    Case(
        "reshard_rank_outside_group_on_one_rank",
        _reshard_to(lambda ctx: ChunkShardingSpec(1, ["rank:0/cpu", f"rank:{2 if ctx.culprit() else 1}/cpu"])),
        E("ValueError", r"placed on rank 2, but the group has 2"),
        culprit=CULPRIT,
    ),
    Case(
        "reshard_not_a_spec_on_one_rank",
        _reshard_to(lambda ctx: _on_culprit(ctx, {"dim": 1}, ctx.cols())),
        E("TypeError", r"reshard takes a ShardingSpec, got dict"),
        culprit=CULPRIT,
        peers=E("PeerError", r"^reshard: rank 1 \(TypeError\) rejected its arguments"),
    ),
    Case(
        "reshard_spec_differs",
        _reshard_to(lambda ctx: _on_culprit(ctx, ctx.cols(), ctx.rows())),
        E("ValueError", r"ranks disagree on the resharding spec"),
    ),
    Case(
        "reshard_size_differs_between_ranks",
        _size_differs_then("reshard"),
        E("ValueError", r"ranks disagree on the tensor's layout"),
    ),
    Case(
        "gather_size_differs_between_ranks",
        _size_differs_then("gather"),
        E("ValueError", r"ranks disagree on the tensor's layout"),
    ),
    Case(
        "full_tensor_size_differs_between_ranks",
        _size_differs_then("full_tensor"),
        E("ValueError", r"ranks disagree on the tensor's layout .* this rank's has size \[[67], 4\]"),
    ),
    Case(
        "gather_dst_outside_group",
        _gather(lambda ctx: 2, lambda ctx, dst: None),
        E("ValueError", r"dst=2 is not a rank of the group \(size 2\)"),
    ),
    Case(
        "gather_dst_outside_group_on_one_rank",
        _gather(lambda ctx: _on_culprit(ctx, -1, 0), _full_out),
        E("ValueError", r"dst=-1 is not a rank of the group"),
        culprit=CULPRIT,
        peers=E("PeerError", r"^gather: rank 1 \(ValueError\) rejected its arguments"),
    ),
    Case(
        "gather_dst_differs",
        _gather(lambda ctx: ctx.rank, _full_out),
        E("ValueError", r"ranks disagree on the gather dst: rank 0 passed 0, rank 1 passed 1"),
    ),
    Case(
        "gather_out_wrong_size_on_dst",
        _gather(lambda ctx: 1, lambda ctx, dst: torch.empty(ROWS, COLS + 1) if ctx.rank == dst else None),
        E("ValueError", r"``out`` has size \(6, 5\), but should be \(6, 4\)"),
        culprit=1,
    ),
    Case(
        "gather_out_missing_on_dst",
        _gather(lambda ctx: 0, lambda ctx, dst: None),
        E("ValueError", r"``out`` must be specified on destination rank 0"),
        culprit=0,
    ),
    Case(
        "gather_out_dtype_loses_values",
        _gather(lambda ctx: 0, _int_out),
        E("ValueError", r"cannot write torch.float32 data into ``out`` of dtype torch.int32"),
    ),
    # -- sharded ops ---------------------------------------------------------------------------------------------
    Case(
        "op_not_implemented",
        lambda ctx: torch.matmul(ctx.sharded(), ctx.sharded(ctx.cols())),
        E("OpNotFoundError", r"matmul"),
    ),
    Case(
        "equal_plain_operand_shape_differs",
        lambda ctx: _report("equal", torch.equal(ctx.sharded(), _on_culprit(ctx, ctx.dense()[:-1], ctx.dense()))),
        E("LookupError", r"^equal returned False$"),
    ),
    Case(
        "equal_fails_on_one_rank",
        lambda ctx: torch.equal(ctx.sharded(), torch.ones(ROWS, COLS, device=_on_culprit(ctx, "meta", "cpu"))),
        E("NotImplementedError", r"meta"),
        culprit=CULPRIT,
        peers=E("PeerError", r"^torch.equal: rank 1 \(NotImplementedError\) rejected its arguments"),
    ),
    Case(
        "allclose_layout_differs_on_one_rank",
        _allclose_layout_differs,
        E("LookupError", r"^allclose returned False$"),
    ),
    # -- plans and Sharders --------------------------------------------------------------------------------------
    Case(
        "plan_unknown_module_path",
        _shard_module(lambda ctx: ShardingPlan(plan={"fc3.weight": ctx.rows()})),
        E("AttributeError", r"ShardingPlan names what _Net does not have: 'fc3.weight' \(no submodule 'fc3'\)"),
    ),
    Case(
        "plan_unknown_module_path_on_one_rank",
        _shard_module(lambda ctx: ShardingPlan(plan={_on_culprit(ctx, "fc1.bais", "fc1.weight"): ctx.rows()})),
        E("AttributeError", r"'fc1.bais' \(Linear has no attribute `bais`\)"),
        culprit=CULPRIT,
    ),
    Case(
        "plan_bad_spec_type",
        _shard_module(lambda ctx: ShardingPlan(plan={"fc1.weight": "rowwise"})),  # type: ignore[dict-item]
        E("TypeError", r"Only `ShardingSpec` and `Sharder` are supported to shard 'fc1.weight', got str"),
    ),
    Case(
        "plan_differs_between_ranks",
        _shard_module(lambda ctx: ShardingPlan(plan={"fc1.weight": _on_culprit(ctx, ctx.cols(), ctx.rows())})),
        E("ValueError", r"ranks passed different plan to shard_module"),
    ),
    Case(
        "plan_entry_inside_sharder",
        _shard_module(lambda ctx: ShardingPlan(plan={"fc1": _IdentitySharder(), "fc1.weight": ctx.rows()})),
        E("RuntimeError", r"parameter entry 'fc1.weight' lies inside submodule 'fc1' of Sharder entry 'fc1'"),
    ),
    Case(
        "plan_sharder_returns_no_module",
        _shard_module(lambda ctx: ShardingPlan(plan={"fc2": _NotAModuleSharder()})),
        E("TypeError", r"_NotAModuleSharder.shard\(\) for 'fc2' returned a Tensor; it must return the nn.Module"),
    ),
    Case(
        "shard_parameter_missing_on_one_rank",
        lambda ctx: shard_parameter(_Net().fc1, _on_culprit(ctx, "wieght", "weight"), ctx.rows()),
        E("AttributeError", r"Linear has no attribute `wieght`"),
        culprit=CULPRIT,
    ),
    # -- embedding ops (shardwise-embedding) ----------------------------------------------------------------------
    Case(
        "embedding_id_out_of_range_on_one_rank",
        _embedding(lambda ctx: _on_culprit(ctx, torch.tensor([2, ROWS]), _good_ids(ctx))),
        # BadIds: shardwise-embedding's IndexError that carries the id, so the peers can name it.
        E("BadIds", r"id 6 in input is out of range for an embedding of 6 rows \(valid ids are 0\.\.5\)"),
        culprit=CULPRIT,
        peers=E("IndexError", r"id 6 on rank 1 out of range for an embedding of the sharded weight; no data was sent"),
        needs=("shardwise_embedding",),
    ),
    Case(
        "embedding_negative_id_on_one_rank",
        _embedding(lambda ctx: _on_culprit(ctx, torch.tensor([-1, 2]), _good_ids(ctx)), spec=lambda ctx: "cols"),
        E("BadIds", r"id -1 in input is out of range for an embedding of 6 rows"),
        culprit=CULPRIT,
        peers=E("IndexError", r"id -1 on rank 1 out of range for an embedding of the sharded weight"),
        needs=("shardwise_embedding",),
    ),
    Case(
        "embedding_float_ids_on_one_rank",
        _embedding(lambda ctx: _on_culprit(ctx, _good_ids(ctx).float(), _good_ids(ctx))),
        E("TypeError", r"input must hold int64 or int32 ids, got torch.float32"),
        culprit=CULPRIT,
        needs=("shardwise_embedding",),
    ),
    Case(
        "embedding_options_differ",
        _embedding(_good_ids, max_norm=lambda ctx: _on_culprit(ctx, 1.0, None)),
        E("CollectiveMismatchError", r"different max_norm"),
        needs=("shardwise_embedding",),
    ),
    Case(
        "embedding_enumerable_weight",
        _embedding_enumerable,
        E("NotImplementedError", r"sharded with EnumerableShardingSpec; supported: .*ChunkShardingSpec"),
        needs=("shardwise_embedding",),
    ),
    Case(
        "embedding_weight_size_differs_between_ranks",
        # Without the check, rank 0 thinks row 3 is rank 1's, rank 1 that it is rank 0's: rows of zeros.
        lambda ctx: F.embedding(torch.tensor([3, 2]), zeros(ctx.rows(), ROWS + ctx.rank, COLS)),
        E("CollectiveMismatchError",
          r"embedding: ranks 0 and 1 called with a different weight \(global size or sharding\)"),
        needs=("shardwise_embedding",),
    ),
    Case(
        "embedding_weight_spec_differs_between_ranks",
        lambda ctx: F.embedding(_good_ids(ctx), zeros(_on_culprit(ctx, ctx.cols(), ctx.rows()), ROWS, COLS)),
        E("CollectiveMismatchError", r"embedding: ranks 0 and 1 called with a different sharding dim"),
        needs=("shardwise_embedding",),
    ),
    Case(
        "bag_offsets_decreasing_on_one_rank",
        _bag(_good_bag_ids, lambda ctx: _on_culprit(ctx, torch.tensor([0, 2, 1]), _good_offsets(ctx))),
        E("ValueError", r"offsets must be non-decreasing, got \[0, 2, 1\]"),
        culprit=CULPRIT,
        needs=("shardwise_embedding",),
    ),
    Case(
        "bag_per_sample_weights_wrong_shape_on_one_rank",
        _bag(
            _good_bag_ids,
            _good_offsets,
            mode="sum",
            per_sample_weights=lambda ctx: torch.ones(2 if ctx.culprit() else 4),
        ),
        E("ValueError", r"per_sample_weights must have the input's shape \(3,\), got torch.Size\(\[2\]\)"),
        culprit=CULPRIT,
        needs=("shardwise_embedding",),
    ),
    Case(
        "bag_per_sample_weights_with_mean",
        _bag(_good_bag_ids, _good_offsets, mode="mean", per_sample_weights=lambda ctx: torch.ones(4 - ctx.rank)),
        E("NotImplementedError", r"per_sample_weights is only supported for mode='sum'"),
        needs=("shardwise_embedding",),
    ),
    Case(
        "bag_modes_differ",
        _bag(_good_bag_ids, _good_offsets, mode=lambda ctx: _on_culprit(ctx, "max", "sum")),
        E("CollectiveMismatchError", r"different mode"),
        needs=("shardwise_embedding",),
    ),
    # -- checkpoints ---------------------------------------------------------------------------------------------
    Case(
        "checkpoint_load_missing_path",
        _load(lambda ctx: ctx.workdir / "no_such_ckpt", lambda ctx: {"w": ctx.sharded()}),
        E("FileNotFoundError", r"no checkpoint at \S*no_such_ckpt"),
    ),
    Case(
        "checkpoint_load_missing_path_on_one_rank",
        _load(
            lambda ctx: _on_culprit(ctx, ctx.workdir / "no_such_ckpt", ctx.checkpoint),
            lambda ctx: {"w": ctx.sharded(), "step": 0},
        ),
        E("FileNotFoundError", r"no checkpoint at \S*no_such_ckpt"),
        culprit=CULPRIT,
        peers=E("PeerError", r"^checkpoint planning: rank 1 \(FileNotFoundError\) rejected"),
    ),
    Case(
        "checkpoint_load_other_global_size",
        _load(lambda ctx: ctx.checkpoint, _other_size_state),
        E("ValueError", r"'w' was saved with size \[6, 4\] but the tensor to load into has size \[8, 4\]"),
    ),
    Case(
        "checkpoint_load_missing_key",
        _load(lambda ctx: ctx.checkpoint, lambda ctx: {"w": ctx.sharded(), "bias": torch.zeros(3)}),
        E("ValueError", r"cannot load the checkpoint at \S+ into this state_dict: it has no 'bias' \(it holds 'step'"),
    ),
    Case(
        "checkpoint_load_missing_key_on_one_rank",
        _load(lambda ctx: ctx.checkpoint, lambda ctx: {"w": ctx.sharded(), _on_culprit(ctx, "bias", "step"): 0}),
        E("ValueError", r"it has no 'bias' \(it holds 'step', 'w'\)"),
        culprit=CULPRIT,
        peers=E("PeerError", r"^checkpoint planning: rank 1 \(ValueError\) rejected .*it has no 'bias'"),
    ),
    Case(
        "checkpoint_save_under_a_file",
        _save_under_a_file,
        E("FileExistsError|NotADirectoryError", r"a_file"),
        culprit=0,  # rank 0 creates the save's directory; the others check they see it
        peers=E("PeerError", r"^checkpoint creating the directory: rank 0 \((FileExistsError|NotADirectoryError)\)"),
    ),
    Case(
        "checkpoint_save_unpicklable_value",
        _save_unpicklable,
        E("AttributeError|PicklingError", r"pickle.*lambda"),
        culprit=SOME_RANK,  # DCP picks the rank that writes a plain value
        peers=E("PeerError", r"^checkpoint writing: rank {culprit} \((AttributeError|PicklingError)\) rejected "),
    ),
    # -- exchange ------------------------------------------------------------------------------------------------
    Case(
        "exchange_not_json_on_one_rank",
        lambda ctx: _group(ctx).exchange({"when": _on_culprit(ctx, object(), 1)}),
        E("TypeError", r"obj\['when'\] is a builtins.object, which is not JSON-safe"),
        culprit=CULPRIT,
    ),
    Case(
        "exchange_nan_on_one_rank",
        lambda ctx: _group(ctx).exchange([1.0, _on_culprit(ctx, float("nan"), 2.0)]),
        E("TypeError", r"obj\[1\] is nan; JSON has no NaN"),
        culprit=CULPRIT,
    ),
    Case(
        "exchange_int_keys_on_one_rank",
        lambda ctx: _group(ctx).exchange(_on_culprit(ctx, {1: "a"}, {"1": "a"})),
        E("TypeError", r"key 1 of type int; JSON keys must be str"),
        culprit=CULPRIT,
    ),
    # -- collectives ---------------------------------------------------------------------------------------------
    Case(
        "all_reduce_sizes_differ",
        lambda ctx: _group(ctx).all_reduce(torch.ones(4 + ctx.rank)),
        E("CollectiveMismatchError", r"all_reduce: ranks disagree on the number of elements \(rank 0: 4, rank 1: 5\)"),
    ),
    Case(
        "all_reduce_dtypes_differ",
        lambda ctx: _group(ctx).all_reduce(torch.ones(4, dtype=_per_rank(ctx, torch.float32, torch.float64))),
        E("CollectiveMismatchError", r"ranks disagree on the dtype \(rank 0: float32, rank 1: float64\)"),
    ),
    Case(
        "all_reduce_ops_differ",
        lambda ctx: _group(ctx).all_reduce(torch.ones(4), op=_per_rank(ctx, "sum", "max")),
        E("CollectiveMismatchError", r"all_reduce: ranks disagree on the reduce op \(rank 0: sum, rank 1: max\)"),
    ),
    Case(
        "all_reduce_unknown_op_on_one_rank",
        lambda ctx: _group(ctx).all_reduce(torch.ones(4), op=_on_culprit(ctx, "median", "sum")),
        E("ValueError", r"unsupported reduce op 'median'"),
        culprit=CULPRIT,
    ),
    Case(
        "all_reduce_not_a_tensor_on_one_rank",
        lambda ctx: _group(ctx).all_reduce(_on_culprit(ctx, [1.0, 2.0], torch.ones(2))),
        E("TypeError", r"tensor must be a torch.Tensor, got list"),
        culprit=CULPRIT,
    ),
    Case(
        "collectives_differ",
        _different_collectives,
        E(
            "CollectiveMismatchError",
            r"called different collectives at the same point \(rank 0: barrier, rank 1: all_reduce\)",
        ),
    ),
    Case(
        "broadcast_src_outside_group_on_one_rank",
        lambda ctx: _group(ctx).broadcast(torch.ones(3), src=_on_culprit(ctx, 5, 0)),
        E("ValueError", r"src=5 is not a rank of this group \(size 2\)"),
        culprit=CULPRIT,
    ),
    Case(
        "broadcast_src_differs",
        lambda ctx: _group(ctx).broadcast(torch.ones(3), src=ctx.rank),
        E("CollectiveMismatchError", r"broadcast: ranks disagree on the root rank \(rank 0: 0, rank 1: 1\)"),
    ),
    Case(
        "all_gather_trailing_shape_differs",
        lambda ctx: _group(ctx).all_gather(torch.ones(2, 3 + ctx.rank)),
        E("CollectiveMismatchError", r"all_gather: ranks disagree on the shape after dim 0"),
    ),
    Case(
        "all_gather_out_wrong_shape_on_one_rank",
        lambda ctx: _group(ctx).all_gather(torch.ones(2), out=torch.empty(_on_culprit(ctx, 3, 4))),
        E("ValueError", r"out has shape \(3,\) but the result has shape \(4,\)"),
        culprit=CULPRIT,
    ),
    Case(
        "reduce_scatter_wrong_count_on_one_rank",
        lambda ctx: _group(ctx).reduce_scatter([torch.ones(2)] * _on_culprit(ctx, 3, 2)),
        E("ValueError", r"inputs must hold one tensor per rank \(2\), got 3"),
        culprit=CULPRIT,
    ),
    Case(
        "all_to_all_single_splits_bad_on_one_rank",
        lambda ctx: _group(ctx).all_to_all_single(torch.zeros(4), input_split_sizes=_on_culprit(ctx, [3, 3], [2, 2])),
        E("ValueError", r"input_split_sizes \[3, 3\] sum to 6, but dim 0 has 4 rows"),
        culprit=CULPRIT,
    ),
    Case(
        "all_to_all_single_receive_differs",
        _all_to_all_single_wrong_receive,
        E("CollectiveMismatchError", r"rank 1 expects to receive \[3, 1\] rows but the ranks send it \[2, 2\]"),
    ),
    Case(
        "scatter_no_tensors_on_src",
        lambda ctx: _group(ctx).scatter(None, src=0),
        E("ValueError", r"rank 0 is the source and must pass one tensor per rank, got None"),
        culprit=0,
    ),
    Case(
        "new_group_members_differ",
        lambda ctx: _group(ctx).new_group([ctx.rank]),
        E("CollectiveMismatchError",
          r"new_group: ranks disagree on the members of the new group \(rank 0: \[0\], rank 1: \[1\]\)"),
    ),
    Case(
        "autograd_all_reduce_sizes_differ",
        lambda ctx: swf.all_reduce(torch.ones(4 + ctx.rank, requires_grad=True)),
        E("CollectiveMismatchError", r"ranks disagree on the number of elements"),
    ),
    Case(
        "group_usable_after_rejected_call",
        _after_bad_peer,
        E("LookupError", r"^group still usable$"),
    ),
]


# -- running ---------------------------------------------------------------------------------------------------


#: This rank's own copy of its lines (``lines-rank<R>.txt`` in the work directory given), or None.
_lines_fd: Optional[int] = None


def say(line: str) -> None:
    """Write one line in one ``write`` call, to stdout and to this rank's own file.

    The launcher merges the ranks' stdout; Open MPI's forwarding has split a
    long line of one rank around a line of another. The test reads the
    per-rank files, which nothing merges.
    """
    data = (line + "\n").encode()
    sys.stdout.flush()
    os.write(1, data)
    if _lines_fd is not None:
        os.write(_lines_fd, data)


def outcome(exc: Optional[BaseException]) -> str:
    """``Type: message`` on one line (newlines shown as ``\\n``), or ``NO ERROR``."""
    if exc is None:
        return "NO ERROR"
    message = str(exc).replace("\\", "\\\\").replace("\n", "\\n")
    if len(message) > 1500:
        message = message[:1500] + "..."
    return f"{type(exc).__name__}: {message}"


def _missing(case: Case) -> Optional[str]:
    import importlib.util

    for module in case.needs:
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed"
    return None


def run_case(case: Case, ctx: Ctx) -> None:
    """Run one case on this rank and print its line."""
    why = _missing(case)
    if why is not None:
        say(f"CASE {case.name} rank {ctx.rank} 0.000s: SKIPPED: {why}")
        return
    error: Optional[BaseException] = None
    started = time.monotonic()
    try:
        case.run(ctx)
    except Exception as exc:  # noqa: BLE001 - every rank's error is the result
        error = exc
    elapsed = time.monotonic() - started
    say(f"CASE {case.name} rank {ctx.rank} {elapsed:.3f}s: {outcome(error)}")


def _workdir(group: Group, given: Optional[str]) -> Path:
    """``given``, or a fresh temporary directory made by rank 0 and shared with the others."""
    if given:
        path = Path(given)
        path.mkdir(parents=True, exist_ok=True)
        return path
    made = tempfile.mkdtemp(prefix="shardwise-bad-input-") if group.rank == 0 else None
    return Path(group.exchange(made)[0])


def main(argv: list[str]) -> int:
    """Run every case (those before ``init`` first) and print a line per case; 0 when all ran."""
    global _lines_fd
    launch = detect()  # rank and world size from the launcher, before any group exists
    if len(argv) > 1:
        path = Path(argv[1]) / f"lines-rank{launch.rank}.txt"
        _lines_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    ctx = Ctx(rank=launch.rank, size=launch.world_size, group=None, workdir=Path("."))
    count = 0
    for case in CASES:
        if case.before_init:
            run_case(case, ctx)
            count += 1
    group = shardwise.init()
    if group.size != 2:
        raise SystemExit(f"run this program on 2 ranks, not {group.size}")
    ctx.group = group
    ctx.workdir = _workdir(group, argv[1] if len(argv) > 1 else None)
    _save_checkpoint(ctx)
    for case in CASES:
        if case.before_init:
            continue
        group.barrier()  # every rank starts each case together
        run_case(case, ctx)
        count += 1
    group.barrier()
    say(f"rank {group.rank}: battery done, {count} cases")
    shardwise.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
