"""Run under mpiexec (2 or 3 ranks): backend "mpi4py" with TORCH_DISTRIBUTED_DEBUG as argv[1] says.

``DETAIL``: every group is a ``CheckedMpiProcessGroup``; collectives whose
calls agree give the right values (uneven all_gather and all_to_all too);
calls that differ (shapes, dtypes, the collective itself, a sub-group's)
raise RuntimeError on every rank before any data moves, and the group works
afterwards. ``OFF``: the plain ``MpiProcessGroup``. Prints ``OK <rank> <checks>``.
"""

from __future__ import annotations

import os
import sys

import shardwise_mpi
import torch
import torch.distributed as dist


def _mismatch(what: str, call: object) -> str:
    try:
        call()  # type: ignore[operator]
    except RuntimeError as exc:
        message = str(exc)
        assert message.startswith("Detected mismatch between collectives on ranks."), message
        assert "CollectiveFingerPrint(" in message and what in message, message
        return message
    raise AssertionError(f"no error for differing calls ({what})")


def main(level: str) -> None:
    assert os.environ.get("TORCH_DISTRIBUTED_DEBUG", "OFF") == level
    shardwise_mpi.register_torch_backend()
    dist.init_process_group("mpi4py", init_method="mpi4py://")
    rank, size = dist.get_rank(), dist.get_world_size()
    world = dist.group.WORLD
    assert world is not None
    kind = type(world).__name__
    checks = 0
    if level != "DETAIL":
        assert kind == "MpiProcessGroup", kind
        print(f"OK {rank} 1", flush=True)
        dist.destroy_process_group()
        return
    assert kind == "CheckedMpiProcessGroup", kind

    # Calls that agree: the right values.
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((3,), float(size * (size + 1) // 2)))
    outs = [torch.empty(2) for _ in range(size)]
    dist.all_gather(outs, torch.full((2,), float(rank)))
    assert all(torch.equal(o, torch.full((2,), float(r))) for r, o in enumerate(outs))
    flat = torch.empty(2 * size)
    dist.all_gather_into_tensor(flat, torch.full((2,), float(rank)))
    assert torch.equal(flat, torch.arange(size).repeat_interleave(2).float())
    uneven = [torch.empty(r + 1) for r in range(size)]  # rank r sends r + 1 elements: legal, not compared
    dist.all_gather(uneven, torch.full((rank + 1,), float(rank)))
    assert all(torch.equal(o, torch.full((r + 1,), float(r))) for r, o in enumerate(uneven))
    b = torch.full((4,), float(rank))
    dist.broadcast(b, src=size - 1)
    assert torch.equal(b, torch.full((4,), float(size - 1)))
    # Rank r sends r + 1 rows to every rank: uneven splits, legal.
    send = torch.full(((rank + 1) * size,), float(rank))
    recv = torch.empty(sum(r + 1 for r in range(size)))
    dist.all_to_all_single(recv, send, [r + 1 for r in range(size)], [rank + 1] * size)
    assert torch.equal(recv, torch.cat([torch.full((r + 1,), float(r)) for r in range(size)]))
    rs = torch.empty(2)
    dist.reduce_scatter_tensor(rs, torch.ones(2 * size))
    assert torch.equal(rs, torch.full((2,), float(size)))
    g = [torch.empty(2) for _ in range(size)] if rank == 0 else None
    dist.gather(torch.full((2,), float(rank)), g, dst=0)
    if g is not None:
        assert all(torch.equal(x, torch.full((2,), float(r))) for r, x in enumerate(g))
    dist.barrier()
    checks += 1

    # Calls that differ: every rank raises, naming what differs.
    last = size - 1
    n = 8 if rank == last else 4
    message = _mismatch(
        "Tensor shapes", lambda: dist.all_gather([torch.empty(n) for _ in range(size)], torch.full((n,), 1.0))
    )
    assert "Tensor shapes: [[4]] vs [[8]]" in message or "Tensor shapes: [[8]] vs [[4]]" in message, message
    checks += 1
    dtype = torch.float64 if rank == last else torch.float32
    _mismatch("Tensor dtypes", lambda: dist.all_reduce(torch.ones(3, dtype=dtype)))
    checks += 1
    if rank == last:
        _mismatch("Op type", lambda: dist.broadcast(torch.ones(3), src=0))
    else:
        _mismatch("Op type", lambda: dist.all_reduce(torch.ones(3)))
    checks += 1

    # No data moved in those: the group still works.
    t = torch.ones(2)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((2,), float(size)))
    checks += 1

    # A sub-group is checked too.
    sub = dist.new_group([0, 1])
    if rank in (0, 1):
        assert type(sub).__name__ == "CheckedMpiProcessGroup", type(sub).__name__
        m = 5 if rank == 1 else 6
        _mismatch("Tensor shapes", lambda: dist.all_reduce(torch.ones(m), group=sub))
        t = torch.ones(2)
        dist.all_reduce(t, group=sub)
        assert torch.equal(t, torch.full((2,), 2.0))
        checks += 1
    dist.barrier()
    print(f"OK {rank} {checks}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
