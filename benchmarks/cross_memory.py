"""What one cross-memory-attach copy costs here, by the far side's pages and layout (part of ``make bench``).

The cost model of ``shardwise._comm.box_moves`` (which end of a box copies
it) rests on these figures: the kernel pins the far side's pages iovec by
iovec and page by page, so the far side's page size and the number of its
stretches set a copy's speed, while our own side costs little. This forks one
peer process that holds the far-side buffers and times, in this process,
``process_vm_readv`` and ``process_vm_writev`` of 16 MiB (through shardwise's
own iovec streaming, ``shardwise._comm.cross_memory.read_runs``/``write_runs``)
beside a local ``memcpy``. Linux only; median of 9 calls after 2 warm-up.

Usage: ``python benchmarks/cross_memory.py [--smoke] [--out DIR]``
(writes ``DIR/cross-memory.md``, default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from shardwise._comm import cross_memory

MIB = 1 << 20
HUGE = 2 << 20


def _huge(nbytes: int) -> tuple[torch.Tensor, mmap.mmap]:
    """A touched buffer on a 2 MiB-aligned mapping advised to huge pages (as shardwise's buffer cache makes)."""
    region = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    flat = torch.frombuffer(region, dtype=torch.uint8)
    skip = (-flat.data_ptr()) % HUGE
    region.madvise(mmap.MADV_HUGEPAGE, skip, nbytes)
    t = flat[skip : skip + nbytes]
    t.fill_(1)
    return t, region


def _small(nbytes: int) -> tuple[torch.Tensor, mmap.mmap]:
    """A touched buffer in 4 KiB pages (as a user's ``torch.empty`` is, unless the kernel's THP is "always")."""
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_NOHUGEPAGE)
    t = torch.frombuffer(region, dtype=torch.uint8)
    t.fill_(1)
    return t, region


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:]) * 1e3


def _runs(local: int, remote: int, n: int, run: int, local_step: int, remote_step: int) -> torch.Tensor:
    i = torch.arange(n // run, dtype=torch.int64)
    return torch.stack([local + i * local_step, remote + i * remote_step, torch.full_like(i, run)], dim=1)


def measure(nbytes: int, repeats: int) -> list[tuple[str, float]]:
    """Fork the peer, time each copy, return (what, ms) rows."""
    to_child_r, to_child_w = os.pipe()
    to_parent_r, to_parent_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the peer: holds its buffers until told to go
        huge_src, _keep = _huge(2 * nbytes)
        small_src, _keep3 = _small(2 * nbytes)
        huge_dst, _keep2 = _huge(nbytes)
        os.write(to_parent_w, f"{huge_src.data_ptr()} {small_src.data_ptr()} {huge_dst.data_ptr()}".encode())
        os.read(to_child_r, 1)
        os._exit(0)
    try:
        huge_src, small_src, huge_dst = (int(x) for x in os.read(to_parent_r, 200).split())
        mine, _keep = _huge(2 * nbytes)
        other, _keep2 = _small(nbytes)
        run = 8 << 10

        def read(runs: torch.Tensor) -> Callable[[], object]:
            return lambda: cross_memory.read_runs(pid, runs)

        def write(runs: torch.Tensor) -> Callable[[], object]:
            return lambda: cross_memory.write_runs(pid, runs)

        base = mine.data_ptr()
        cases = [
            ("local memcpy", lambda: mine[:nbytes].copy_(other)),
            ("read from huge pages, contiguous", read(_runs(base, huge_src, nbytes, nbytes, 0, 0))),
            ("read from 4 KiB pages, contiguous", read(_runs(base, small_src, nbytes, nbytes, 0, 0))),
            ("read from huge pages, 8 KiB runs strided there", read(_runs(base, huge_src, nbytes, run, run, 2 * run))),
            ("read from huge pages, back to back there, strided here",
             read(_runs(base, huge_src, nbytes, run, 2 * run, run))),
            ("write into huge pages, contiguous", write(_runs(base, huge_dst, nbytes, nbytes, 0, 0))),
            ("write into huge pages, strided here", write(_runs(base, huge_dst, nbytes, run, 2 * run, run))),
        ]  # fmt: skip
        return [(what, _median_ms(fn, repeats)) for what, fn in cases]
    finally:
        os.write(to_child_w, b"x")
        os.waitpid(pid, 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="1 MiB and 2 repeats: checks that it runs")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    if not sys.platform.startswith("linux") or cross_memory.probe() is not None:
        print(f"cross-memory attach is not available here: {cross_memory.probe()}")
        return 0
    nbytes, repeats = (MIB, 2) if args.smoke else (16 * MIB, 9)
    rows = measure(nbytes, repeats)
    lines = [
        f"One process copying {nbytes // MIB} MiB from or into a forked peer's memory, the peer idle; median of "
        f"{repeats} calls; see benchmarks/cross_memory.py.",
        "",
        "| copy | ms | GB/s |",
        "|---|---:|---:|",
    ] + [f"| {what} | {ms:.2f} | {nbytes / ms / 1e6:.1f} |" for what, ms in rows]
    text = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cross-memory.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
