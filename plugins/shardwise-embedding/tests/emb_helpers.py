"""Helpers shared by the shardwise-embedding tests, in the test process and inside the ranks.

Every input is made from a seed keyed by what it is for (case, rank), so each
rank can rebuild every other rank's batch and compute the dense reference of
the whole job by itself: no gather is needed to check a result.

Multi-rank tests batch many cases into one ``run_ranks`` call (a launch costs
seconds): the rank function runs each case through :func:`battery`, which
records ``"ok"`` or what went wrong per case, and the test process checks the
cases one pytest test at a time from a result computed once per world size
(:func:`battery_results`). Each case does all its collective work (forward and
backward) before it compares anything, so one failed comparison never leaves
the ranks out of step. Each rank also saves its results after every case, so
when a case hangs or kills the ranks, only that case (and the ones after it,
which never ran) fail, with the ranks' tracebacks on the case that hung.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
import traceback
import zlib
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

import shardwise
from shardwise.sharded_tensor import ShardMetadata, ShardedTensor
from shardwise.sharding_spec import ChunkShardingSpec, ShardingSpec
from shardwise.testing import RankError, run_ranks

#: The backend the multi-rank tests run on: the shardwise-gloo plugin by
#: default; ``SHARDWISE_TEST_BACKEND=mpi`` runs them over the MPI plugin,
#: launched by ``mpiexec``. Read at import: the autouse fixture clears
#: ``SHARDWISE_*`` for each test, and the ranks get it through ``env``.
TEST_BACKEND = os.environ.get("SHARDWISE_TEST_BACKEND", "gloo")

#: Weights are float64 unless a case says otherwise, so sums taken in another
#: order (across ranks, over column shards) still compare tightly.
DT = torch.float64

OK = "ok"
OUT_OF_STEP = "ranks out of step"


# -- running ranks ------------------------------------------------------------------------------------


def run(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """``fn(*args)`` on ``world_size`` ranks over :data:`TEST_BACKEND`; every rank's return value."""
    launcher = "mpiexec" if TEST_BACKEND == "mpi" else "spawn"
    # The ranks import this module too and must see the same backend.
    env = {"SHARDWISE_TEST_BACKEND": TEST_BACKEND}
    return run_ranks(fn, world_size, backend=TEST_BACKEND, args=args, env=env, launcher=launcher, timeout=120)


#: Battery results by (function, world size): each battery runs once per test session.
_RUNS: dict[tuple[Any, ...], list[dict[str, Any]]] = {}


#: Launches a battery may take: after a case hangs or kills the ranks, the
#: cases after it run in a new launch (at most this many in all).
MAX_LAUNCHES = 3


def battery_results(
    fn: Callable[[str, tuple[str, ...]], Any], world_size: int, names: Sequence[str]
) -> list[dict[str, Any]]:
    """Every rank's :func:`battery` results of ``fn(results_dir, only)``, run once per test session.

    When a launch fails (a case hangs, or kills a rank) the results the ranks
    saved are kept, the case they were in gets the launch's error (every rank's
    traceback and log), and the cases after it run in a new launch; cases that
    still have not run after :data:`MAX_LAUNCHES` launches say so.

    Args:
        fn: A rank function taking the directory to save results in and the
            cases to run (all when empty).
        world_size: Number of ranks.
        names: Every case ``fn`` runs, in order.
    """
    key = (fn.__module__, fn.__qualname__, world_size)
    if key in _RUNS:
        return _RUNS[key]
    results: list[dict[str, Any]] = [{} for _ in range(world_size)]
    remaining = list(names)
    for launch in range(MAX_LAUNCHES):
        only = tuple(remaining) if launch else ()
        with tempfile.TemporaryDirectory(prefix="emb-battery-") as tmp:
            error: Optional[RankError] = None
            try:
                got = run(fn, world_size, tmp, only)
            except RankError as exc:
                error = exc
                got = []
                for rank in range(world_size):
                    saved = Path(tmp, f"rank{rank}.json")
                    got.append(json.loads(saved.read_text()) if saved.exists() else {})
        for mine, new in zip(results, got, strict=True):
            mine.update(new)
        stopped = any(isinstance(v, str) and v.startswith(OUT_OF_STEP) for seen in got for v in seen.values())
        unfinished = [name for name in remaining if any(name not in seen for seen in got)]
        if error is not None and unfinished and not stopped:
            for seen in results:
                seen.setdefault(unfinished[0], f"the run failed in this case (it hung or a rank died):\n{error}")
            unfinished = unfinished[1:]
        remaining = unfinished
        if not remaining:
            break
    for seen in results:
        for name in remaining:
            seen.setdefault(name, f"never ran: earlier cases failed the ranks {MAX_LAUNCHES} times")
    _RUNS[key] = results
    return results


