"""Reading the launcher's environment (no processes started)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardwise import plugins
from shardwise._session.launchers import first_slurm_host, slurm_port
from shardwise._session.runtime import detect
from shardwise.errors import LaunchError

TORCHRUN = {
    "RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
    "MASTER_ADDR": "node0", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "abc",
}
OPENMPI = {
    "OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "6",
    "OMPI_COMM_WORLD_LOCAL_RANK": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "3",
}
HYDRA = {"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
SRUN = {
    "SLURM_PROCID": "7", "SLURM_STEP_NUM_TASKS": "16", "SLURM_LOCALID": "3", "SLURM_STEP_ID": "0",
    "SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "gpu[007-010,12]", "SLURM_NTASKS": "16",
}


def test_torchrun() -> None:
    info = detect(TORCHRUN)
    assert (info.launcher, info.family, info.rank, info.world_size) == ("torchrun", "torchrun", 3, 8)
    assert (info.local_rank, info.local_world_size) == (1, 4)
    assert (info.master_addr, info.master_port) == ("node0", 29500)


def test_hand_set_env_is_its_own_launcher() -> None:
    info = detect({"RANK": "0", "WORLD_SIZE": "2"})
    assert info.launcher == "env" and info.master_addr is None
    assert "MASTER_ADDR" in info.rendezvous_hint


def test_openmpi() -> None:
    info = detect(OPENMPI)
    assert (info.launcher, info.family, info.rank, info.world_size, info.local_rank) == ("openmpi", "mpi", 5, 6, 2)
    assert info.local_world_size == 3 and info.master_addr is None
    assert "mpirun -x MASTER_ADDR" in info.rendezvous_hint
    # Under an MPI launcher the mpi backend is the other way out; most often it is installed and only
    # needs choosing (the hint said only "pip install shardwise-mpi[mpich]").
    assert 'shardwise.init("mpi")' in info.rendezvous_hint and "SHARDWISE_BACKEND=mpi" in info.rendezvous_hint


def test_mpich_hydra_and_intel_mpi() -> None:
    info = detect(HYDRA)
    assert (info.launcher, info.family, info.rank, info.world_size, info.local_rank) == ("mpich", "mpi", 1, 4, 1)
    assert detect({**HYDRA, "I_MPI_ROOT": "/opt/intel"}).launcher == "intel-mpi"
    assert "mpiexec -genv MASTER_ADDR" in info.rendezvous_hint and 'shardwise.init("mpi")' in info.rendezvous_hint


def test_srun_derives_a_rendezvous() -> None:
    info = detect(SRUN)
    assert (info.launcher, info.family, info.rank, info.world_size, info.local_rank) == ("slurm", "slurm", 7, 16, 3)
    assert info.master_addr == "gpu007"
    assert info.master_port == slurm_port("4242", "0")
    assert detect({**SRUN, "MASTER_ADDR": "head", "MASTER_PORT": "1234"}).master_addr == "head"


def test_srun_with_mpi_plugin_is_an_mpi_launch() -> None:
    assert detect({**SRUN, "SLURM_MPI_TYPE": "pmix", "PMIX_RANK": "7"}).family == "mpi"
    assert detect({**SRUN, "SLURM_MPI_TYPE": "none"}).family == "slurm"


def test_batch_shell_is_not_a_multi_rank_launch() -> None:
    # sbatch's shell has SLURM_PROCID=0 and SLURM_NTASKS but is no srun step.
    batch = {"SLURM_PROCID": "0", "SLURM_NTASKS": "16", "SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n[1-4]"}
    assert detect(batch).launcher == "single"
    assert detect({**SRUN, "SLURM_STEP_ID": "4294967294"}).launcher == "single"
    assert detect({**SRUN, "SLURM_STEP_ID": "batch"}).launcher == "single"


def test_priorities_torchrun_over_mpi_over_slurm() -> None:
    assert detect({**SRUN, **HYDRA}).launcher == "mpich"
    assert detect({**SRUN, **TORCHRUN}).launcher == "torchrun"
    assert detect({**OPENMPI, **HYDRA}).launcher == "openmpi"
    assert detect({}).launcher == "single"
    assert [launcher.name for launcher in plugins.list_launchers()] == ["torchrun", "openmpi", "mpich", "slurm", "single"]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "rank 2 is outside"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "world size must be >= 1"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"}, "is not a TCP port"),
        ({"PMI_RANK": "0", "PMI_SIZE": "two"}, "PMI_SIZE='two' is not an integer"),
    ],
)
def test_malformed_variables(env: dict[str, str], message: str) -> None:
    # Always LaunchError, as detect() documents, also for values LaunchInfo itself rejects.
    with pytest.raises(LaunchError, match=message):
        detect(env)


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [
        ("node1", "node1"),
        ("node1,node2", "node1"),
        ("gpu[007-010,12],cpu1", "gpu007"),
        ("rack[2-3]-n[05-06]", "rack2-n05"),
        (" a[9],b ", "a9"),
    ],
)
def test_first_slurm_host(nodelist: str, host: str) -> None:
    assert first_slurm_host(nodelist) == host


@pytest.mark.parametrize("nodelist", ["", "node[1-3", "node]1[", ","])
def test_unreadable_node_lists(nodelist: str) -> None:
    with pytest.raises(LaunchError, match="cannot read the Slurm node list"):
        first_slurm_host(nodelist)


_names = st.from_regex(r"[a-z][a-z0-9-]{0,8}", fullmatch=True)


@given(prefix=_names, start=st.integers(0, 999), width=st.integers(1, 4), more=st.lists(_names, max_size=3))
def test_first_host_of_generated_lists(prefix: str, start: int, width: int, more: list[str]) -> None:
    padded = str(start).zfill(width)
    nodelist = ",".join([f"{prefix}[{padded}-{int(padded) + 3}]", *more])
    assert first_slurm_host(nodelist) == f"{prefix}{padded}"


@given(job=st.integers(0, 10**9), step=st.sampled_from(["0", "1", "17"]))
def test_slurm_port_is_a_stable_unprivileged_port(job: int, step: str) -> None:
    port = slurm_port(str(job), step)
    assert 15000 <= port < 35000
    assert port == slurm_port(str(job), step)
