"""A rank killed (SIGKILL) or frozen (SIGSTOP) mid-collective, mid-reshard and mid-checkpoint-save.

Three ranks run ``programs/dying_rank.py``; rank 1 ends itself inside the
work. What must happen (and what docs/failures.md states):

* gloo, ranks started without a supervising launcher (plain ``RANK`` /
  ``WORLD_SIZE`` / ``MASTER_*``, as ``srun`` or a script starts them): every
  survivor raises :class:`shardwise.errors.PeerLostError` naming itself and
  the collective, within the group's timeout, and exits non-zero;
* under ``torchrun`` and under ``mpiexec``: the launcher ends the job and
  exits non-zero;
* mpi, a frozen peer (the launcher sees nothing wrong): a survivor's
  watchdog reports the collective and the timeout and aborts the job;
* a save killed half-way leaves the previous checkpoint: it loads on another
  world size bit for bit, its files unchanged.

Every job runs under a hard timeout that kills its whole process group.
``SHARDWISE_IT_BACKENDS`` (default ``gloo,mpi``) picks which halves run, so
tox runs the gloo half in ``integration-gloo`` and the mpi half in
``integration-mpi``.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest
from test_torchrun_gloo import PROGRAMS, _environment, _run, torchrun

PROGRAM = PROGRAMS / "dying_rank.py"
#: The group timeout the jobs run with (seconds).
TIMEOUT = 5
#: What a survivor may take beyond the timeout (imports excluded: measured
#: from the start of the phase) on a loaded 2-core machine.
SLACK = 10
JOB_TIMEOUT = 120
PHASES = ["collective", "reshard", "checkpoint"]

_BACKENDS = {b.strip() for b in os.environ.get("SHARDWISE_IT_BACKENDS", "gloo,mpi").split(",") if b.strip()}


def _needs(backend: str) -> None:
    if backend not in _BACKENDS:
        pytest.skip(f"{backend} half not selected (SHARDWISE_IT_BACKENDS={','.join(sorted(_BACKENDS))})")
    pytest.importorskip(f"shardwise_{backend}", reason=f"shardwise-{backend} is not installed in this env")


def _mpiexec() -> str:
    _needs("mpi")
    from shardwise.testing import find_mpiexec

    try:
        return find_mpiexec()
    except FileNotFoundError as exc:
        pytest.skip(f"no mpiexec: {exc}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(n: int, *args: str, frozen: Optional[int] = None) -> tuple[list[int], list[str], float]:
    """Start ``n`` ranks of PROGRAM as plain processes (no supervising launcher); wait for all.

    Returns each rank's exit code and output, and the wall time. A rank
    still running after JOB_TIMEOUT fails the test (it hung), except the
    ``frozen`` rank, which is killed once the others have ended.
    """
    env = _environment(SHARDWISE_TIMEOUT=str(TIMEOUT), SHARDWISE_BACKEND="gloo")
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(n))
    procs = []
    started = time.monotonic()
    for rank in range(n):
        procs.append(
            subprocess.Popen(
                [sys.executable, str(PROGRAM), *args],
                env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                text=True,
                start_new_session=True,
            )
        )
    codes, outputs, hung = [0] * n, [""] * n, []
    try:
        for rank in sorted(range(n), key=lambda r: r == frozen):  # the frozen rank last
            proc = procs[rank]
            if rank == frozen:
                os.killpg(proc.pid, signal.SIGKILL)
            left = max(1.0, JOB_TIMEOUT - (time.monotonic() - started))
            try:
                out, _ = proc.communicate(timeout=left)
            except subprocess.TimeoutExpired:
                hung.append(rank)
                os.killpg(proc.pid, signal.SIGKILL)
                out, _ = proc.communicate()
            codes[rank], outputs[rank] = proc.returncode, out
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the frozen victim, if any
            except ProcessLookupError:
                pass
    elapsed = time.monotonic() - started
    for rank, out in enumerate(outputs):
        print(f"----- rank {rank} (exit {codes[rank]}) -----\n{out}")
    assert not hung, f"ranks {hung} were still running after {JOB_TIMEOUT}s:\n" + "\n".join(outputs)
    return codes, outputs, elapsed


def _failure(out: str, rank: int, phase: str) -> tuple[float, str]:
    """(seconds into the phase, error) from a survivor's ``FAILED`` line."""
    found = re.search(rf"^rank {rank}: FAILED in {phase} after ([\d.]+) s: (.*)$", out, re.M)
    assert found, f"rank {rank} printed no FAILED line:\n{out}"
    return float(found.group(1)), found.group(2)


def _digest(out: str) -> str:
    found = re.search(r"v1 saved by \d ranks, digest ([0-9a-f]{64})", out)
    assert found, f"the first checkpoint was not saved:\n{out}"
    return found.group(1)


# -- gloo ---------------------------------------------------------------------------------


