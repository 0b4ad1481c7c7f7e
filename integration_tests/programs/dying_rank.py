"""One rank dies (SIGKILL) or freezes (SIGSTOP) in the middle of shardwise work; the others must not hang.

Usage::

    dying_rank.py collective|reshard|checkpoint CKPT_DIR [--how kill|stop] [--victim R]
    dying_rank.py verify CKPT_DIR

``collective``: every rank loops ``all_reduce`` of 16 MiB; ``reshard``: a
32 MiB ShardedTensor is resharded dim 0 <-> dim 1 in a loop;
``checkpoint``: a first checkpoint (``v1``) is saved and completes, then a
second, larger save to the same directory starts. The victim ends itself
0.4 s into the loop, or, for ``checkpoint``, as soon as its own data file of
the second save exists (mid-write). Every other rank must end with an error
(``PeerLostError`` on gloo; on MPI the launcher kills the job, or, when the
victim is only frozen, the timeout watchdog aborts it) and print::

    rank R: FAILED in PHASE after S s: Type: message

``verify`` (any world size) loads CKPT_DIR and checks it equals ``v1``
bit for bit, and that its files are the bytes ``v1`` wrote (the digest
printed after the first save).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

import shardwise
import shardwise.checkpoint
from shardwise.sharding_spec import ChunkShardingSpec

DELAY = 0.4  # seconds into the phase the victim dies


def say(line: str) -> None:
    """Print one line in one write, so lines of concurrent ranks do not interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def spec(dim: int, size: int) -> ChunkShardingSpec:
    return ChunkShardingSpec(dim=dim, placements=[f"rank:{r}/cpu" for r in range(size)])


def v1_state(size: int) -> dict[str, Any]:
    """The first checkpoint's values: the same on any world size (seeded), several dtypes."""
    g = torch.Generator().manual_seed(1234)
    return {
        "weight": torch.randn(37, 11, generator=g),
        "table": torch.randint(-(2**40), 2**40, (29, 5), generator=g, dtype=torch.int64),
        "half": torch.randn(13, 7, generator=g).to(torch.bfloat16),
        "step": 7,
    }


def sharded(state: dict[str, Any], group: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            out[key] = shardwise.shard_tensor(value, spec(0, group.size), src_rank=0, process_group=group)
        else:
            out[key] = value
    return out


def digest(path: Path) -> str:
    """sha256 over every file of a checkpoint directory (names and bytes), in name order."""
    h = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(str(file.relative_to(path)).encode())
        h.update(file.read_bytes())
    return h.hexdigest()


def die_later(how: str, when: Callable[[], bool]) -> None:
    """End (or freeze) this process from a thread once ``when()`` holds, so it happens inside a call."""
    sig = signal.SIGKILL if how == "kill" else signal.SIGSTOP

    def watch() -> None:
        while not when():
            time.sleep(0.005)
        say(f"rank {shardwise.get_default_group().rank}: victim sends itself {sig.name}")
        os.kill(os.getpid(), sig)

    threading.Thread(target=watch, daemon=True).start()


def after(seconds: float) -> Callable[[], bool]:
    deadline = time.monotonic() + seconds
    return lambda: time.monotonic() >= deadline


def collective(group: Any, path: Path) -> None:
    t = torch.ones(4 << 20)
    while True:
        group.all_reduce(t)
        t.fill_(1.0)


def reshard(group: Any, path: Path) -> None:
    full = torch.arange(4096 * 2048, dtype=torch.float32).reshape(4096, 2048) if group.rank == 0 else torch.empty(0)
    st = shardwise.shard_tensor(full, spec(0, group.size), src_rank=0, process_group=group)
    dims = [1, 0]
    while True:
        dims.reverse()
        st.reshard(spec(dims[0], group.size))


def checkpoint(group: Any, path: Path) -> None:
    shardwise.checkpoint.save(sharded(v1_state(group.size), group), path)
    if group.rank == 0:
        say(f"v1 saved by {group.size} ranks, digest {digest(path)}")
    group.barrier()
    # Large enough (32 MiB a rank) that the victim is still writing when it dies.
    big = torch.randn(group.size * 1024, 8192) if group.rank == 0 else torch.empty(0)
    state = sharded({"big": big, **{k: v + 1 for k, v in v1_state(group.size).items()}}, group)
    shardwise.checkpoint.save(state, path)


def verify(group: Any, path: Path, expected_digest: str) -> None:
    before = digest(path) if group.rank == 0 else ""
    target = sharded({k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0
                      for k, v in v1_state(group.size).items()}, group)
    shardwise.checkpoint.load(target, path)
    want = v1_state(group.size)
    for key, value in want.items():
        got = target[key]
        if isinstance(value, torch.Tensor):
            got = got.full_tensor()
            assert got.dtype == value.dtype and torch.equal(got, value), f"{key} differs from v1"
        else:
            assert got == value, f"{key}: {got!r} != {value!r}"
    if group.rank == 0:
        assert before == expected_digest, f"checkpoint files changed: {before} != {expected_digest}"
    say(f"rank {group.rank} of {group.size}: the previous checkpoint loads and equals v1 bit for bit")


PHASES = {"collective": collective, "reshard": reshard, "checkpoint": checkpoint}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("phase", choices=[*PHASES, "verify"])
    parser.add_argument("path", type=Path)
    parser.add_argument("--how", choices=["kill", "stop"], default="kill")
    parser.add_argument("--victim", type=int, default=1)
    parser.add_argument("--digest", default="")
    args = parser.parse_args()
    group = shardwise.init()
    if args.phase == "verify":
        verify(group, args.path, args.digest)
        shardwise.destroy()
        return 0
    if group.rank == args.victim:
        mine = f"__{group.rank}_0.distcp"
        if args.phase == "checkpoint":
            # Wait for v1 to be complete, then die once this rank's file of the second save exists.
            when = lambda: (args.path / ".metadata").exists() and any(  # noqa: E731
                args.path.parent.glob(f".{args.path.name}.saving-*/{mine}")
            )
        else:
            when = after(DELAY)
        die_later(args.how, when)
    started = time.monotonic()
    say(f"rank {group.rank} of {group.size} ({group.backend}): {args.phase} started")
    try:
        PHASES[args.phase](group, args.path)
    except Exception as exc:
        detail = " ".join(str(exc).split())[:400]
        say(f"rank {group.rank}: FAILED in {args.phase} after {time.monotonic() - started:.1f} s: "
            f"{type(exc).__name__}: {detail}")
        raise
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
