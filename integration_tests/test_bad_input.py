"""The bad-input battery (``programs/bad_input.py``) under real launchers: a clear error on every rank, no hang.

One launch per backend (2 ranks): ``gloo`` under ``torchrun --standalone``
and ``mpi`` under ``mpiexec``. Each launch runs every case of the
program's :data:`CASES` table and prints one line per case and rank; the
module-scoped fixture parses them, and one test per case and backend checks
that every rank printed its line, raised the expected exception type with a
message naming the cause (``bad_input.expected``), and did so quickly.
The table in the program is the only list of cases and expectations.

``SHARDWISE_IT_BACKENDS`` (comma-separated, default ``gloo,mpi``) selects the
backends, so one tox env can run gloo and another mpi. A backend whose
plugin (or, for mpi, whose ``mpiexec``) is not installed is skipped.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from test_torchrun_gloo import PROGRAMS, _environment, _run, torchrun

PROGRAM = PROGRAMS / "bad_input.py"
RANKS = 2
#: Seconds one case may take on a rank (a hang would take the group's timeout).
CASE_LIMIT = 10.0
#: Hard limit for a whole launch (then it is killed); the job itself takes a few seconds plus start-up.
JOB_LIMIT = 180
#: What a whole launch should take at most, start-up included (it takes about 5 s on 2 busy cores).
JOB_TARGET = 60.0
#: What a rank waits for a lost peer before failing (well below JOB_LIMIT, so a hang ends as an error).
PEER_TIMEOUT = "30"
BACKENDS_ENV = "SHARDWISE_IT_BACKENDS"


def _load_program() -> ModuleType:
    """Import ``programs/bad_input.py`` (for its table; importing it runs nothing)."""
    spec = importlib.util.spec_from_file_location("bad_input", PROGRAM)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


battery = _load_program()
CASE_NAMES = [case.name for case in battery.CASES]
CASES = {case.name: case for case in battery.CASES}


def _selected() -> list[str]:
    raw = os.environ.get(BACKENDS_ENV, "gloo,mpi")
    return [name.strip() for name in raw.split(",") if name.strip()]


@dataclass
class Launch:
    """One launch of the battery and what it printed."""

    backend: str
    output: str
    returncode: int
    seconds: float
    timed_out: bool = False
    #: (case name, rank) -> (elapsed seconds, outcome text)
    lines: dict[tuple[str, int], tuple[float, str]] = field(default_factory=dict)

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.output.splitlines()[-n:])


def _parse(launch: Launch, workdir: Path) -> Launch:
    """Each rank's case lines: from its own ``lines-rank<R>.txt``, else (none written) from the merged stdout."""
    pattern = re.compile(battery.LINE)
    files = sorted(workdir.glob("lines-rank*.txt"))
    text = "".join(f.read_text() for f in files) if files else launch.output
    for line in text.splitlines():
        match = pattern.match(line)
        if match is None:
            continue
        key = (match["name"], int(match["rank"]))
        assert key not in launch.lines, f"{key} printed twice:\n{launch.output}"
        launch.lines[key] = (float(match["elapsed"]), match["outcome"])
    return launch


def _launch_gloo(workdir: Path) -> tuple[int, str]:
    pytest.importorskip("shardwise_gloo", reason="shardwise-gloo is not installed in this env")
    result = torchrun(PROGRAM, RANKS, timeout=JOB_LIMIT, args=(str(workdir),), SHARDWISE_TIMEOUT=PEER_TIMEOUT)
    return result.returncode, result.stdout


def _launch_mpi(workdir: Path) -> tuple[int, str]:
    pytest.importorskip("shardwise_mpi", reason="shardwise-mpi is not installed in this env")
    from shardwise.testing import find_mpiexec

    try:
        mpiexec = find_mpiexec()
    except FileNotFoundError as exc:
        pytest.skip(f"no mpiexec: {exc}")
    # SHARDWISE_TIMEOUT arms the mpi backend's watchdog: a hung case aborts the job instead of waiting for JOB_LIMIT.
    env = _environment(
        OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", SHARDWISE_TIMEOUT=PEER_TIMEOUT
    )
    result = _run([mpiexec, "-n", str(RANKS), sys.executable, str(PROGRAM), str(workdir)], JOB_LIMIT, env)
    return result.returncode, result.stdout