def outcome(fn: Callable[[], Any]) -> tuple[str, str]:
    """``("ok", "")`` or ``(error type name, message)`` of calling ``fn``."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the tests inspect every rank's error
        return type(exc).__name__, str(exc)
    return OK, ""


def battery(cases: Mapping[str, Callable[[], None]], results_dir: str = "", only: Sequence[str] = ()) -> dict[str, str]:
    """Run the cases on this rank; case name -> ``"ok"`` or the failure (traceback).

    After each case the ranks exchange its name: ranks left out of step by a
    case (one made more collective calls than another) are reported at that
    case, and the remaining cases are not run.

    Args:
        cases: Case name -> the case, in the order every rank runs them.
        results_dir: Where to save the results so far after each case
            (``rank<R>.json``), for :func:`battery_results`; "" for nowhere.
        only: Run just these cases (all when empty); for debugging.
    """
    group = shardwise.get_default_group()
    results: dict[str, str] = {}
    for name, case in cases.items():
        if only and name not in only:
            continue
        try:
            case()
        except Exception:  # noqa: BLE001 - reported per case by the test process
            results[name] = traceback.format_exc(limit=-6)
        else:
            results[name] = OK
        try:
            names = group.exchange(name)
        except Exception as exc:  # noqa: BLE001 - the ranks are out of step
            names = [f"{type(exc).__name__}: {exc}"]
        stop = names != [name] * group.size
        if stop:
            results[name] = f"{OUT_OF_STEP} after this case (they ran {names}); later cases not run\n" + results[name]
        if results_dir:
            path = Path(results_dir, f"rank{group.rank}.json")
            path.with_suffix(".tmp").write_text(json.dumps(results))
            path.with_suffix(".tmp").replace(path)
        if stop:
            break
    return results


def assert_case(results: Sequence[Mapping[str, str]], case: str) -> None:
    """Every rank reported ``"ok"`` for ``case``; else show what each failing rank saw."""
    bad = {rank: seen.get(case, "missing") for rank, seen in enumerate(results) if seen.get(case) != OK}
    if bad:
        report = "\n".join(f"--- rank {rank}:\n{text}" for rank, text in bad.items())
        raise AssertionError(f"case {case!r} failed on ranks {sorted(bad)}:\n{report}")


# -- deterministic data ---------------------------------------------------------------------------------


def gen(*key: Any) -> torch.Generator:
    """A generator seeded from ``key`` (stable across processes, unlike ``hash``)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def dense_weight(num: int, dim: int, *key: Any, dtype: torch.dtype = DT) -> torch.Tensor:
    """The dense ``[num, dim]`` weight of case ``key``, the same on every rank."""
    return torch.randn((num, dim), generator=gen("weight", num, dim, *key), dtype=torch.float64).to(dtype)


