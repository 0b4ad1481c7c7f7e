"""The recommendation demo (``examples/recsys.py --tiny``) under the real launchers.

It trains on 2 ranks under ``mpiexec`` (backend mpi) and saves a
checkpoint, which then resumes on 3 ranks, once under ``mpiexec`` and once
under ``torchrun`` with backend gloo. Every run must end with rank 0's
dense replay of all its steps matching the sharded run. Skipped where no
mpiexec is installed; every job is killed (its whole process group) after
``DEMO_TIMEOUT`` seconds, and its full output is in the assertion message.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from test_torchrun_gloo import _environment, _run, torchrun

pytest.importorskip("shardwise_mpi", reason="shardwise-mpi is not installed in this env")
pytest.importorskip("shardwise_embedding", reason="the demo's sharded tables need shardwise-embedding")
try:
    from shardwise.testing import find_mpiexec

    MPIEXEC = find_mpiexec()
except FileNotFoundError as exc:  # pragma: no cover - depends on the env
    pytest.skip(f"no mpiexec: {exc}", allow_module_level=True)

DEMO = Path(__file__).resolve().parents[1] / "examples" / "recsys.py"

#: Seconds one tiny demo job may take: it trains for well under a second,
#: the rest is starting the ranks and importing torch on a small machine.
DEMO_TIMEOUT = 180

#: The tiny demo's default number of steps per run.
TINY_STEPS = 12


def _mpiexec(n: int, *args: str) -> str:
    env = _environment(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.pop("SHARDWISE_TIMEOUT", None)  # the mpi backend enforces none; leave the demo's default
    result = _run([MPIEXEC, "-n", str(n), sys.executable, str(DEMO), "--tiny", *args], DEMO_TIMEOUT, env)
    assert result.returncode == 0, f"mpiexec exited {result.returncode}; output:\n{result.stdout}"
    return result.stdout


def _assert_matches_dense(out: str, ranks: int, last_step: int) -> None:
    assert f"dense reference (1 process, plain nn.EmbeddingBag, steps 0..{last_step}):" in out, out
    assert f"the MLP is identical on all {ranks} ranks" in out, out
    assert "dense reference: MATCH" in out, out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint of the tiny demo after training on 2 ranks under mpiexec."""
    path = tmp_path_factory.mktemp("demo") / "recsys"
    out = _mpiexec(2, "--checkpoint", str(path))
    assert f"trained steps 0..{TINY_STEPS - 1} on 2 ranks (mpi)" in out, out
    assert f"saved {path} at step {TINY_STEPS}" in out, out
    _assert_matches_dense(out, ranks=2, last_step=TINY_STEPS - 1)
    return path


def _assert_resumed(out: str, path: Path, label: str) -> None:
    assert f"resumed {path} at step {TINY_STEPS} (2 ranks (mpi) trained steps up to {TINY_STEPS - 1}) on {label}" in out
    assert re.search(rf"first resumed step {TINY_STEPS}: loss \d\.\d{{4}}", out), out
    assert f"trained steps {TINY_STEPS}..{2 * TINY_STEPS - 1} on {label}" in out, out
    _assert_matches_dense(out, ranks=3, last_step=2 * TINY_STEPS - 1)


def test_demo_resumes_on_three_ranks_under_mpiexec(checkpoint: Path) -> None:
    out = _mpiexec(3, "--resume", str(checkpoint))
    _assert_resumed(out, checkpoint, "3 ranks (mpi)")


def test_demo_resumes_on_three_ranks_under_torchrun_with_gloo(checkpoint: Path) -> None:
    pytest.importorskip("shardwise_gloo", reason="the torchrun half needs shardwise-gloo")
    result = torchrun(DEMO, 3, DEMO_TIMEOUT, args=("--tiny", "--backend", "gloo", "--resume", str(checkpoint)))
    assert result.returncode == 0, f"torchrun exited {result.returncode}; output:\n{result.stdout}"
    _assert_resumed(result.stdout, checkpoint, "3 ranks (gloo)")
