"""The README's first program without ``shardwise.destroy()``: it simply ends.

Run it the way users do::

    torchrun --standalone --nproc-per-node 2 integration_tests/programs/no_destroy.py
    mpiexec -n 2 python integration_tests/programs/no_destroy.py

Its last collectives are the ones that used to abort a process at exit
when they were left to interpreter finalization: an all-gather, and an
all-reduce run by autograd's backward pass (gloo's worker threads then
still hold the work, its tensors and autograd's context, and need the GIL
to let go of them). Every rank checks its results and prints ``rank R of N
(BACKEND) done``; the job must exit 0, every time.

Then it issues two asynchronous all-reduces of 16 MiB and never waits for
them: at exit one may be running on one rank's worker thread and still
queued on its peer's. They must finish on every rank (as torch's own groups
finish their queued work at exit); dropping the queued ones crashed the
process that was running its first (MPI: a segfault, gloo: SIGABRT).
"""

from __future__ import annotations

import sys

import torch

import shardwise
import shardwise.nn.functional as swf


def say(line: str) -> None:
    """Print one line in one write, so lines of concurrent ranks do not interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    group = shardwise.init()  # reads the launcher's environment and picks a backend
    rank, size = group.rank, group.size

    t = torch.full((2,), float(rank + 1))
    group.all_reduce(t)
    total = size * (size + 1) / 2
    assert t.tolist() == [total, total], t
    pieces = group.all_gather(torch.full((rank + 1,), rank))
    assert [p.tolist() for p in pieces] == [[r] * (r + 1) for r in range(size)], pieces
    assert group.all_gather_json({"rank": rank}) == [{"rank": r} for r in range(size)]

    x = torch.ones(3, requires_grad=True)
    swf.all_reduce(x * (rank + 1)).sum().backward()  # the last collective runs in the backward pass
    assert x.grad is not None and x.grad.tolist() == [float(size * (rank + 1))] * 3, x.grad
    say(f"rank {rank} of {size} ({group.backend}) done")
    for _ in range(2):
        group.all_reduce(torch.ones(1 << 22), async_op=True)  # never waited for
    # No shardwise.destroy(): the exit handler init registered tears the group down.


if __name__ == "__main__":
    main()
