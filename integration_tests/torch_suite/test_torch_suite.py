"""PyTorch's own ``torch.distributed._shard`` tests (ported, ``upstream/``), one pytest result per upstream test.

Environment:
    TORCH_SUITE_TARGET: ``shardwise`` (default) or ``torch`` (the baseline:
        the same tests against torch 2.13's ``_shard``).
    TORCH_SUITE_BACKEND: ``gloo`` (default; 4 spawned ranks, a torch gloo
        process group per test) or ``mpi`` (4 ranks under ``mpiexec``,
        shardwise's ``mpi`` backend; shardwise only).
    TORCH_SUITE_FILES: optional comma-separated ported files to run
        (``sharded_tensor/ops/test_init.py``); default all.

The first two are also options (``--torch-suite-target``,
``--torch-suite-backend``, see conftest.py).

Each ported file runs in one launch of 4 ranks (``shardwise.testing.run_ranks``:
a timeout, every rank's traceback); the first test of a file starts it and
the others read its results.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import pytest
from suite_harness import DIFFERENCES, PORT_DIR, SUITE_DIR, TEST_GPU_NUM, Case, cases_of, load_port, rank_main

from shardwise.testing import RankError, run_ranks

TARGET = os.environ.get("TORCH_SUITE_TARGET", "shardwise")
BACKEND = os.environ.get("TORCH_SUITE_BACKEND", "gloo")
#: Seconds one file's launch may take (all its tests, 4 ranks).
LAUNCH_TIMEOUT_S = float(os.environ.get("TORCH_SUITE_LAUNCH_TIMEOUT", "420"))

FILES = sorted(str(p.relative_to(PORT_DIR)) for p in PORT_DIR.rglob("test_*.py"))
if os.environ.get("TORCH_SUITE_FILES"):
    FILES = [f for f in FILES if f in os.environ["TORCH_SUITE_FILES"].split(",")]

CASES: list[Case] = [case for relpath in FILES for case in cases_of(relpath)]

#: torch's TestCase appends a "to reproduce, run ..." hint to every failure; the ports are not run that way.
_RANK_ENV = {"PYTORCH_PRINT_REPRO_ON_FAILURE": "0"}

_RESULTS: dict[str, dict[str, dict[str, Any]]] = {}


def _launch(relpath: str) -> dict[str, dict[str, Any]]:
    """Run one ported file on 4 ranks; per test id, the merged outcome."""
    with tempfile.TemporaryDirectory(prefix="torch-suite-") as tmp:
        launch_error = ""
        try:
            if BACKEND == "mpi":
                run_ranks(rank_main, TEST_GPU_NUM, backend="mpi", launcher="mpiexec",
                          args=(relpath, "mpi", tmp), timeout=LAUNCH_TIMEOUT_S, env=_RANK_ENV)
            else:
                run_ranks(rank_main, TEST_GPU_NUM, backend=None, args=(relpath, "gloo", tmp),
                          timeout=LAUNCH_TIMEOUT_S, env=_RANK_ENV)
        except RankError as exc:
            launch_error = str(exc)
        per_rank: list[dict[str, dict[str, Any]]] = []
        for rank in range(TEST_GPU_NUM):
            path = Path(tmp) / f"rank{rank}.jsonl"
            lines = path.read_text().splitlines() if path.exists() else []
            per_rank.append({rec["id"]: rec for rec in map(json.loads, lines)})
    merged = {}
    for case in cases_of(relpath):
        records = [ranks.get(case.id) for ranks in per_rank]
        merged[case.id] = _merge(records, launch_error)
    return merged


#: Errors a rank raises because a peer failed first (the cause is elsewhere).
_SECONDARY = ("Connection closed by peer", "PeerError", "PeerLostError", "Timed out", "timed out", "Connection reset")


def cause_of(traceback_text: str) -> str:
    """The exception line (``Type: message``, first line) ending the last traceback in ``traceback_text``."""
    lines = traceback_text.rstrip().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    for line in lines[starts[-1] + 1 :] if starts else lines:
        if line and not line.startswith((" ", "\t")):
            return line.strip()
    return lines[-1].strip() if lines else "(no traceback)"


def _merge(records: list[Any], launch_error: str) -> dict[str, Any]:
    failed = [(rank, rec) for rank, rec in enumerate(records) if rec is not None and rec["status"] == "fail"]
    if failed:
        details = []
        seen: set[str] = set()
        for rank, rec in failed:
            if rec["detail"] not in seen:
                seen.add(rec["detail"])
                details.append(f"--- rank {rank} ---\n{rec['detail']}")
        ranks = [rank for rank, _ in failed]
        causes = [(rank, cause_of(rec["detail"])) for rank, rec in failed]
        primary = next(((r, c) for r, c in causes if not any(s in c for s in _SECONDARY)), causes[0])
        head = f"{primary[1]}  [rank {primary[0]}; failed on rank(s) {ranks}]"
        missing = [rank for rank, rec in enumerate(records) if rec is None]
        if missing:
            # A rank that died mid-test leaves no record; its peers' errors are secondary.
            head += f"; no result from rank(s) {missing} (died?)"
            details.append(f"--- launch ---\n{launch_error}")
        return {"status": "fail", "detail": head + "\n" + "\n".join(details)}
    missing = [rank for rank, rec in enumerate(records) if rec is None]
    if missing:
        return {"status": "fail", "detail": f"no result from rank(s) {missing} (launch died)\n{launch_error}"}
    if any(rec["status"] == "pass" for rec in records):
        return {"status": "pass", "detail": ""}
    return {"status": "skip", "detail": records[0]["detail"]}


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_upstream(case: Case) -> None:
    if BACKEND == "mpi" and TARGET != "shardwise":
        pytest.skip("torch 2.13 has no mpi backend here: the mpi run is for shardwise")
    if BACKEND == "mpi":
        pytest.importorskip("shardwise_mpi", reason="the mpi run needs shardwise-mpi[mpich]")
    if case.skip is not None:
        pytest.skip(case.skip)
    if case.file not in _RESULTS:
        _RESULTS[case.file] = _launch(case.file)
    outcome = _RESULTS[case.file][case.id]
    if outcome["status"] == "skip":
        pytest.skip(outcome["detail"])
    difference = getattr(getattr(getattr(load_port(case.file), case.cls), case.method), "_differs_on_shardwise", None)
    if TARGET == "shardwise" and difference is not None:
        _check_difference(difference, outcome)
    if outcome["status"] == "fail":
        pytest.fail(outcome["detail"], pytrace=False)


def _check_difference(key: str, outcome: dict[str, Any]) -> None:
    """A test asserting torch's side of a deliberate difference must fail exactly at that difference."""
    reason, expected = DIFFERENCES[key]
    if outcome["status"] == "pass":
        pytest.fail(
            f"passes on shardwise although marked as the deliberate difference {key!r}: remove the marker "
            f"(and check the differences table in docs/migrating.md)",
            pytrace=False,
        )
    cause = outcome["detail"].splitlines()[0]
    if not re.search(expected, cause):
        pytest.fail(
            f"expected to fail at the deliberate difference {key!r} ({expected}), failed elsewhere:\n"
            + outcome["detail"],
            pytrace=False,
        )
    pytest.xfail(f"deliberate difference {key!r}: {reason} (failed as expected: {cause[:200]})")


def test_scope_md_lists_every_skip() -> None:
    """SCOPE.md names every test skipped anywhere: out of scope, deliberate difference, gloo-only."""
    scope = (SUITE_DIR / "SCOPE.md").read_text()
    unlisted = []
    for case in CASES:
        fn = None if case.skip else getattr(getattr(load_port(case.file), case.cls), case.method)
        marked = (
            case.skip is not None
            or not case.multi_rank
            or getattr(fn, "_torch_pg_only", None)
            or getattr(fn, "_differs_on_shardwise", None)
        )
        row = f"| `{case.file}` | `{case.cls}.{case.method}` |"
        if marked and row not in scope:
            unlisted.append(case.id)
    assert not unlisted, f"SCOPE.md does not list these skipped tests: {unlisted}"
