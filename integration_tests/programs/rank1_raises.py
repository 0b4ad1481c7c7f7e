"""A program whose rank 1 fails after the group is up.

Rank 1 raises while rank 0 is blocked in a collective waiting for it; the
job must end (torchrun stops the surviving rank) with a non-zero exit code
and rank 1's traceback in the output, instead of hanging.
"""

from __future__ import annotations

import sys

import torch

import shardwise

MARKER = "deliberate failure on rank 1"


def say(line: str) -> None:
    """Print one line in one write, so lines of concurrent ranks do not interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> int:
    group = shardwise.init()
    t = torch.ones(4)
    group.all_reduce(t)  # the group works ...
    if group.rank == 1:
        raise RuntimeError(MARKER)  # ... then rank 1 dies
    group.all_reduce(t)  # rank 0 waits here for a peer that is gone
    group.barrier()
    say(f"rank {group.rank} finished although rank 1 failed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
