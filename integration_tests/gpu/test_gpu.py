"""Runs ``check_gpu.py`` (beside this file) in subprocesses and checks its PASS/FAIL/SKIP lines.

On a machine with CUDA the real checks run: world size 1 under plain
python (nccl when shardwise-nccl is installed), and backend mpi with CUDA
tensors under ``mpiexec -n 2`` when shardwise-mpi is installed. Everywhere,
the program's own logic runs on the CPU (``--device cpu``), at world size 1
and at 2 (torchrun; mpiexec when installed), so a CI machine without a GPU
still finds a broken check before a GPU machine does.

Every run gets its own session and a hard timeout after which the whole
process group is killed; the full output is in every assertion message.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# The job helpers every integration test uses live one directory up.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_torchrun_gloo import _environment as job_environment  # noqa: E402
from test_torchrun_gloo import _run as run_job  # noqa: E402

SCRIPT = Path(__file__).with_name("check_gpu.py")

#: Seconds one run may take (ranks importing torch on a small machine, CUDA and NCCL start-up);
#: below the suite's pytest --timeout of 300.
RUN_TIMEOUT = 240

#: The 1.2x throughput target is a GPU's; a shared CPU (other jobs, two cores) only has to show that
#: the timing logic runs and the timed calls compute the right thing.
CPU_TARGET = "3"

HAS_CUDA = torch.cuda.is_available()

def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _environment(*, gpu: bool) -> dict[str, str]:
    # The launch variables of a surrounding job are dropped and the timeout shortened as for every
    # integration job; a CPU run stays on the CPU on a GPU machine too.
    env = job_environment(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    if gpu:
        env.pop("CUDA_VISIBLE_DEVICES")
        if "CUDA_VISIBLE_DEVICES" in os.environ:
            env["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"]
    return env


def _run(cmd: list[str], *, gpu: bool = False) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` in its own session; past :data:`RUN_TIMEOUT` the whole job is killed and the test fails."""
    return run_job(cmd, RUN_TIMEOUT, _environment(gpu=gpu))


def _lines(output: str) -> dict[str, str]:
    """Check name -> status (``PASS``/``FAIL``/``SKIP``) from the program's result lines."""
    return {name: status for status, name in re.findall(r"^(PASS|FAIL|SKIP) ([\w-]+):", output, re.MULTILINE)}


def _check(args: list[str], expected: dict[str, str], *, returncode: int = 0, gpu: bool = False,
           launch: tuple[str, ...] = (sys.executable,)) -> str:
    """Run the program (``launch`` is the command before its path) and check its exit status and result lines.

    Returns:
        The output.
    """
    result = _run([*launch, str(SCRIPT), *args], gpu=gpu)
    assert result.returncode == returncode, f"exit {result.returncode}, expected {returncode}; output:\n{result.stdout}"
    assert _lines(result.stdout) == expected, result.stdout
    return result.stdout


def _mpiexec() -> str:
    if not _installed("shardwise_mpi"):
        pytest.skip("shardwise-mpi is not installed in this environment")
    from shardwise.testing import find_mpiexec

    try:
        return find_mpiexec()
    except FileNotFoundError as exc:
        pytest.skip(f"no mpiexec: {exc}")


def _needs(*modules: str) -> None:
    for module in modules:
        if not _installed(module):
            pytest.skip(f"{module.replace('_', '-')} is not installed in this environment")


# -- on a GPU ----------------------------------------------------------------------------------------


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (this machine has none, or a CPU-only torch)")
def test_checks_pass_on_this_gpu_at_world_size_1() -> None:
    _needs("shardwise_embedding")
    backend = "nccl" if _installed("shardwise_nccl") else "gloo"
    if backend == "gloo":
        _needs("shardwise_gloo")
    expected = {"nccl": "PASS" if backend == "nccl" else "SKIP", "mpi-cuda": "SKIP", "embedding": "PASS",
                "collection": "PASS", "throughput": "PASS"}
    _check(["--backend", backend], expected, gpu=True)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (this machine has none, or a CPU-only torch)")
