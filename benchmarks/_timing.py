"""Timing helpers shared by the benchmarks (run under ``mpiexec``; rank 0 reports)."""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

__all__ = ["Spread", "library_line", "mpi", "peak_memory", "script_args", "time_all", "time_spread", "with_verify"]


@dataclass(frozen=True)
class Spread:
    """The fastest, median and slowest of an entry's timed calls (each the slowest rank's), in any one unit."""

    min: float
    median: float
    max: float

    def scaled(self, factor: float) -> Spread:
        """The same spread in another unit (``factor`` = 1e3: seconds to milliseconds)."""
        return Spread(self.min * factor, self.median * factor, self.max * factor)


def mpi() -> Any:
    """``mpi4py.MPI``, imported on first use (importing it initialises MPI)."""
    from mpi4py import MPI

    return MPI


def time_all(comm: Any, calls: dict[str, Callable[[], Any]], repeats: int, warmup: int) -> dict[str, float]:
    """Median seconds per call of each entry, the slowest rank's (see :func:`time_spread`)."""
    return {name: spread.median for name, spread in time_spread(comm, calls, repeats, warmup).items()}


def time_spread(comm: Any, calls: dict[str, Callable[[], Any]], repeats: int, warmup: int) -> dict[str, Spread]:
    """Seconds per call of each entry: the fastest, median and slowest call, each the slowest rank's.

    Calls are interleaved in a new order every round (shuffled with the
    round number as seed, so every rank agrees), so drift, noise from other
    work and the after-effects of one entry on the next (freed memory,
    a shared process group's state) hit every entry alike: a fixed rotation
    made the entry listed after another follow it in most rounds. A barrier
    precedes each call.
    """
    for fn in calls.values():
        for _ in range(warmup):
            comm.Barrier()
            fn()
    times: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for i in range(repeats):
        order = list(names)
        random.Random(i).shuffle(order)
        for name in order:
            comm.Barrier()
            start = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - start)
    # Every rank must report the same figures: the slowest rank's.
    return {
        name: Spread(*(comm.allreduce(stat(ts), op=mpi().MAX) for stat in (min, statistics.median, max)))
        for name, ts in times.items()
    }


def with_verify(group: Any, verify: bool, fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` run with ``group.verify`` set first (so interleaved entries can differ in it)."""

    def call() -> Any:
        group.verify = verify
        return fn()

    return call


def library_line() -> str:
    """torch, mpi4py and MPI library versions, for a results header."""
    import torch

    return (
        f"torch {torch.__version__}, mpi4py {sys.modules['mpi4py'].__version__}, "
        f"{' '.join(mpi().Get_library_version().split()[:3])}"
    )


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def peak_memory(fn: Callable[[], Any]) -> tuple[int, int]:
    """This process's peak resident set while ``fn`` runs, and the most memory ``fn`` added (bytes).

    The added memory is the larger of two counts: the peak resident set
    minus the resident set before (Linux only: writing 5 to
    ``/proc/self/clear_refs`` resets the peak, ``VmHWM``), and the most bytes
    of shardwise's large buffers (``shardwise._comm.buffers``) taken while ``fn``
    runs and in use at once (buffers from before that are freed meanwhile,
    for instance late by gloo's worker thread, do not offset them). The
    second counts buffers that reuse memory already resident (its cache of
    freed buffers), which the first misses.
    """
    from shardwise._comm import buffers as _memory

    gc.collect()
    before = _status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    _memory.reset_peak()
    fn()
    peak = _status_bytes("VmHWM")
    return peak, max(peak - before, _memory.peak_new_bytes())


def script_args(doc: str, argv: list[str] | None = None) -> argparse.Namespace:
    """``--smoke`` (tiny sizes: checks that the script runs, as ``make test`` does) and ``--out DIR``."""
    parser = argparse.ArgumentParser(description=doc.split("\n", 1)[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes and 2 repeats: checks that it runs")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results", help="results directory")
    return parser.parse_args(argv)


def publish(out: Path, name: str, text: str) -> None:
    """Write a results table to ``out/name`` (making ``out``) and print it, as every benchmark ends."""
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(text)
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    sys.stdout.flush()
