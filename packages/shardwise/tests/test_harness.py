"""shardwise.testing.run_ranks: results, failures and hangs never hang the suite."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

import shardwise
from shardwise.testing import RankError, current_rank_dir, launcher_free_env, mpiexec_kind, run_ranks

from conftest import RANK_ENV


def report(tag: str) -> dict[str, object]:
    g = shardwise.get_default_group()
    return {"tag": tag, "rank": g.rank, "size": g.size, "pid": os.getpid(), "dir": str(current_rank_dir())}


def raise_on_rank_one() -> None:
    g = shardwise.get_default_group()
    if g.rank == 1:
        raise ValueError("rank one is unhappy")
    g.all_reduce(torch.ones(1))  # waits for rank 1, which never comes


def hang_on_rank_zero() -> None:
    if shardwise.get_default_group().rank == 0:
        time.sleep(600)


def no_init() -> bool:
    return shardwise.is_initialized()


def crash_hard() -> None:
    if shardwise.get_default_group().rank == 1:
        os._exit(7)
    shardwise.get_default_group().barrier()


def test_results_in_rank_order() -> None:
    results = run_ranks(report, 3, backend="test-gloo", args=("x",), env=RANK_ENV, timeout=60)
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert {r["size"] for r in results} == {3} and {r["tag"] for r in results} == {"x"}
    assert len({r["pid"] for r in results}) == 3 and len({r["dir"] for r in results}) == 1


def test_backend_none_leaves_init_to_the_function() -> None:
    assert run_ranks(no_init, 2, backend=None, timeout=60) == [False, False]


def test_a_raising_rank_fails_fast_with_its_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(raise_on_rank_one, 2, backend="test-gloo", env=RANK_ENV, timeout=100)
    assert time.monotonic() - start < 40
    error = info.value
    assert "ValueError: rank one is unhappy" in error.traceback_of(1)
    message = str(error)
    assert "rank 1 failed first" in message
    assert message.index("----- rank 1") < message.index("ValueError: rank one is unhappy")
    assert not error.timed_out


def test_a_hung_rank_is_killed_with_a_stack_dump() -> None:
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(hang_on_rank_zero, 2, backend="test-gloo", env=RANK_ENV, timeout=8)
    assert time.monotonic() - start < 30
    error = info.value
    assert error.timed_out and error.outcomes[0].hung
    assert "timed out after 8s" in str(error)
    assert "hang_on_rank_zero" in error.outcomes[0].log_tail  # faulthandler's dump of the stuck frame


def test_a_rank_that_dies_without_python_error() -> None:
    with pytest.raises(RankError) as info:
        run_ranks(crash_hard, 2, backend="test-gloo", env=RANK_ENV, timeout=60)
    assert info.value.outcomes[1].exitcode == 7


def origin() -> dict[str, object]:
    return {
        "pid": os.getpid(), "parent": os.getppid(), "session": os.getsid(0), "cwd": os.getcwd(),
        "threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS"),
    }  # fmt: skip


def _command_line(pid: object) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


@pytest.mark.skipif(not os.path.exists("/proc/self/cmdline"), reason="reads /proc")
def test_ranks_are_forked_from_a_zygote_that_imported_torch_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    ranks = run_ranks(origin, 3, backend="test-gloo", env=RANK_ENV, timeout=60)
    zygote = ranks[0]["parent"]
    assert zygote != os.getpid() and {r["parent"] for r in ranks} == {zygote}
    assert "shardwise.testing._zygote" in _command_line(zygote)
    for r in ranks:
        # As a spawned rank: a session of its own (the harness kills it by process group), the caller's directory.
        assert r["session"] == r["pid"] and r["cwd"] == str(tmp_path), r
    again = run_ranks(origin, 2, backend="test-gloo", env=RANK_ENV, timeout=60)
    assert {r["parent"] for r in again} == {zygote}  # the same zygote serves the next run


@pytest.mark.skipif(not os.path.exists("/proc/self/cmdline"), reason="reads /proc")
def test_a_rank_whose_import_time_variables_differ_gets_a_zygote_started_with_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    (one,) = run_ranks(origin, 1, backend="test-gloo", env=RANK_ENV, timeout=60)
    (two,) = run_ranks(origin, 1, backend="test-gloo", env={**RANK_ENV, "OMP_NUM_THREADS": "2"}, timeout=60)
    # OpenMP reads OMP_NUM_THREADS when torch loads: a rank forked from the first zygote would keep 1 thread.
    assert (one["threads"], two["threads"], two["omp"]) == (1, 2, "2")
    assert one["parent"] != two["parent"]


def test_the_fork_switch_spawns_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDWISE_TESTING_FORK", "0")
    ranks = run_ranks(origin, 2, backend="test-gloo", env=RANK_ENV, timeout=60)
    assert {r["parent"] for r in ranks} == {os.getpid()}


def kill_rank_one() -> None:
    import signal

    if shardwise.get_default_group().rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    shardwise.get_default_group().barrier()


def test_a_rank_killed_by_a_signal_is_reported_as_such() -> None:
    with pytest.raises(RankError) as info:
        run_ranks(kill_rank_one, 2, backend="test-gloo", env=RANK_ENV, timeout=60)
    assert info.value.outcomes[1].exitcode == -9


def local_function_holder() -> None:
    def inner() -> None:
        pass

    run_ranks(inner, 1)


def test_functions_must_be_importable() -> None:
    with pytest.raises(ValueError, match="importable by module and name"):
        local_function_holder()
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        run_ranks(report, 0)


def test_concurrent_runs_never_share_a_port() -> None:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=3) as pool:
        runs = [
            pool.submit(run_ranks, report, 2, backend="test-gloo", args=(str(i),), env=RANK_ENV, timeout=90)
            for i in range(3)
        ]
        outcomes = [run.result() for run in runs]
    assert [[r["tag"] for r in results] for results in outcomes] == [["0", "0"], ["1", "1"], ["2", "2"]]


def _mpi_rank_and_size() -> tuple[str, str]:
    import os

    return os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "?")), os.environ.get(
        "PMI_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "?")
    )


def test_mpiexec_launcher_starts_every_rank() -> None:
    from shardwise.testing import find_mpiexec

    try:
        find_mpiexec()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    assert run_ranks(_mpi_rank_and_size, 2, backend=None, launcher="mpiexec", timeout=60) == [("0", "2"), ("1", "2")]


def test_unknown_launcher_is_refused() -> None:
    with pytest.raises(ValueError, match="launcher must be 'spawn', 'torchrun' or 'mpiexec'"):
        run_ranks(_mpi_rank_and_size, 1, launcher="srun")


def test_launcher_free_env_keeps_settings_and_drops_what_a_launcher_set() -> None:
    source = {
        "PATH": "/bin",
        "RANK": "1",
        "MASTER_ADDR": "h",
        "OMPI_COMM_WORLD_RANK": "0",
        "PMI_FD": "9",
        "SLURM_PROCID": "0",
        "SHARDWISE_BACKEND": "mpi",
        "MPI_LOCALRANKID": "0",
        "OMPI_MCA_rmaps_base_oversubscribe": "1",
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    }
    assert launcher_free_env(source, EXTRA="x") == {
        "PATH": "/bin",
        "OMPI_MCA_rmaps_base_oversubscribe": "1",
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "EXTRA": "x",
    }


@pytest.mark.parametrize(
    ("says", "kind"),
    [
        ("mpirun (Open MPI) 4.1.4", "openmpi"),
        ("mpirun.openmpi (OpenRTE) 4.1.4", "openmpi"),
        ("HYDRA build details:\n    Version: 4.3.0", "mpich"),
        ("Intel(R) MPI Library for Linux* OS, Version 2021.10", "mpich"),
        ("something else entirely", "unknown"),
    ],
)
def test_mpiexec_kind_reads_the_version_banner(tmp_path: Path, says: str, kind: str) -> None:
    fake = tmp_path / f"mpiexec-{kind}-{abs(hash(says))}"
    fake.write_text(f"#!/bin/sh\ncat <<'END'\n{says}\nEND\n")
    fake.chmod(0o755)
    assert mpiexec_kind(str(fake)) == kind
    assert mpiexec_kind(str(tmp_path / "missing")) == "unknown"
