"""Jobs through a real Slurm: ``srun`` (gloo), ``srun --mpi=pmi2`` (mpi), ``sbatch``, and a killed task.

The module starts a one-node cluster of its own (:mod:`slurm_cluster`:
Debian's slurm-wlm and munge, ``make system-deps``) and stops it at the end.
tox env ``integration-slurm`` runs it as root; elsewhere it skips, saying
what is missing. Every job has a hard timeout after which its whole process
group is killed, and its full output (and the daemons' logs where a job
failed to start) is in the assertion message.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
import slurm_cluster
from test_torchrun_gloo import PROGRAMS, _run

if os.geteuid() != 0:
    pytest.skip("the test cluster runs its daemons and tasks as root", allow_module_level=True)
if slurm_cluster.missing():
    pytest.skip(
        f"not installed: {', '.join(slurm_cluster.missing())} (Debian slurm-wlm and munge; `make system-deps`)",
        allow_module_level=True,
    )

#: Seconds one job may take (2 or 3 tasks importing torch on a small machine).
JOB_TIMEOUT = 180
#: The group timeout the dying-rank jobs run with (SHARDWISE_TIMEOUT): a lost peer is an error by then.
PEER_TIMEOUT = 5


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[slurm_cluster.SlurmCluster]:
    running = slurm_cluster.start(tmp_path_factory.mktemp("slurm"))
    try:
        yield running
    finally:
        running.stop()


def _job(cluster: slurm_cluster.SlurmCluster, cmd: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    result = _run(cmd, JOB_TIMEOUT, cluster.env(**env))
    if "Unable to allocate resources" in result.stdout or "Job submit/allocate failed" in result.stdout:
        pytest.fail(f"Slurm refused the job:\n{result.stdout}\n{cluster.logs()}")
    return result


def _ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, f"exit {result.returncode}; output:\n{result.stdout}"
    return result.stdout


@pytest.mark.parametrize(("mpi", "backend"), [("none", "gloo"), ("pmi2", "mpi")])
def test_srun_runs_the_sharded_example(cluster: slurm_cluster.SlurmCluster, mpi: str, backend: str) -> None:
    if backend == "mpi":
        pytest.importorskip("shardwise_mpi", reason="shardwise-mpi is not installed in this env")
    out = _ok(_job(cluster, ["srun", f"--mpi={mpi}", "-n", "2", sys.executable, str(PROGRAMS / "sharded_readme.py")]))
    # gloo: shardwise.init() took the rendezvous host from SLURM_STEP_NODELIST and a port from the job id.
    assert f"rank 0 ({backend}): ShardedTensor [7, 4]" in out and f"rank 1 ({backend}): ShardedTensor [7, 4]" in out
    assert "rank 0: gathered tensor equals the dense computation" in out, out


def test_sbatch_runs_a_reshard_and_resumes_a_checkpoint_on_another_task_count(
    cluster: slurm_cluster.SlurmCluster, tmp_path: Path
) -> None:
    ckpt, log = tmp_path / "ckpt", tmp_path / "job.out"
    py, programs = sys.executable, PROGRAMS
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n"
        "#SBATCH --ntasks=3\n"
        f"#SBATCH --output={log}\n"
        "set -e\n"
        f"srun -n 2 {py} {programs / 'sharded_readme.py'}\n"
        f"srun -n 2 {py} {programs / 'checkpoint_across_launchers.py'} save {ckpt}\n"
        f"srun -n 3 {py} {programs / 'checkpoint_across_launchers.py'} load {ckpt}\n"
        "echo JOB DONE\n"
    )
    result = _job(cluster, ["sbatch", "--wait", str(script)])
    out = log.read_text() if log.exists() else "(no output file)"
    assert result.returncode == 0, f"sbatch exited {result.returncode}: {result.stdout}\njob output:\n{out}"
    assert "rank 0: gathered tensor equals the dense computation" in out, out
    assert "rank 0 of 2 (gloo) saved" in out and "rank 1 of 2 (gloo) saved" in out, out
    for rank in range(3):
        assert f"rank {rank} of 3 (gloo) loaded" in out, out
    assert "JOB DONE" in out, out


def _dying(
    cluster: slurm_cluster.SlurmCluster, tmp_path: Path, *srun: str
) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    cmd = ["srun", *srun, "-n", "3", sys.executable, str(PROGRAMS / "dying_rank.py"), "collective", str(tmp_path)]
    result = _job(cluster, cmd, SHARDWISE_TIMEOUT=str(PEER_TIMEOUT))
    return result, time.monotonic() - started


@pytest.mark.parametrize("mpi", ["none", "pmi2"])
def test_killed_task_with_kill_on_bad_exit_ends_the_step(
    cluster: slurm_cluster.SlurmCluster, tmp_path: Path, mpi: str
) -> None:
    if mpi == "pmi2":
        pytest.importorskip("shardwise_mpi", reason="shardwise-mpi is not installed in this env")
    result, took = _dying(cluster, tmp_path, f"--mpi={mpi}", "--kill-on-bad-exit=1")
    assert result.returncode != 0, result.stdout
    assert "rank 1: victim sends itself SIGKILL" in result.stdout, result.stdout
    # srun ends the other tasks itself ("Terminated"), without waiting for a timeout.
    assert re.search(r"tasks? [\d,]+: Terminated", result.stdout), result.stdout
    assert took < JOB_TIMEOUT / 2, f"{took:.0f}s\n{result.stdout}"


def test_killed_gloo_task_without_kill_on_bad_exit_raises_on_every_survivor(
    cluster: slurm_cluster.SlurmCluster, tmp_path: Path
) -> None:
    # README's failure table, gloo without a supervising launcher: each survivor raises
    # PeerLostError (at the latest after the timeout) and exits non-zero.
    result, _ = _dying(cluster, tmp_path, "--mpi=none", "--kill-on-bad-exit=0")
    assert result.returncode != 0, result.stdout
    assert "rank 1: victim sends itself SIGKILL" in result.stdout, result.stdout
    for rank in (0, 2):
        assert re.search(rf"rank {rank}: FAILED in collective after [\d.]+ s: PeerLostError", result.stdout), (
            result.stdout
        )


def test_killed_mpi_task_without_kill_on_bad_exit_is_ended_by_the_watchdog(
    cluster: slurm_cluster.SlurmCluster, tmp_path: Path
) -> None:
    pytest.importorskip("shardwise_mpi", reason="shardwise-mpi is not installed in this env")
    # README's failure table, mpi under srun without --kill-on-bad-exit: the survivors block in MPI,
    # and after the timeout a survivor's watchdog says so and calls MPI_Abort(124). srun's own exit
    # status is its worst task's: 137, the victim's SIGKILL.
    result, took = _dying(cluster, tmp_path, "--mpi=pmi2", "--kill-on-bad-exit=0")
    assert result.returncode != 0, result.stdout
    assert re.search(r"shardwise: rank [02] of 3: all_reduce .* has waited [\d.]+ s for its peers", result.stdout), (
        result.stdout
    )
    assert re.search(r"tasks? [\d,]+: Exited with exit code 124", result.stdout), result.stdout
    assert took < JOB_TIMEOUT / 2, f"{took:.0f}s\n{result.stdout}"