_LAUNCHERS = {"gloo": _launch_gloo, "mpi": _launch_mpi}


@pytest.fixture(scope="module", params=["gloo", "mpi"])
def launch(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Launch:
    """The battery, launched once per backend on 2 ranks (skipped when not selected or not installed)."""
    backend: str = request.param
    if backend not in _selected():
        pytest.skip(f"backend {backend} not in {BACKENDS_ENV}={os.environ.get(BACKENDS_ENV, '')!r}")
    started = time.monotonic()
    workdir = tmp_path_factory.mktemp(f"bad_input_{backend}")
    try:
        returncode, output = _LAUNCHERS[backend](workdir)
    except pytest.fail.Exception as exc:
        # The helper killed a job that outlived JOB_LIMIT and failed with its output in the message;
        # keep that output so each case's test reports whether it ran (the first missing one hung).
        return _parse(Launch(backend, str(exc), -1, time.monotonic() - started, timed_out=True), workdir)
    return _parse(Launch(backend, output, returncode, time.monotonic() - started), workdir)


def test_job_ran_every_case_and_exited_0(launch: Launch) -> None:
    assert not launch.timed_out, f"{launch.backend}: the job was killed after {JOB_LIMIT}s:\n{launch.tail()}"
    assert launch.returncode == 0, f"{launch.backend}: exit {launch.returncode}:\n{launch.tail()}"
    for rank in range(RANKS):
        line = f"rank {rank}: battery done, {len(CASE_NAMES)} cases"
        assert line in launch.output, f"{launch.backend}: no {line!r}:\n{launch.tail()}"
    extra = sorted({name for name, _ in launch.lines} - set(CASE_NAMES))
    assert not extra, f"lines for cases not in the table: {extra}"
    assert launch.seconds < JOB_TARGET, f"{launch.backend}: the launch took {launch.seconds:.0f}s:\n{launch.tail()}"


def _first_missing(launch: Launch) -> str:
    for name in CASE_NAMES:
        if any((name, r) not in launch.lines for r in range(RANKS)):
            return name
    return "(none)"


def _params() -> list[Any]:
    """One per case; a case with a ``known_bug`` is a strict xfail (fixing the bug fails it until the table says so)."""
    return [
        pytest.param(case.name, marks=pytest.mark.xfail(reason=f"known bug: {case.known_bug}", strict=True))
        if case.known_bug
        else case.name
        for case in battery.CASES
    ]


@pytest.mark.parametrize("name", _params())
def test_case(launch: Launch, name: str) -> None:
    case = CASES[name]
    for rank in range(RANKS):
        if (name, rank) not in launch.lines:
            pytest.fail(
                f"{launch.backend}: rank {rank} printed no line for case {name!r} (exit {launch.returncode}, "
                f"timed out: {launch.timed_out}; first case without every rank's line: "
                f"{_first_missing(launch)!r}):\n{launch.tail()}"
            )
    outcomes = {rank: launch.lines[(name, rank)] for rank in range(RANKS)}
    shown = "\n".join(f"  rank {r} ({s:.3f}s): {text}" for r, (s, text) in outcomes.items())
    if all(text.startswith("SKIPPED: ") for _, text in outcomes.values()):
        pytest.skip(outcomes[0][1])
    culprit = battery.culprit_of(case, {rank: text.partition(": ")[0] for rank, (_, text) in outcomes.items()})
    for rank, (seconds, text) in outcomes.items():
        want = battery.expected(case, rank, culprit)
        kind, _, message = text.partition(": ")
        assert re.fullmatch(want.error, kind), (
            f"{launch.backend}: case {name}: rank {rank} raised {kind}, expected {want.error}:\n{shown}"
        )
        assert re.search(want.pattern, message, re.IGNORECASE), (
            f"{launch.backend}: case {name}: rank {rank}'s message does not match {want.pattern!r}:\n{shown}"
        )
        assert seconds < CASE_LIMIT, f"{launch.backend}: case {name}: rank {rank} took {seconds:.1f}s:\n{shown}"
