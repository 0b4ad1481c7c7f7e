"""torch.distributed backend "mpi4py": real ``mpiexec`` programs with no rendezvous variables.

Each program lives in ``programs_c10d/`` and prints ``OK <rank> ...`` per rank;
a failing rank prints its traceback and exits non-zero, which ends the job.
On failure the test shows every rank's stdout and stderr.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from mpi_launch import KIND, MPIEXEC, needs_mpiexec, run, show

PROGRAMS = Path(__file__).parent / "programs_c10d"
pytest.importorskip("mpi4py")

_run, _show = run, show


def _ok_ranks(proc: subprocess.CompletedProcess[str]) -> dict[int, int]:
    """``{rank: number of checks}`` from the ``OK <rank> <checks>`` lines."""
    # Ranks' lines can interleave in the launcher's output: match, do not split lines.
    return {int(r): int(c) for r, c in re.findall(r"OK (\d+) (\d+)", proc.stdout)}


@needs_mpiexec
@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_match_expected_values(world_size: int) -> None:
    # all_reduce (every op, several dtypes, transposed input, async), broadcast,
    # all_gather (+ into tensor), reduce_scatter (+ tensor), all_to_all(_single,
    # even and uneven), gather, scatter, reduce, send/recv, barrier, object
    # collectives and a new_group sub-group.
    cmd = [str(MPIEXEC), "-n", str(world_size), sys.executable, str(PROGRAMS / "c10d_collectives.py")]
    proc = _run(cmd, 120)
    assert proc.returncode == 0, _show(proc)
    found = _ok_ranks(proc)
    assert sorted(found) == list(range(world_size)), _show(proc)
    assert found[0] >= 30, _show(proc)  # rank 0 ran every check, including the root-only ones


@needs_mpiexec
def test_dtensor_and_checkpoint_round_trip(tmp_path: Path) -> None:
    # ``import shardwise_mpi`` alone registers the backend; DTensor on a 1-D cpu
    # mesh (distribute_tensor, redistribute to Replicate/Shard(1)/back, uneven
    # shards, a Partial sum, backward) and a DCP save/load into another layout.
    cmd = [str(MPIEXEC), "-n", "2", sys.executable, str(PROGRAMS / "c10d_dtensor_dcp.py"), str(tmp_path)]
    proc = _run(cmd, 180)
    assert proc.returncode == 0, _show(proc)
    assert sorted(_ok_ranks(proc)) == [0, 1], _show(proc)
    assert sorted(p.name for p in tmp_path.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"], _show(proc)
    assert (tmp_path / ".metadata").exists()


@needs_mpiexec
@pytest.mark.parametrize("world_size", [2, 3])
def test_sub_groups_hold_the_processes_of_their_torch_ranks(world_size: int) -> None:
    # env:// numbers the processes in the reverse of MPI's order; sub-groups are named by torch rank.
    cmd = [
        str(MPIEXEC), "-n", str(world_size), sys.executable, str(PROGRAMS / "c10d_rank_order.py"), str(_free_port())
    ]
    proc = _run(cmd, 120)
    assert proc.returncode == 0, _show(proc)
    found = _ok_ranks(proc)
    assert sorted(found) == list(range(world_size)), _show(proc)
    assert found[0] == 4, _show(proc)  # rank 0 is in every sub-group


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("mode", ["mpi4py", "env", "none"])
def test_world_of_one_without_mpiexec(mode: str) -> None:
    # mpi4py: init_method="mpi4py://" on an MPI singleton; env: torch's env://
    # handler still runs when its variables are set; none: without variables
    # and without a launcher, torch's own env:// error comes through and MPI
    # is not started. Also: registering imports no mpi4py, PREMUL_SUM scales
    # then sums (integers and recv-from-any-source fail with a message).
    extra = {}
    if mode == "env":
        extra = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    proc = _run([sys.executable, str(PROGRAMS / "c10d_singleton.py"), mode], 60, **extra)
    assert proc.returncode == 0, _show(proc)
    assert f"OK {mode}" in proc.stdout, _show(proc)


def test_register_is_idempotent_and_lazy() -> None:
    code = (
        "import sys, torch.distributed as dist, shardwise_mpi\n"
        "shardwise_mpi.register_torch_backend(); shardwise_mpi.register_torch_backend()\n"
        "assert 'mpi4py' not in sys.modules\n"
        "assert dist.Backend.backend_list.count('mpi4py') == 1\n"
        "assert dist.Backend('mpi4py') == 'mpi4py' and dist.Backend.MPI4PY == 'mpi4py'\n"
        "assert 'cpu' in dist.Backend.backend_capability['mpi4py']\n"
        "from torch.distributed.rendezvous import _rendezvous_handlers as h\n"
        "assert 'mpi4py' in h and getattr(h['env'], '_shardwise_mpi', False)\n"
        "print('OK')\n"
    )
    proc = _run([sys.executable, "-c", code], 60)
    assert proc.returncode == 0 and "OK" in proc.stdout, _show(proc)


@needs_mpiexec
@pytest.mark.parametrize("collective", ["all_reduce", "broadcast"])
def test_a_frozen_rank_is_reported_and_the_job_aborted_after_the_group_timeout(collective: str) -> None:
    # MPI cannot cancel the survivors' blocked call: the watchdog names it and aborts the job. A 4 MiB
    # broadcast at 3 ranks goes by one copy, through the backend's shardwise group, whose watchdog must
    # name this API and its timeout too (it said "the mpi backend" and shardwise.init), and the call made
    # (it named the all-gather of addresses that the one-copy path runs, which the user never called).
    cmd = [str(MPIEXEC), "-n", "3", sys.executable, str(PROGRAMS / "c10d_frozen_rank.py"), collective]
    proc = _run(cmd, 120)
    assert proc.returncode != 0, _show(proc)
    found = re.search(
        r'shardwise: rank ([02]) of 3: (\w+) on torch.distributed backend "mpi4py" has waited ([\d.]+) s for '
        r"its peers, longer than the group's timeout \(4 s, set by init_process_group\(timeout=\.\.\.\)\)",
        proc.stderr,
    )
    assert found, _show(proc)
    assert found.group(2) == collective, found.group(0)
    assert 4 <= float(found.group(3)) < 10, found.group(0)
    if KIND != "openmpi":
        # Open MPI's MPI_Abort sends SIGCONT before SIGTERM: the frozen rank may wake and finish in the last moment.
        assert "finished although rank 1 froze" not in proc.stdout, _show(proc)


@needs_mpiexec
@pytest.mark.parametrize(("level", "world_size"), [("DETAIL", 2), ("DETAIL", 3), ("OFF", 2)])
def test_torch_distributed_debug_detail_compares_each_collective_across_ranks(level: str, world_size: int) -> None:
    # torch checks its own backends' collectives under DETAIL (ProcessGroupWrapper) but never wraps a Python
    # group: the backend does it. Differing shapes, dtypes or collectives raise on every rank (they used to
    # hand a rank garbage); uneven all_gather and all_to_all stay legal; sub-groups are checked too.
    cmd = [str(MPIEXEC), "-n", str(world_size), sys.executable, str(PROGRAMS / "c10d_detail.py"), level]
    proc = _run(cmd, 120, TORCH_DISTRIBUTED_DEBUG=level)
    assert proc.returncode == 0, _show(proc)
    found = _ok_ranks(proc)
    assert sorted(found) == list(range(world_size)), _show(proc)
    if level == "DETAIL":
        assert found[0] == found[1] == 6, _show(proc)  # ranks 0 and 1 ran every check, the sub-group's too
