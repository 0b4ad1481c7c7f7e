"""The multi-process harness the ported tests run under (instead of torch's private one).

torch's ``MultiProcessTestCase`` forks a fresh set of processes per test and
sets up CUDA/NCCL; on a 2-core machine that is minutes per file. Here one
launch (``shardwise.testing.run_ranks``: a timeout, every rank's traceback)
starts ``WORLD_SIZE`` processes per ported file, and every rank runs the
file's tests one after another:

* gloo: before each test the ranks meet at a barrier on the launch's
  TCPStore; a test that initialises comms gets a fresh default process group
  (``dist.init_process_group("gloo")`` on a store prefix of its own, with a
  short collective timeout, so a rank left waiting by a failed peer raises
  instead of hanging), which is destroyed after the test whatever happened.
* mpi: the ranks run under ``mpiexec`` with shardwise's ``mpi`` backend
  (``shardwise.init("mpi")`` before the first test); there is no torch
  process group, so tests marked :func:`torch_pg_only` are skipped.

Each rank appends one JSON line per test (status, detail) to a results file;
the parent (``test_torch_suite.py``) merges the ranks and reports every
upstream test as one pytest result. Tests that are single-process
``unittest.TestCase`` in upstream run on rank 0 only.
"""

from __future__ import annotations

import faulthandler
import functools
import importlib.util
import json
import os
import sys
import time
import traceback
import unittest
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

# upstream's tests are torch TestCases: assertEqual compares tensors (and seeds the RNG in setUp)
from torch.testing._internal.common_utils import TestCase

__all__ = [
    "TEST_GPU_NUM",
    "Case",
    "ShardedTensorTestBase",
    "cases_of",
    "differs_on_shardwise",
    "load_port",
    "out_of_scope",
    "rank_main",
    "torch_pg_only",
    "with_comms",
]

#: World size of every multi-rank test (upstream's ``TEST_GPU_NUM``).
TEST_GPU_NUM = 4
#: How long a collective may wait for a peer before raising (gloo).
COLLECTIVE_TIMEOUT_S = float(os.environ.get("TORCH_SUITE_COLLECTIVE_TIMEOUT", "45"))
#: How long one test may run before its rank dumps its stacks and exits.
TEST_WATCHDOG_S = float(os.environ.get("TORCH_SUITE_TEST_WATCHDOG", "240"))

SUITE_DIR = Path(__file__).resolve().parent
PORT_DIR = SUITE_DIR / "upstream"


class _Context:
    """What the ranks know about the launch they run in."""

    rank = 0
    world_size = TEST_GPU_NUM
    backend = "gloo"  # "gloo" or "mpi"
    store: Any = None
    test_index = 0


CTX = _Context()


# --------------------------------------------------------------------------- markers


