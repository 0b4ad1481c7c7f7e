"""Run WITHOUT mpiexec: backend "mpi4py" in a world of one (MPI singleton init).

argv[1] picks the rendezvous:
  ``mpi4py``  init_method="mpi4py://" (rank and size from MPI);
  ``env``     env:// with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set (torch's own handler);
  ``none``    no variables and no launcher: torch's env:// error must come through unchanged.
Prints ``OK <mode>`` at the end.
"""

from __future__ import annotations

import os
import sys

import shardwise_mpi
import torch
import torch.distributed as dist


def main(mode: str) -> None:
    shardwise_mpi.register_torch_backend()
    assert "mpi4py" not in sys.modules, "registration must not import mpi4py"
    if mode == "none":
        try:
            dist.init_process_group("mpi4py")
        except ValueError as exc:
            assert "MASTER_ADDR" in str(exc) or "RANK" in str(exc), exc
            assert "mpi4py" not in sys.modules, "a failed env:// rendezvous outside MPI must not start MPI"
            print("OK none", flush=True)
            return
        raise AssertionError("init_process_group without rendezvous variables or launcher succeeded")
    if mode == "mpi4py":
        dist.init_process_group("mpi4py", init_method="mpi4py://")
    else:
        dist.init_process_group("mpi4py")
    assert (dist.get_rank(), dist.get_world_size()) == (0, 1)
    assert "mpi4py" in sys.modules
    t = torch.tensor([1.0, 2.0])
    dist.all_reduce(t)
    assert torch.equal(t, torch.tensor([1.0, 2.0]))
    objs: list = [None]
    dist.all_gather_object(objs, {"x": 1})
    assert objs == [{"x": 1}]
    # PREMUL_SUM scales, then sums (FSDP2's set_gradient_divide_factor); integers fail with a message
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(2.0))
    assert torch.equal(t, torch.tensor([2.0, 4.0])), t
    try:
        dist.all_reduce(torch.ones(2, dtype=torch.int64), op=dist._make_nccl_premul_sum(2.0))
    except TypeError as exc:
        assert "PREMUL_SUM needs a floating point tensor" in str(exc), exc
    else:
        raise AssertionError("PREMUL_SUM of an integer tensor was accepted")
    # unsupported requests fail with a message, not a crash or a wrong answer
    try:
        dist.recv(torch.empty(1))
    except NotImplementedError as exc:
        assert "pass src" in str(exc), exc
    else:
        raise AssertionError("recv from any source was accepted")
    dist.destroy_process_group()
    print(f"OK {mode}", flush=True)


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