@pytest.mark.parametrize("phase", PHASES)
def test_gloo_survivors_raise_peer_lost_error_when_a_rank_is_killed(phase: str, tmp_path: Path) -> None:
    _needs("gloo")
    path = tmp_path / "ckpt"
    codes, outputs, _ = _spawn(3, phase, str(path))
    assert codes[1] == -signal.SIGKILL, outputs[1]
    for rank in (0, 2):
        assert codes[rank] == 1, f"rank {rank} exited {codes[rank]}:\n{outputs[rank]}"
        seconds, error = _failure(outputs[rank], rank, phase)
        assert error.startswith(f"PeerLostError: rank {rank} of 3: "), error
        # Either the transport noticed, or (ranks on one host) the closing round of a copy between
        # processes reported a peer's read from the killed rank's memory failing with ESRCH.
        transport = "on the gloo backend failed" in error and "A peer has probably died" in error
        copy = "by cross-memory attach failed" in error and "ESRCH" in error and "peer process is gone" in error
        assert transport or copy, error
        assert seconds < TIMEOUT + SLACK, f"rank {rank} took {seconds} s"
    if phase == "checkpoint":
        # The killed save left the first checkpoint: it loads on 2 ranks, bit for bit, files unchanged.
        codes, outputs, _ = _spawn(2, "verify", str(path), "--digest", _digest(outputs[0]))
        assert codes == [0, 0], outputs
        for rank in (0, 1):
            assert f"rank {rank} of 2: the previous checkpoint loads and equals v1 bit for bit" in outputs[rank]


def test_gloo_survivors_time_out_when_a_rank_freezes(tmp_path: Path) -> None:
    _needs("gloo")
    codes, outputs, _ = _spawn(3, "collective", str(tmp_path / "unused"), "--how", "stop", frozen=1)
    for rank in (0, 2):
        assert codes[rank] == 1, f"rank {rank} exited {codes[rank]}:\n{outputs[rank]}"
        seconds, error = _failure(outputs[rank], rank, "collective")
        assert re.match(
            rf"PeerLostError: rank {rank} of 3: all_reduce( \(agreeing on its arguments\))? on the gloo backend failed",
            error,
        ), error
        # Rank 1 is frozen, not gone: its peers learn it only from the timeout (or from a
        # peer that timed out first and closed its connections).
        assert seconds < TIMEOUT + SLACK, f"rank {rank} took {seconds} s"
    assert any("Timed out" in _failure(outputs[r], r, "collective")[1] for r in (0, 2)), outputs


@pytest.mark.parametrize("phase", PHASES)
def test_torchrun_exits_non_zero_when_a_rank_is_killed(phase: str, tmp_path: Path) -> None:
    _needs("gloo")
    started = time.monotonic()
    result = torchrun(PROGRAM, 3, args=(phase, str(tmp_path / "ckpt")))
    assert result.returncode != 0, result.stdout
    assert "rank 1: victim sends itself SIGKILL" in result.stdout, result.stdout
    # torchrun names the dead worker and its signal.
    assert re.search(r"Signal 9 \(SIGKILL\) received by PID|exitcode\s*:\s*-9", result.stdout), result.stdout
    assert time.monotonic() - started < JOB_TIMEOUT


# -- mpi ----------------------------------------------------------------------------------


def _mpi_job(n: int, *args: str) -> subprocess.CompletedProcess[str]:
    env = _environment(SHARDWISE_TIMEOUT=str(TIMEOUT), OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return _run([_mpiexec(), "-n", str(n), sys.executable, str(PROGRAM), *args], JOB_TIMEOUT, env)


@pytest.mark.parametrize("phase", PHASES)
def test_mpiexec_ends_the_job_when_a_rank_is_killed(phase: str, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    started = time.monotonic()
    result = _mpi_job(3, phase, str(path))
    assert result.returncode != 0, result.stdout
    assert "rank 1: victim sends itself SIGKILL" in result.stdout, result.stdout
    # The process manager names the death: MPICH's Hydra "Killed (signal 9)", Open MPI "exited on signal 9 (Killed)".
    assert re.search(r"Killed \(signal 9\)|exited on signal 9 \(Killed\)", result.stdout), result.stdout
    assert time.monotonic() - started < JOB_TIMEOUT
    if phase == "checkpoint":
        result = _mpi_job(2, "verify", str(path), "--digest", _digest(result.stdout))
        assert result.returncode == 0, result.stdout
        for rank in (0, 1):
            assert f"rank {rank} of 2: the previous checkpoint loads and equals v1 bit for bit" in result.stdout


@pytest.mark.parametrize("phase", ["collective", "reshard"])
def test_mpi_watchdog_aborts_the_job_when_a_rank_freezes(phase: str, tmp_path: Path) -> None:
    result = _mpi_job(3, phase, str(tmp_path / "unused"), "--how", "stop")
    # 124 is the status the watchdog passes to MPI_Abort (or os._exit); MPICH's own
    # "application called MPI_Abort" line is not asserted: the process manager
    # sometimes tears the job down before the library has written it.
    assert result.returncode == 124, result.stdout
    found = re.search(
        r"shardwise: rank (\d) of 3: (.+?) on the mpi backend has waited ([\d.]+) s for its peers, longer than "
        rf"the group's timeout \({TIMEOUT} s",
        result.stdout,
    )
    assert found, result.stdout
    assert found.group(1) in ("0", "2"), found.group(0)
    assert TIMEOUT <= float(found.group(3)) < TIMEOUT + SLACK, found.group(0)
