"""The DLRM demo (``examples/dlrm.py --tiny``) under ``mpiexec``: planned, trained, checkpointed, resumed.

It trains on 2 ranks (backend mpi) with the planner's plan and saves a
checkpoint, which then resumes on 3 ranks under a plan made for 3. Each run
must print the plan's explanation, exit 0 and end with rank 0's one-process
replay of every step so far matching the sharded run. Skipped where no
mpiexec is installed; each job is killed (its whole process group) after
``DEMO_TIMEOUT`` seconds, and its full output is in the assertion message.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("shardwise_embedding", reason="the demo's collection needs shardwise-embedding")
# test_mpiexec skips this module too where shardwise-mpi or an mpiexec is missing.
from test_mpiexec import mpiexec, run_mpiexec  # noqa: E402

DEMO = Path(__file__).resolve().parents[1] / "examples" / "dlrm.py"

#: Seconds one tiny job may take: it trains for about a second; the rest is
#: starting the ranks and importing torch on a small machine.
DEMO_TIMEOUT = 120

#: The tiny demo's default number of steps per run.
TINY_STEPS = 10


def _mpiexec(n: int, *args: str) -> str:
    return mpiexec(DEMO, n, "--tiny", *args, timeout=DEMO_TIMEOUT)


def _assert_planned(out: str, ranks: int) -> None:
    """The run printed the planner's explanation, for ``ranks`` ranks and all 26 tables."""
    assert f"Sharding plan for {ranks} rank(s): 26 table(s)" in out, out
    for table in ("C1", "C3", "C26"):
        assert re.search(rf"^  {table} +\d+ x 8 ", out, flags=re.MULTILINE), out


def _assert_matches_replay(out: str, ranks: int, last_step: int) -> None:
    assert f"dense replay (1 process, unsharded tables, steps 0..{last_step}):" in out, out
    assert f"the MLPs are identical on all {ranks} ranks" in out, out
    assert "dense replay: MATCH" in out, out
    # One all-to-all of ids and one of pooled vectors per step, counted on every rank.
    assert re.search(
        r"^exchanged per step \(one all-to-all of ids, one of pooled vectors\): rank 0 sent ", out, flags=re.MULTILINE
    ), out


def test_dlrm_demo_trains_on_two_ranks_and_resumes_on_three(tmp_path: Path) -> None:
    path = tmp_path / "dlrm-ckpt"
    out = _mpiexec(2, "--checkpoint", str(path))
    _assert_planned(out, 2)
    assert f"trained steps 0..{TINY_STEPS - 1} on 2 ranks (mpi)" in out, out
    assert f"saved {path} at step {TINY_STEPS}" in out, out
    _assert_matches_replay(out, ranks=2, last_step=TINY_STEPS - 1)

    # The resumed run trains through SparseDistPipeline: its steps must match the dense replay all the same.
    out = _mpiexec(3, "--resume", str(path), "--pipeline")
    _assert_planned(out, 3)
    assert (
        f"resumed {path} at step {TINY_STEPS} (2 ranks (mpi) trained steps up to {TINY_STEPS - 1}) on 3 ranks (mpi), "
        "under a new plan" in out
    ), out
    assert re.search(rf"first resumed step {TINY_STEPS}: loss \d\.\d{{4}}", out), out
    assert f"trained steps {TINY_STEPS}..{2 * TINY_STEPS - 1} on 3 ranks (mpi)" in out, out
    _assert_matches_replay(out, ranks=3, last_step=2 * TINY_STEPS - 1)


def test_dlrm_demo_refuses_a_checkpoint_of_the_other_size(tmp_path: Path) -> None:
    path = tmp_path / "dlrm-ckpt"
    _mpiexec(2, "--checkpoint", str(path), "--steps", "2")
    result = run_mpiexec(DEMO, 2, "--resume", str(path), timeout=DEMO_TIMEOUT)
    assert result.returncode == 2, f"mpiexec exited {result.returncode}; output:\n{result.stdout}"
    assert f"dlrm.py: error: {path} holds the tiny model: resume it with --tiny" in result.stdout, result.stdout