def test_mpi_with_cuda_tensors_on_two_ranks() -> None:
    mpiexec = _mpiexec()
    _needs("shardwise_embedding")
    out = _check(["--backend", "mpi", "--checks", "mpi-cuda,embedding,collection"],
                 {"mpi-cuda": "PASS", "embedding": "PASS", "collection": "PASS"},
                 gpu=True, launch=(mpiexec, "-n", "2", sys.executable))
    assert re.search(r"PASS mpi-cuda: world size 2, cuda:\d .*(CUDA-aware MPI|staged through host memory)", out), out


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (this machine has none, or a CPU-only torch)")
def test_embedding_on_cuda_at_world_size_2_over_gloo() -> None:
    """The multi-rank lookup algorithms on CUDA tensors (two ranks may share one GPU: gloo stages through the host)."""
    _needs("shardwise_gloo", "shardwise_embedding")
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")
    out = _check(["--backend", "gloo", "--checks", "embedding,collection"], {"embedding": "PASS", "collection": "PASS"},
                 gpu=True, launch=torchrun)
    assert re.search(r"PASS embedding: world size 2, cuda:\d", out), out
    assert re.search(r"PASS collection: world size 2, cuda:\d", out), out


# -- the program's logic, on the CPU (every machine) -------------------------------------------------


def test_without_cuda_it_skips_and_succeeds() -> None:
    result = _run([sys.executable, str(SCRIPT)])  # CUDA_VISIBLE_DEVICES="": no GPU even on a GPU machine
    assert result.returncode == 0, result.stdout
    assert result.stdout.startswith("SKIP: no CUDA device"), result.stdout
    assert not _lines(result.stdout), result.stdout  # nothing ran


def test_cpu_logic_embedding_and_throughput_at_world_size_1() -> None:
    _needs("shardwise_gloo", "shardwise_embedding")
    out = _check(["--device", "cpu", "--backend", "gloo", "--checks", "embedding,throughput", "--small",
                  "--target", CPU_TARGET], {"embedding": "PASS", "throughput": "PASS"})
    assert "[--device cpu: the program's logic on the CPU, not a GPU check]" in out, out
    assert re.search(r"PASS embedding: world size 1, cpu: 8 sharded modules .* lookups exact", out), out
    figures = r"forward dense [\d.]+ ms, sharded [\d.]+ ms, ratio [\d.]+; forward\+backward dense [\d.]+ ms"
    assert re.search(r"PASS throughput: row-wise V=50000 D=64 ids 1024x32 on cpu, median of 25 reps .*" + figures,
                     out), out


def test_cpu_logic_a_missed_target_fails_the_run() -> None:
    _needs("shardwise_gloo", "shardwise_embedding")
    out = _check(["--device", "cpu", "--backend", "gloo", "--checks", "throughput", "--small", "--target", "0"],
                 {"throughput": "FAIL"}, returncode=1)
    assert "target <= 0" in out, out


def test_cpu_logic_nccl_skips_without_a_gpu() -> None:
    _needs("shardwise_gloo")
    _check(["--device", "cpu", "--backend", "gloo", "--checks", "nccl,mpi-cuda"], {"nccl": "SKIP", "mpi-cuda": "SKIP"})


def test_cpu_logic_embedding_at_world_size_2_under_torchrun() -> None:
    _needs("shardwise_gloo", "shardwise_embedding")
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")
    out = _check(["--device", "cpu", "--backend", "gloo", "--checks", "embedding,collection,throughput"],
                 {"embedding": "PASS", "collection": "PASS", "throughput": "SKIP"}, launch=torchrun)
    assert "PASS embedding: world size 2, cpu:" in out and "(every rank; rank 0's figures)" in out, out


def test_cpu_logic_mpi_collectives_and_embedding_at_world_size_2() -> None:
    mpiexec = _mpiexec()
    _needs("shardwise_embedding")
    out = _check(["--device", "cpu", "--backend", "mpi", "--checks", "mpi-cuda,embedding,collection"],
                 {"mpi-cuda": "PASS", "embedding": "PASS", "collection": "PASS"},
                 launch=(mpiexec, "-n", "2", sys.executable))
    assert re.search(r"PASS mpi-cuda: world size 2, cpu, .*CPU tensors \(no CUDA path taken\): \d+ results", out), out
