"""Run under ``mpiexec -n N <mode>``: what ``shardwise.init()`` on backend "mpi" does to torch.distributed.

Modes:

* ``dtensor``: ``shardwise.init()`` alone, then DTensor over
  ``init_device_mesh("cpu", (N,))``, one FSDP2 step compared with the dense
  step, and a gloo sub-group over the default store;
  ``shardwise.destroy()`` tears torch's group down again.
* ``no-destroy``: ``shardwise.init()`` and a DTensor, then the program ends
  without ``shardwise.destroy()``.
* ``opt-out`` (``SHARDWISE_MPI_TORCH_DIST=0``): torch.distributed is left
  alone; the program then initialises it itself.
* ``user-first``: torch.distributed is initialised (gloo) before
  ``shardwise.init()``, which keeps it, and ``shardwise.destroy()`` leaves it.
* ``expect-error``: ``shardwise.init()`` must raise ``LaunchError`` on every
  rank (the test sets what makes it fail); prints ``RAISED <rank> <message>``.

Each rank prints ``OK <rank> <checks>`` at the end (``RAISED`` for
``expect-error``).
"""

from __future__ import annotations

import importlib
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import shardwise
from shardwise.errors import LaunchError


def _say(line: str) -> None:
    # One write per line: print() writes the text and its newline apart, and mpiexec merges the ranks'
    # output, so a peer's line could land between them ("...over MPIRAISED 1 ...").
    sys.stdout.write(line + "\n")
    sys.stdout.flush()

def _torch_globals() -> tuple[object, ...]:
    """What registering the torch backend "mpi4py" changes (shardwise_mpi.register_torch_backend)."""
    rdzv = importlib.import_module("torch.distributed.rendezvous")  # also a function: import by name
    return (tuple(dist.Backend.backend_list), tuple(dist.Backend._plugins), rdzv._rendezvous_handlers.get("env"))


def _dtensor_checks(n: int, rank: int) -> list[str]:
    mesh = init_device_mesh("cpu", (n,))
    assert mesh.get_group().getBackendName() == "mpi4py", mesh.get_group().getBackendName()
    expected = torch.arange(5.0 * 6).reshape(5, 6)  # 5 rows: uneven over 2 or 3 ranks
    # distribute_tensor broadcasts from rank 0: the other ranks pass zeros.
    dt = distribute_tensor(expected if rank == 0 else torch.zeros(5, 6), mesh, [Shard(0)])
    assert torch.equal(dt.to_local(), expected.chunk(n)[rank]), dt.to_local()  # torch.chunk's rows, as torch does
    assert torch.equal(dt.full_tensor(), expected), dt.full_tensor()
    assert torch.equal(dt.redistribute(mesh, [Shard(1)]).full_tensor(), expected)
    assert torch.equal(dt.redistribute(mesh, [Replicate()]).to_local(), expected)
    return ["distribute_tensor", "full_tensor", "redistribute"]


def _fsdp2_step(n: int, rank: int) -> str:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    model.load_state_dict(dense.state_dict())
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    batch = torch.randn(2 * n, 4, generator=torch.Generator().manual_seed(1))
    # Each rank takes its rows of one global batch; the dense model takes the whole batch.
    model(batch.chunk(n)[rank]).square().mean().backward()
    dense(batch).square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), dense.parameters(), strict=True):
        # FSDP2 averages the ranks' gradients: the mean over the global batch, as the dense step.
        assert torch.allclose(p.grad.full_tensor(), q.grad, atol=1e-6), name
    return "fsdp2 gradients"


def main(mode: str) -> None:
    if mode == "expect-error":
        try:
            shardwise.init()
        except LaunchError as exc:
            from mpi4py import MPI

            assert not dist.is_initialized(), "a failed shardwise.init() left torch.distributed initialised"
            _say(f"RAISED {MPI.COMM_WORLD.Get_rank()} {' '.join(str(exc).split())}")
            return
        raise AssertionError("shardwise.init() did not raise")
    if mode == "user-first":
        import shardwise_mpi

        shardwise_mpi.register_torch_backend()  # its env:// rendezvous needs no MASTER_ADDR under mpiexec
        dist.init_process_group("gloo")
    before = _torch_globals()
    group = shardwise.init()
    rank, n = group.rank, group.size
    assert group.backend == "mpi", group.backend
    checks: list[str] = []
    if mode in ("dtensor", "no-destroy"):
        assert dist.is_initialized() and dist.get_backend() == "mpi4py", dist.get_backend()
        assert (dist.get_rank(), dist.get_world_size()) == (rank, n)
        checks += _dtensor_checks(n, rank)
        if mode == "no-destroy":
            _say(f"OK {rank} {len(checks)}")
            return  # no shardwise.destroy(): the process must still end cleanly
        checks.append(_fsdp2_step(n, rank))
        # The default store is shared by every rank: a group of another backend can rendezvous on it.
        sub = dist.new_group(backend="gloo")
        t = torch.ones(2) * (rank + 1)
        dist.all_reduce(t, group=sub)
        assert torch.equal(t, torch.full((2,), n * (n + 1) / 2)), t
        checks.append("gloo new_group on the default store")
        shardwise.destroy()
        assert not dist.is_initialized(), "shardwise.destroy() must destroy the torch group that init made"
        checks.append("destroyed")
    elif mode == "opt-out":
        assert not dist.is_initialized(), f"{dist.get_backend()} initialised despite SHARDWISE_MPI_TORCH_DIST=0"
        assert _torch_globals() == before, "SHARDWISE_MPI_TORCH_DIST=0 must leave torch.distributed's globals alone"
        checks.append("left alone")
        import shardwise_mpi

        shardwise_mpi.register_torch_backend()
        dist.init_process_group("gloo")  # the program's own torch group still works afterwards
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == n
        shardwise.destroy()
        dist.destroy_process_group()
        checks.append("own group")
    elif mode == "user-first":
        assert dist.get_backend() == "gloo", dist.get_backend()
        shardwise.destroy()
        assert dist.is_initialized() and dist.get_backend() == "gloo", "the user's own torch group must be kept"
        dist.destroy_process_group()
        checks.append("user's group kept")
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    _say(f"OK {rank} {len(checks)}")


if __name__ == "__main__":
    main(sys.argv[1])
