"""Programs that end without ``shardwise.destroy()`` end cleanly, under the real launchers, every time.

``shardwise.init()`` registers an exit handler that tears the default group
down while the interpreter is still whole. Left to interpreter
finalization, gloo's worker threads could still be handing back the last
collectives when Python stopped threads from taking the GIL, and the
process aborted ("terminate called without an active exception",
SIGABRT) in about one run in five.

* stress: ``programs/no_destroy.py`` (the README's first program minus
  ``destroy()``) runs :data:`RUNS` times under ``torchrun`` (gloo, 2 ranks)
  and under ``mpiexec`` (mpi, 2 ranks); every run must exit 0, print each
  rank's line and never "terminate called";
* a rank that raises without ``destroy()`` while its peer is busy outside
  any collective exits at once with status 1 (it does not wait for the
  peer, nor abort), torchrun ends the job long before the group's timeout,
  and torchrun's failure summary shows the exception read from the error
  file the rank wrote, not ``error_file: <N/A>``.

``SHARDWISE_IT_BACKENDS`` picks the halves (tox: gloo in
``integration-gloo``, mpi in ``integration-mpi``); every launch has a hard
timeout that kills its whole process group.
"""

from __future__ import annotations

import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import pytest
from test_dying_ranks import _mpiexec, _needs
from test_torchrun_gloo import PROGRAMS, _environment, _run, torchrun

#: Launches per launcher (``SHARDWISE_IT_EXIT_RUNS`` raises it for a longer hunt).
RUNS = max(20, int(os.environ.get("SHARDWISE_IT_EXIT_RUNS", "20")))
#: Seconds one two-rank launch may take on a loaded small machine.
LAUNCH_TIMEOUT = 150
#: Jobs run side by side: one per two cores (each job is two ranks).
PARALLEL = max(1, min(4, (os.cpu_count() or 2) // 2))
#: The raising job's group timeout: a failing rank that waited for its peer would take this long.
GROUP_TIMEOUT = 180
#: What the raising job may take: imports and torchrun's own start and stop, far below the timeout.
PROMPT = 90


def _launch(cmd: list[str], env: dict[str, str]) -> tuple[Optional[int], str]:
    """Run one job; its exit status (None when killed at the timeout) and output."""
    try:
        result = _run(cmd, LAUNCH_TIMEOUT, env)
    except pytest.fail.Exception as exc:  # _run fails the test at a timeout; count it as a failed run instead
        return None, str(exc)
    return result.returncode, result.stdout


def _stress(cmd: list[str], env: dict[str, str], done: list[str]) -> None:
    """Launch ``cmd`` :data:`RUNS` times; fail listing every run that did not end cleanly."""
    with ThreadPoolExecutor(PARALLEL) as pool:
        runs = list(pool.map(lambda _: _launch(cmd, env), range(RUNS)))
    bad = []
    for number, (status, out) in enumerate(runs, 1):
        missing = [line for line in done if line not in out]
        if status != 0 or "terminate called" in out or missing:
            bad.append(f"--- run {number}: exit {status}, missing {missing}\n{out[-3000:]}")
    assert not bad, f"{len(bad)} of {RUNS} runs of {' '.join(cmd)} did not end cleanly:\n" + "\n".join(bad)


def test_torchrun_gloo_program_without_destroy_exits_cleanly_every_time() -> None:
    _needs("gloo")
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", "--nproc-per-node", "2", "--max-restarts", "0",
        str(PROGRAMS / "no_destroy.py"),
    ]  # fmt: skip
    _stress(cmd, _environment(), [f"rank {r} of 2 (gloo) done" for r in (0, 1)])


def test_mpiexec_program_without_destroy_exits_cleanly_every_time() -> None:
    mpiexec = _mpiexec()
    env = _environment(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = [mpiexec, "-n", "2", sys.executable, str(PROGRAMS / "no_destroy.py")]
    _stress(cmd, env, [f"rank {r} of 2 (mpi) done" for r in (0, 1)])


# -- a rank that raises ----------------------------------------------------------------------


def _failure_of(out: str, rank: int) -> str:
    """Rank ``rank``'s entry in torchrun's failure summary (``time``, ``rank``, ``exitcode``, ``error_file``, ...)."""
    for entry in re.split(r"^\[\d+\]:$", out, flags=re.MULTILINE)[1:]:
        entry = re.split(r"^(?:-{10,}|={10,})$", entry, maxsplit=1, flags=re.MULTILINE)[0]
        if re.search(rf"^\s*rank\s*: {rank} \(local_rank: {rank}\)$", entry, flags=re.MULTILINE):
            return entry
    raise AssertionError(f"torchrun's summary has no entry for rank {rank}; output:\n{out}")


@pytest.fixture(scope="module")
def raising_job() -> tuple[str, float]:
    """``programs/raise_without_destroy.py`` under torchrun, once for the tests below: its output and duration."""
    _needs("gloo")
    started = time.monotonic()
    result = torchrun(
        PROGRAMS / "raise_without_destroy.py", timeout=GROUP_TIMEOUT + 60, SHARDWISE_TIMEOUT=str(GROUP_TIMEOUT)
    )
    elapsed = time.monotonic() - started
    assert result.returncode != 0, f"torchrun exited 0 although rank 1 raised; output:\n{result.stdout}"
    assert "finished although rank 1 failed" not in result.stdout, result.stdout
    return result.stdout, elapsed


def test_rank_raising_without_destroy_exits_at_once_with_status_1(raising_job: tuple[str, float]) -> None:
    out, elapsed = raising_job
    entry = _failure_of(out, 1)
    status = re.search(r"^\s*exitcode\s*: (-?\d+)", entry, flags=re.MULTILINE)
    assert status is not None and status.group(1) == "1", f"rank 1 did not exit with status 1:\n{entry}\n{out}"
    assert "terminate called" not in out and "SIGABRT" not in out, out
    assert elapsed < PROMPT, (
        f"the job took {elapsed:.0f}s (group timeout {GROUP_TIMEOUT}s): the failing rank waited for its peer; "
        f"output:\n{out}"
    )


def test_torchrun_summary_shows_the_exception_from_the_error_file(raising_job: tuple[str, float]) -> None:
    out, _ = raising_job
    entry = _failure_of(out, 1)
    assert "error_file: <N/A>" not in entry, f"rank 1 wrote no error file:\n{entry}"
    assert re.search(r"error_file: \S+error\.json", entry), entry
    assert "traceback : Traceback (most recent call last)" in entry, entry
    assert "raise RuntimeError(MARKER)" in entry, entry  # the program's own frame, from the recorded traceback
    assert "RuntimeError: deliberate failure on rank 1" in entry, entry
