"""``shardwise.init()`` on backend "mpi" brings up torch.distributed too: DTensor and FSDP2 need nothing else.

Under ``mpiexec`` the backend's ``create_group`` initialises torch.distributed's
default process group with the torch backend ``"mpi4py"`` (as the gloo backend
does with gloo), unless ``SHARDWISE_MPI_TORCH_DIST=0`` or torch.distributed is
already initialised; ``shardwise.destroy()`` tears down what it made. A setting
that differs between ranks, or a rendezvous that fails on one rank, raises
``LaunchError`` on every rank instead of hanging. The programs are
``programs_c10d/shardwise_init_torch_dist.py``; no rendezvous variable is set.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest
from mpi_launch import needs_hydra
from test_mpi4py_c10d import MPIEXEC, PROGRAMS, _run, _show, needs_mpiexec

PROGRAM = PROGRAMS / "shardwise_init_torch_dist.py"


def _launch(mode: str, **env: str) -> subprocess.CompletedProcess[str]:
    return _run([str(MPIEXEC), "-n", "2", sys.executable, str(PROGRAM), mode], 240, **env)


def _ok(proc: subprocess.CompletedProcess[str], checks: int, n: int = 2) -> None:
    assert proc.returncode == 0, _show(proc)
    # Ranks' lines can interleave in the launcher's output: match, do not split lines.
    found = {int(r): int(c) for r, c in re.findall(r"OK (\d+) (\d+)", proc.stdout)}
    assert found == dict.fromkeys(range(n), checks), _show(proc)


@needs_mpiexec
def test_dtensor_and_fsdp2_run_after_shardwise_init_alone() -> None:
    # distribute_tensor over init_device_mesh("cpu", (2,)) with full_tensor and redistribute, one FSDP2 step equal
    # to the dense step, a gloo new_group on the shared default store; shardwise.destroy() destroys torch's group.
    _ok(_launch("dtensor"), checks=6)


@needs_mpiexec
def test_a_program_without_destroy_exits_cleanly() -> None:
    proc = _launch("no-destroy")
    _ok(proc, checks=3)
    assert "terminate called" not in proc.stderr and "Abort" not in proc.stderr, _show(proc)


@needs_mpiexec
def test_opt_out_leaves_torch_distributed_alone() -> None:
    # And the program can then initialise torch.distributed itself (here gloo, through the MPI rendezvous).
    _ok(_launch("opt-out", SHARDWISE_MPI_TORCH_DIST="0"), checks=2)


@needs_mpiexec
def test_a_torch_group_the_user_made_first_is_kept() -> None:
    _ok(_launch("user-first"), checks=1)


def _raised(proc: subprocess.CompletedProcess[str], n: int = 2) -> dict[int, str]:
    assert proc.returncode == 0, _show(proc)
    found = dict(re.findall(r"^RAISED (\d+) (.*)$", proc.stdout, re.MULTILINE))
    assert sorted(int(r) for r in found) == list(range(n)), _show(proc)
    return {int(r): message for r, message in found.items()}


@needs_mpiexec
@needs_hydra  # two programs in one job, each with its own -env: Hydra's syntax
def test_ranks_that_disagree_on_the_setting_all_raise() -> None:
    # Rank 0 opts out, rank 1 does not: neither may start a rendezvous the other never joins.
    py, program = sys.executable, str(PROGRAM)
    cmd = [str(MPIEXEC), "-n", "1", "-env", "SHARDWISE_MPI_TORCH_DIST", "0", py, program, "expect-error", ":",
           "-n", "1", py, program, "expect-error"]  # fmt: skip
    for message in _raised(_run(cmd, 240)).values():
        assert "the ranks disagree on torch.distributed: SHARDWISE_MPI_TORCH_DIST reads [0, 1]" in message, message


@needs_mpiexec
def test_a_failed_rendezvous_raises_on_every_rank() -> None:
    # Rank 0's own client cannot reach the address it advertises: every rank raises, naming the fix.
    proc = _launch("expect-error", MASTER_ADDR="nonexistent.invalid", SHARDWISE_TIMEOUT="5")
    messages = _raised(proc)
    for message in messages.values():
        assert "could not initialise torch.distributed over MPI: the rendezvous failed on ranks [0" in message
        assert "Set MASTER_ADDR" in message and "SHARDWISE_MPI_TORCH_DIST=0" in message, message
    assert "nonexistent.invalid" in messages[0], messages[0]


def _singleton(body: str, **env: str) -> None:
    # No launcher: MPI singleton init, a world of one.
    code = textwrap.dedent(body) + "\nprint('OK', flush=True)\n"
    proc = _run([sys.executable, "-c", code], 120, **env)
    assert proc.returncode == 0 and "OK" in proc.stdout.splitlines(), _show(proc)


def test_world_of_one_gets_a_torch_group_without_a_rendezvous() -> None:
    _singleton(
        """
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        import shardwise

        group = shardwise.init(backend="mpi")
        assert (group.backend, group.size) == ("mpi", 1), group
        assert dist.is_initialized() and dist.get_backend() == "mpi4py" and dist.get_world_size() == 1
        # A world of one needs no TCP store: torch gets a HashStore, as the gloo backend does.
        assert type(dist.distributed_c10d._get_default_store().underlying_store).__name__ == "HashStore"
        full = torch.arange(6.0).reshape(3, 2)
        assert torch.equal(distribute_tensor(full, init_device_mesh("cpu", (1,)), [Shard(0)]).full_tensor(), full)
        shardwise.destroy()
        assert not dist.is_initialized()
        """
    )


@pytest.mark.parametrize("value", ["0", "off", "False"])
def test_opt_out_in_a_world_of_one_changes_no_torch_global(value: str) -> None:
    # What test_no_import_side_effects checks for importing, here for shardwise.init(backend="mpi") opted out.
    _singleton(
        """
        import importlib
        import torch.distributed as dist

        import shardwise

        rdzv = importlib.import_module("torch.distributed.rendezvous")
        before = (list(dist.Backend.backend_list), dict(dist.Backend._plugins), dict(rdzv._rendezvous_handlers))
        shardwise.init(backend="mpi")
        assert not dist.is_initialized()
        after = (list(dist.Backend.backend_list), dict(dist.Backend._plugins), dict(rdzv._rendezvous_handlers))
        assert after == before, (before, after)
        shardwise.destroy()
        """,
        SHARDWISE_MPI_TORCH_DIST=value,
    )


def test_a_value_it_does_not_understand_is_refused() -> None:
    _singleton(
        """
        import pytest
        import torch.distributed as dist

        import shardwise
        from shardwise.errors import LaunchError

        with pytest.raises(LaunchError, match=r"SHARDWISE_MPI_TORCH_DIST must be 1 .* or 0 .*this rank: 'maybe'"):
            shardwise.init(backend="mpi")
        assert not dist.is_initialized() and not shardwise.is_initialized()
        """,
        SHARDWISE_MPI_TORCH_DIST="maybe",
    )
