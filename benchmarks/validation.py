"""Shard-metadata validation: torch 2.13's ``torch.distributed._shard`` against shardwise, side by side.

    .venv/bin/python benchmarks/validation.py [--max-shards 100000] [--budget 0.3]

Every sharded-tensor constructor checks that the shards neither overlap nor
leave part of the tensor uncovered. For each layout and shard count this
times, on one process (no communication is involved):

- torch: ``validate_non_overlapping_shards_metadata(shards)`` then
  ``check_tensor(shards, size)`` (what torch's constructors run);
- shardwise: ``validate_layout(shards, size)`` (what shardwise's constructors
  run);
- shardwise, two calls: ``validate_non_overlapping(shards)`` then
  ``check_covering(shards, size)`` (the public functions one by one, what
  ``EnumerableShardingSpec`` runs).

Layouts, for n shards: ``rows`` (n x 1 shards of an n x 4 tensor, cut along
dim 0), ``columns`` (4 x 1 shards of a 4 x n tensor, cut along dim 1: each
spans all of dim 0), ``chunk`` (a ``ChunkShardingSpec`` over n placements, the
last chunk shorter), ``grid`` (a k x k grid, k = sqrt(n)) and ``grid3d`` (a
k x k x k grid). Shards are listed in a shuffled order (seeded), as metadata
gathered from many ranks may be.

Each cell is the median of interleaved calls (torch and shardwise alternate
in a shuffled order each round, so machine noise hits both alike), repeated
until each entry has run ``--budget`` seconds (at least 3 calls). As in
``timeit``, the garbage collector is off while a cell is timed (a
collection pass over 10^5 shards would land on whichever call happens to
run); it collects before each cell. The ratio is
torch's time over shardwise's: above 1, shardwise is faster. torch's checks
cost O(n^1.5) on grids and more on 3-D grids; a torch cell whose single call
would take longer than ``--torch-limit`` seconds (estimated from the previous
shard count) is skipped and shown as "—".

Prints a markdown table and writes it to benchmarks/results/validation.md.
"""

from __future__ import annotations

import argparse
import functools
import gc
import math
import random
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Optional

from torch.distributed._shard.metadata import ShardMetadata as TorchShardMetadata
from torch.distributed._shard.sharding_spec._internals import (
    check_tensor,
    validate_non_overlapping_shards_metadata,
)

from shardwise import ShardMetadata
from shardwise._vocab.validation import check_covering, validate_layout, validate_non_overlapping
from shardwise.sharding_spec import ChunkShardingSpec

Boxes = list[tuple[list[int], list[int]]]


def _rows(n: int) -> tuple[Boxes, list[int]]:
    return [([i, 0], [1, 4]) for i in range(n)], [n, 4]


def _columns(n: int) -> tuple[Boxes, list[int]]:
    return [([0, i], [4, 1]) for i in range(n)], [4, n]


def _chunk(n: int) -> tuple[Boxes, list[int]]:
    size = [3 * n - 1, 4]
    md = ChunkShardingSpec(0, [f"rank:{i}/cpu" for i in range(n)]).build_metadata(size)
    return [(m.shard_offsets, m.shard_sizes) for m in md.shards_metadata], size


def _grid(n: int) -> tuple[Boxes, list[int]]:
    k = max(1, round(math.sqrt(n)))
    return [([2 * i, 3 * j], [2, 3]) for i in range(k) for j in range(k)], [2 * k, 3 * k]


def _grid3d(n: int) -> tuple[Boxes, list[int]]:
    k = max(1, round(n ** (1 / 3)))
    cells = [([i, j, m], [1, 1, 1]) for i in range(k) for j in range(k) for m in range(k)]
    return cells, [k, k, k]


LAYOUTS: dict[str, Callable[[int], tuple[Boxes, list[int]]]] = {
    "rows": _rows,
    "columns": _columns,
    "chunk": _chunk,
    "grid": _grid,
    "grid3d": _grid3d,
}


def _two_calls(shards: list[ShardMetadata], size: list[int]) -> None:
    validate_non_overlapping(shards)
    check_covering(shards, size)


def _torch(shards: list[TorchShardMetadata], size: list[int]) -> None:
    validate_non_overlapping_shards_metadata(shards)
    check_tensor(shards, size)


def _time(calls: dict[str, Callable[[], Any]], budget: float) -> dict[str, float]:
    """Median seconds per call of each entry, calls interleaved in a shuffled order each round."""
    for fn in calls.values():
        fn()  # warm-up (and a check that it passes)
    times: dict[str, list[float]] = {name: [] for name in calls}
    spent = dict.fromkeys(calls, 0.0)
    rnd = random.Random(0)
    gc.collect()
    gc.disable()
    try:
        while min(len(t) for t in times.values()) < 3 or min(spent.values()) < budget:
            order = list(calls)
            rnd.shuffle(order)
            for name in order:
                start = time.perf_counter()
                calls[name]()
                elapsed = time.perf_counter() - start
                times[name].append(elapsed)
                spent[name] += elapsed
    finally:
        gc.enable()
    return {name: statistics.median(ts) for name, ts in times.items()}


def _ms(seconds: Optional[float]) -> str:
    if seconds is None:
        return "—"
    return f"{seconds * 1e3:.3f}" if seconds < 0.1 else f"{seconds * 1e3:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-shards", type=int, default=100_000)
    parser.add_argument("--budget", type=float, default=0.3, help="seconds of calls per cell and entry")
    parser.add_argument("--torch-limit", type=float, default=20.0, help="skip torch cells slower than this (s)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "validation.md")
    args = parser.parse_args()

    counts = [n for n in (10, 100, 1_000, 10_000, 100_000) if n <= args.max_shards]
    lines = [
        "| layout | shards | torch ms | shardwise ms | ratio | shardwise, two calls ms | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    print("\n".join(lines), flush=True)
    for name, make in LAYOUTS.items():
        torch_last: Optional[tuple[int, float]] = None
        for n in counts:
            boxes, size = make(n)
            random.Random(n).shuffle(boxes)
            ours = [ShardMetadata(o, s, "rank:0/cpu") for o, s in boxes]
            theirs = [TorchShardMetadata(o, s, "rank:0/cpu") for o, s in boxes]
            calls: dict[str, Callable[[], Any]] = {
                "shardwise": functools.partial(validate_layout, ours, size),
                "two calls": functools.partial(_two_calls, ours, size),
            }
            # torch's cost grows as n^1.5 or faster on grids: skip a cell whose estimate is past the limit.
            estimate = 0.0 if torch_last is None else torch_last[1] * (len(boxes) / torch_last[0]) ** 1.5
            if estimate <= args.torch_limit:
                calls["torch"] = functools.partial(_torch, theirs, size)
            result = _time(calls, args.budget)
            torch_s = result.get("torch")
            if torch_s is not None:
                torch_last = (len(boxes), torch_s)
            ratio = "—" if torch_s is None else f"{torch_s / result['shardwise']:.2f}"
            ratio2 = "—" if torch_s is None else f"{torch_s / result['two calls']:.2f}"
            line = (
                f"| {name} | {len(boxes)} | {_ms(torch_s)} | {_ms(result['shardwise'])} | {ratio} "
                f"| {_ms(result['two calls'])} | {ratio2} |"
            )
            lines.append(line)
            print(line, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        "# Shard-metadata validation: torch 2.13 vs shardwise\n\n"
        "`python benchmarks/validation.py`: median ms per validation of n shards "
        "(ratio = torch / shardwise; above 1, shardwise is faster).\n\n" + "\n".join(lines) + "\n"
    )


if __name__ == "__main__":
    main()
