"""Run as plain ``python`` (no mpiexec): backend "mpi" gives a world of one (MPI singleton init)."""

from __future__ import annotations

import sys

import torch

import shardwise
from shardwise import LaunchInfo
from shardwise.errors import LaunchError


def main() -> None:
    assert "mpi4py" not in sys.modules  # importing the plugin must not load MPI
    group = shardwise.init(backend="mpi")
    assert (group.backend, group.rank, group.size) == ("mpi", 0, 1), group
    t = torch.arange(4.0).reshape(2, 2).t()
    assert torch.equal(group.all_reduce(t.clone(), op="max"), t)
    assert torch.equal(group.all_gather(t)[0], t)
    assert group.exchange({"a": 1}) == [{"a": 1}]
    sub = group.new_group([0])
    assert sub is not None and sub.size == 1
    sub.destroy()
    group.barrier()
    # A launch that disagrees with MPI's world (backend="mpi" under torchrun) is refused.
    from datetime import timedelta

    from shardwise_mpi.plugin import create_group

    try:
        create_group(LaunchInfo(launcher="torchrun", family="torchrun", rank=1, world_size=2), timedelta(seconds=5))
    except LaunchError as exc:
        assert "MPI says this process is rank 0 of 1" in str(exc), exc
    else:
        raise AssertionError("a mismatched launch was accepted")
    shardwise.destroy()
    print("SINGLETON OK", flush=True)


if __name__ == "__main__":
    main()
