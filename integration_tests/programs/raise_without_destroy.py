"""Rank 1 raises while rank 0 is busy elsewhere; nobody calls ``shardwise.destroy()``.

Run it the way users do::

    torchrun --standalone --nproc-per-node 2 integration_tests/programs/raise_without_destroy.py

Rank 0 is not in a collective but sleeping (busy with anything else), so a
failing rank that waited for its peers before exiting would wait until the
group's timeout, and torchrun would not learn of the failure until then.
Rank 1 must instead exit at once with status 1 (not abort with SIGABRT),
torchrun must stop rank 0 and report rank 1's exception, read from the
error file rank 1 wrote (not ``error_file: <N/A>``).
"""

from __future__ import annotations

import sys
import time

import torch

import shardwise

MARKER = "deliberate failure on rank 1"
#: Longer than any sane test run: rank 0 only ends when torchrun stops it.
BUSY_SECONDS = 3600


def say(line: str) -> None:
    """Print one line in one write, so lines of concurrent ranks do not interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    group = shardwise.init()
    t = torch.ones(4)
    group.all_reduce(t)  # the group works ...
    if group.rank == 1:
        raise RuntimeError(MARKER)  # ... then rank 1 fails
    say(f"rank {group.rank} busy outside any collective")
    time.sleep(BUSY_SECONDS)
    say(f"rank {group.rank} finished although rank 1 failed")


if __name__ == "__main__":
    main()