def out_of_scope(reason: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Skip a ported test on every target and backend; ``reason`` goes to the report (and SCOPE.md).

    ``TORCH_SUITE_INCLUDE_OUT_OF_SCOPE=1`` runs it anyway (to see how far it gets).
    """
    if os.environ.get("TORCH_SUITE_INCLUDE_OUT_OF_SCOPE") == "1":
        return lambda fn: fn
    return unittest.skip(f"out of scope: {reason}")


def torch_pg_only(reason: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark a test that needs torch's own process group (``dist.new_group``, ``dist.get_rank`` ...).

    It runs in the gloo run and is skipped in the mpi run (no torch process group there).
    """

    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn._torch_pg_only = reason  # type: ignore[attr-defined]
        return fn

    return mark


#: The deliberate differences (rows of the "Differences from torch.distributed._shard" table in docs/migrating.md)
#: that upstream tests assert torch's side of; SCOPE.md lists the tests. Each maps to the reason and to
#: the failure (``Type: message`` of the cause, a regex) the test must end in on shardwise: such a test
#: still runs against shardwise, so every check before the difference is exercised, and it is reported
#: as an expected failure only when it fails exactly there.
DIFFERENCES: dict[str, tuple[str, str]] = {
    "seeded-rand": (
        "docs/migrating.md differences, seeded rand/randn/nn.init: shardwise gives the same whole tensor for a seed "
        "on any world size and spec; torch draws each shard from the local generator, which this test asserts",
        r"^AssertionError: Tensor-likes are not close!",
    ),
    "empty-chunk-offset": (
        "docs/migrating.md differences, empty trailing chunk offsets: shardwise starts an empty trailing chunk "
        "where the tensor ends; torch at split * index (past the end), which this test asserts",
        r"^AssertionError: Scalars are not equal!",
    ),
    "shard-any-spec": (
        "docs/migrating.md differences, EnumerableShardingSpec.shard / shard_tensor with an Enumerable spec: "
        "shardwise shards with any spec (here: ValueError, the spec does not cover the tensor); torch raises "
        "NotImplementedError 'not implemented yet!', which this test's last check asserts",
        r"^ValueError: cannot shard a tensor of size \[12, 12\] with EnumerableShardingSpec",
    ),
    "reshard-any-spec": (
        "docs/migrating.md differences, reshard: shardwise reshards to any spec (here: ValueError, the spec "
        "does not cover the tensor); torch refuses a non-chunk spec with NotImplementedError, which this test asserts",
        r"^ValueError: cannot reshard a tensor of size \[24, 12\] with EnumerableShardingSpec",
    ),
    "sharder-swaps-module": (
        "docs/migrating.md differences, Sharder in shard_module: shardwise replaces the submodule; torch sets "
        "an attribute literally named mod_name on the parent and keeps the old module, which this test relies on "
        "(its CustomShardedEBC has no forward)",
        r'^NotImplementedError: Module \[CustomShardedEBC\] is missing the required "forward" function',
    ),
}


def differs_on_shardwise(key: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark a test that asserts something shardwise deliberately does differently (a key of :data:`DIFFERENCES`).

    Against shardwise it runs and must fail with the difference's expected
    cause (reported as an expected failure); passing, or failing anywhere
    else, fails. Against torch it runs as usual.
    """
    if key not in DIFFERENCES:
        raise KeyError(
            f"unknown difference {key!r}: add it to DIFFERENCES (and the differences table in docs/migrating.md)"
        )

    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn._differs_on_shardwise = key  # type: ignore[attr-defined]
        return fn

    return mark


# --------------------------------------------------------------------------- test base


class ShardedTensorTestBase(TestCase):
    """Upstream's ``ShardedTensorTestBase``, for ranks started by :func:`rank_main`."""

    @property
    def world_size(self) -> int:
        return CTX.world_size

    @property
    def rank(self) -> int:
        return CTX.rank

    def init_pg(self, backend: str = "gloo") -> None:
        """A fresh default process group for this test (gloo whatever ``backend`` upstream named)."""
        if CTX.backend == "mpi":
            return  # shardwise's mpi group, made once per launch, is the default group
        store = dist.PrefixStore(f"torch_suite/test{CTX.test_index}/", CTX.store)
        dist.init_process_group(
            backend="gloo",
            store=store,
            rank=CTX.rank,
            world_size=CTX.world_size,
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )

    def init_comms(self, init_rpc: bool = True, backend: str = "gloo") -> None:
        # RPC is out of scope: tests that need it are skipped (SCOPE.md).
        self.init_pg(backend=backend)

    def destroy_comms(self, destroy_rpc: bool = True) -> None:
        if CTX.backend == "mpi":
            # Imported here, not at the top: the torch baseline's ranks never import shardwise.
            import shardwise

            shardwise.get_default_group().barrier()
            return
        dist.barrier()
        dist.destroy_process_group()


def with_comms(
    func: Optional[Callable[..., Any]] = None, init_rpc: bool = True, backend: str = "nccl"
) -> Callable[..., Any]:
    """Upstream's decorator: comms around the test (gloo here; never RPC)."""
    if func is None:
        return functools.partial(with_comms, init_rpc=init_rpc, backend=backend)

    @functools.wraps(func)
    def wrapper(self: ShardedTensorTestBase, *args: Any, **kwargs: Any) -> None:
        self.init_comms(init_rpc=False, backend="gloo")
        func(self, *args, **kwargs)
        self.destroy_comms(destroy_rpc=False)

    return wrapper


# --------------------------------------------------------------------------- discovery


@dataclass(frozen=True)
class Case:
    """One upstream test: ``<file>::<Class>::<method>``."""

    file: str  # relative to upstream/, e.g. "sharded_tensor/test_sharded_tensor.py"
    cls: str
    method: str
    multi_rank: bool
    skip: Optional[str]  # skip reason known before running (out of scope), else None

    @property
    def id(self) -> str:
        return f"{self.file}::{self.cls}::{self.method}"


def load_port(relpath: str) -> ModuleType:
    """Import the ported file ``upstream/<relpath>`` under a unique module name."""
    path = PORT_DIR / relpath
    # A flat name: pickle (torch's object collectives send a custom spec's
    # class by reference) re-imports the module by name, and a dotted name
    # would need parent packages that do not exist.
    name = "torch_suite_port__" + relpath.removesuffix(".py").replace("/", "__")
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def cases_of(relpath: str) -> list[Case]:
    """Every test of a ported file, in the order the ranks run them."""
    module = load_port(relpath)
    loader = unittest.TestLoader()
    found = []
    for cls in vars(module).values():
        if not (isinstance(cls, type) and issubclass(cls, unittest.TestCase) and cls.__module__ == module.__name__):
            continue
        for method in loader.getTestCaseNames(cls):
            fn = getattr(cls, method)
            skip = getattr(fn, "__unittest_skip_why__", None) if getattr(fn, "__unittest_skip__", False) else None
            found.append(Case(relpath, cls.__name__, method, issubclass(cls, ShardedTensorTestBase), skip))
    # Upstream tests not ported because nothing of them can run here (RPC,
    # CUDA-only, pinned memory ...): listed with the reason, reported as skipped.
    for qualname, reason in getattr(module, "OUT_OF_SCOPE", {}).items():
        cls_name, method = qualname.split(".")
        found.append(Case(relpath, cls_name, method, True, f"out of scope: {reason}"))
    return found


# --------------------------------------------------------------------------- rank side


def _barrier(tag: str) -> None:
    """All ranks meet before a test, outside any process group under test."""
    if CTX.backend == "mpi":
        # Imported here, not at the top: the torch baseline's ranks never import shardwise.
        import shardwise

        shardwise.get_default_group().barrier()
        return
    key = f"torch_suite/barrier/{tag}"
    CTX.store.add(key, 1)
    deadline = time.monotonic() + TEST_WATCHDOG_S
    while CTX.store.add(key, 0) < CTX.world_size:
        if time.monotonic() > deadline:
            raise TimeoutError(f"ranks did not all reach the barrier before {tag} within {TEST_WATCHDOG_S:g}s")
        time.sleep(0.01)


def _skip_reason(case: Case, fn: Any, target: str) -> Optional[str]:
    if CTX.backend == "mpi" and not case.multi_rank:
        return "single-process test (no collectives): runs in the gloo run only"
    if CTX.backend == "mpi" and getattr(fn, "_torch_pg_only", None):
        return f"needs torch's process group: {fn._torch_pg_only}"
    return None


def _run_one(case: Case, module: ModuleType, target: str) -> dict[str, Any]:
    if case.skip is not None:
        return {"status": "skip", "detail": case.skip}
    cls = getattr(module, case.cls)
    fn = getattr(cls, case.method)
    reason = _skip_reason(case, fn, target)
    if reason is not None:
        return {"status": "skip", "detail": reason}
    if not case.multi_rank and CTX.rank != 0:
        return {"status": "skip", "detail": "single-process test: rank 0 runs it"}
    result = unittest.TestResult()
    started = time.monotonic()
    faulthandler.dump_traceback_later(TEST_WATCHDOG_S, exit=True)
    try:
        cls(case.method).run(result)
    finally:
        faulthandler.cancel_dump_traceback_later()
        if CTX.backend != "mpi" and dist.is_initialized():
            # A failed test leaves its group behind; the next test needs a fresh one.
            dist.destroy_process_group()
    took = round(time.monotonic() - started, 2)
    if result.errors or result.failures:
        detail = "\n".join(text for _, text in result.errors + result.failures)
        return {"status": "fail", "detail": detail, "seconds": took}
    if result.skipped:
        return {"status": "skip", "detail": result.skipped[0][1], "seconds": took}
    if result.expectedFailures or result.unexpectedSuccesses:
        return {"status": "fail", "detail": "unexpected (expected-failure marker)", "seconds": took}
    return {"status": "pass", "detail": "", "seconds": took}


def rank_main(relpath: str, backend: str, results_dir: str, only: Optional[list[str]] = None) -> int:
    """Run every test of ``upstream/<relpath>`` on this rank; results go to ``results_dir``.

    Args:
        relpath: The ported file, relative to ``upstream/``.
        backend: ``"gloo"`` (torch process groups made per test) or ``"mpi"``
            (shardwise's mpi group, made by ``run_ranks`` before this runs).
        results_dir: Where ``rank<R>.jsonl`` (one line per test) is written.
        only: Run only these test ids (None: all).

    Returns:
        The number of tests this rank ran.
    """
    target = os.environ.get("TORCH_SUITE_TARGET", "shardwise")
    CTX.backend = backend
    if backend == "mpi":
        # run_ranks initialised it with the mpi backend (imported here: see destroy_comms).
        import shardwise

        group = shardwise.get_default_group()
        CTX.rank, CTX.world_size = group.rank, group.size
    else:
        CTX.rank = int(os.environ["RANK"])
        CTX.world_size = int(os.environ["WORLD_SIZE"])
        CTX.store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
            timeout=timedelta(seconds=TEST_WATCHDOG_S),
        )
    torch.set_num_threads(1)
    module = load_port(relpath)
    out = Path(results_dir) / f"rank{CTX.rank}.jsonl"
    ran = 0
    with open(out, "a", buffering=1) as sink:
        for index, case in enumerate(cases_of(relpath)):
            if only is not None and case.id not in only:
                continue
            CTX.test_index = index
            _barrier(f"{index}")
            try:
                record = _run_one(case, module, target)
            except BaseException:  # noqa: BLE001 - the harness itself failed: report, go on
                record = {"status": "fail", "detail": "harness error:\n" + traceback.format_exc()}
            record["id"] = case.id
            sink.write(json.dumps(record) + "\n")
            ran += 1
    return ran