def random_ids(num: int, shape: Sequence[int], *key: Any, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Ids in ``[0, num)`` of the given shape (key it by rank for per-rank batches)."""
    return torch.randint(0, num, tuple(shape), generator=gen("ids", *key)).to(dtype)


def loss_weights(shape: Sequence[int], *key: Any, dtype: torch.dtype = DT) -> torch.Tensor:
    """Random weights of one rank's loss ``(out * w).sum()``: ranks' gradients differ."""
    return torch.randn(tuple(shape), generator=gen("loss", *key), dtype=torch.float64).to(dtype)


def max_norm_for(dense: torch.Tensor, norm_type: float) -> float:
    """A max_norm that about half of ``dense``'s rows exceed (and none equals)."""
    norms = dense.double().norm(p=norm_type, dim=1)
    return float(norms.median()) * 0.97 if norms.numel() else 1.0


# -- sharding -----------------------------------------------------------------------------------------


def chunk_spec(dim: int, ranks: Sequence[int]) -> ChunkShardingSpec:
    """``ChunkShardingSpec(dim)`` with one CPU placement per entry of ``ranks``, in that order."""
    return ChunkShardingSpec(dim=dim, placements=[f"rank:{r}/cpu" for r in ranks])


def shard_dense(dense: torch.Tensor, spec: ShardingSpec, requires_grad: bool = True) -> ShardedTensor:
    """``dense`` (the same on every rank) sharded by ``spec`` through ``shardwise.shard_tensor``.

    Every rank calls it; the local shards are leaves with ``requires_grad``.
    """
    st = shardwise.shard_tensor(dense.detach().clone().requires_grad_(requires_grad), spec)
    for shard in st.local_shards():
        assert shard.tensor.requires_grad == requires_grad, "shard_tensor lost requires_grad"
    return st


def dense_slice(full: torch.Tensor, md: ShardMetadata) -> torch.Tensor:
    """The part of ``full`` that the shard described by ``md`` covers."""
    for d, (offset, size) in enumerate(zip(md.shard_offsets, md.shard_sizes, strict=True)):
        full = full.narrow(d, offset, size)
    return full


# -- comparisons, collected so the ranks stay in step -------------------------------------------------------


class Checks:
    """Comparisons made after a case's collective work; failures are collected, then raised together."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.failures: list[str] = []

    def fail(self, message: str) -> None:
        """Record a failure."""
        self.failures.append(message)

    def true(self, condition: bool, message: str) -> None:
        """Record ``message`` unless ``condition``."""
        if not condition:
            self.fail(message)

    def close(
        self, actual: Optional[torch.Tensor], expected: torch.Tensor, what: str, **tolerance: Any
    ) -> None:
        """``actual`` equals ``expected`` (a None ``actual`` counts as zeros, for gradients)."""
        if actual is None:
            actual = torch.zeros_like(expected)
        try:
            torch.testing.assert_close(actual.detach(), expected.detach(), **tolerance)
        except AssertionError as exc:
            self.fail(f"{what}: {exc}\n  got {actual.detach().tolist()}\n  expected {expected.detach().tolist()}")

    def output(self, out: Any, expected: torch.Tensor, what: str = "output", **tolerance: Any) -> None:
        """``out`` is a plain tensor equal to ``expected`` (shape, dtype, values)."""
        if type(out) is not torch.Tensor:
            self.fail(f"{what}: expected a plain torch.Tensor, got {type(out).__name__}")
            return
        if out.shape != expected.shape or out.dtype != expected.dtype:
            self.fail(f"{what}: got {tuple(out.shape)} {out.dtype}, expected {tuple(expected.shape)} {expected.dtype}")
            return
        self.close(out, expected, what, **tolerance)

    def shards(self, st: ShardedTensor, full: torch.Tensor, what: str = "weight", **tolerance: Any) -> None:
        """The local shards of ``st`` equal the matching slices of ``full``."""
        for shard in st.local_shards():
            self.close(shard.tensor, dense_slice(full, shard.metadata), f"{what} shard {shard.metadata}", **tolerance)

    def tensors(
        self, tensors: Sequence[torch.Tensor], mds: Sequence[ShardMetadata], full: torch.Tensor, what: str, **tol: Any
    ) -> None:
        """Each of ``tensors`` equals the slice of ``full`` its metadata describes."""
        for tensor, md in zip(tensors, mds, strict=True):
            self.close(tensor, dense_slice(full, md), f"{what} shard {md}", **tol)

    def grads(self, st: ShardedTensor, full_grad: Optional[torch.Tensor], what: str = "grad", **tolerance: Any) -> None:
        """The local shards' ``.grad`` equal the matching slices of the dense gradient."""
        for shard in st.local_shards():
            expected = (
                dense_slice(full_grad, shard.metadata)
                if full_grad is not None
                else torch.zeros(shard.metadata.shard_sizes, dtype=shard.tensor.dtype)
            )
            self.close(shard.tensor.grad, expected, f"{what} shard {shard.metadata}", **tolerance)

    def done(self) -> None:
        """Raise every recorded failure at once."""
        if self.failures:
            raise AssertionError(f"{self.what}:\n" + "\n".join(self.failures))


def weighted_loss(ck: Checks, out: Any, weights: torch.Tensor) -> torch.Tensor:
    """``(out * weights).sum()``; when shapes differ the failure is recorded and ``out.sum() * 0`` used.

    Either way the loss stays connected to the collective's graph, so every rank
    still joins the backward.
    """
    if isinstance(out, torch.Tensor) and out.shape == weights.shape:
        return (out * weights).sum()
    ck.fail(f"loss: output shape {getattr(out, 'shape', None)} != expected {tuple(weights.shape)}")
    return out.sum() * 0


def sharded_twins(
    cls: type[torch.nn.Module], num: int, dim: int, kw: Mapping[str, Any], dense: torch.Tensor, spec: ShardingSpec,
    ck: Checks,
) -> tuple[Any, Any, ShardedTensor]:
    """Two ``cls(num, dim, **kw)`` modules holding ``dense``; the first's weight sharded by ``spec``.

    Returns:
        ``(sharded module, dense twin, the sharded weight)``.
    """
    modules = []
    for _ in range(2):
        module = cls(num, dim, dtype=DT, **kw)
        with torch.no_grad():
            module.weight.copy_(dense)  # type: ignore[operator]
        modules.append(module)
    sharded, ref = modules
    shardwise.shard_parameter(sharded, "weight", spec)
    weight = sharded.weight
    ck.true(isinstance(weight, shardwise.ShardedTensor), f"shard_parameter left {type(weight).__name__}")
    return sharded, ref, weight  # type: ignore[return-value]


def step_dense_twin(
    ck: Checks, step: int, rank: int, out: Any, weight: Any, ref_outs: Sequence[Any], grads: Sequence[Any],
    ref_weight: Any, ref_optim: Any,
) -> None:
    """One step of the dense twin (every rank's batch), then compare this rank's output and shards with it."""
    sum((o * g).sum() for o, g in zip(ref_outs, grads, strict=True)).backward()  # type: ignore[union-attr]
    ref_optim.step()
    ref_optim.zero_grad()
    ck.output(out, ref_outs[rank].detach(), f"step {step} output")
    ck.shards(weight, ref_weight.detach(), f"step {step} weight")


def battery_of(
    layout_names: Sequence[str], names_for: Callable[[str], Sequence[str]], options: Any,
    functional_case: Callable[..., None], module_case: Callable[..., None], w: int, rank: int,
) -> dict[str, Callable[[], None]]:
    """``{"layout/name": case}``: functional cases for names in ``options``, module cases for the rest."""
    cases: dict[str, Callable[[], None]] = {}
    for layout in layout_names:
        for name in names_for(layout):
            case = functional_case if name in options else module_case
            cases[f"{layout}/{name}"] = functools.partial(case, w, rank, layout, name)
    return cases
