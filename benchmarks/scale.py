"""Metadata that scales: shardwise against torch 2.13 from 10 to 10^5 shards, one process.

    .venv/bin/python benchmarks/scale.py [--quick]

Three costs that grow with the number of shards, each timed side by side
(median of interleaved calls, the garbage collector off while timing, as in
``timeit``; see ``benchmarks/validation.py``):

- validation: torch's ``validate_non_overlapping_shards_metadata`` +
  ``check_tensor`` against shardwise's ``validate_layout``, for ``rows``,
  ``columns`` (every shard spans dim 0), ``grid`` and ``grid3d`` layouts;
- overlap check of layouts that tile nothing: torch's
  ``validate_non_overlapping_shards_metadata`` against shardwise's
  ``validate_non_overlapping`` for ``split3d`` (a cube split at random
  places along all three dims, one shard in 20 missing) and ``slabs3d``
  (three stacked blocks of slabs, thin along each dim in turn, one slab
  missing), where neither the corner test nor the elementary cells apply
  and shardwise takes its segment trees;
- reshard plan: a ChunkShardingSpec dim 0 -> dim 1 reshard over W ranks,
  one rank's plan: torch's ``build_reshard_metadata`` (its metadata only; its
  split sizes come later, from tensors) against shardwise's ``plan`` (every
  piece the rank copies, sends and receives, and how);
- checkpoint load plan: T tensors each saved as a G x G grid of chunks,
  loaded by one of 64 ranks as a ChunkShardingSpec chunk along dim 0 and
  along dim 1: torch's
  ``create_read_items_for_chunk_list`` (what ``DefaultLoadPlanner`` calls per
  tensor) against shardwise's ``read_items`` with one ``IndexCache`` per plan
  (what shardwise's load planner calls per tensor). x = chunks per tensor.

Writes benchmarks/results/scale.md and scale.png (time against shard
count, log-log, so the growth order shows as a slope) and ends with a
"Targets" checklist.
"""

from __future__ import annotations

import argparse
import functools
import gc
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch.distributed._shard.metadata import ShardMetadata as TorchShardMetadata
from torch.distributed._shard.sharded_tensor.reshard import build_reshard_metadata
from torch.distributed._shard.sharding_spec import ChunkShardingSpec as TorchChunkSpec
from torch.distributed._shard.sharding_spec._internals import check_tensor, validate_non_overlapping_shards_metadata
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

sys.path.insert(0, str(Path(__file__).parent))
from validation import LAYOUTS, _time  # noqa: E402  (the benchmark next door: same layouts, same timing)

from shardwise import ShardMetadata  # noqa: E402
from shardwise._layout.plan import plan  # noqa: E402
from shardwise._modules.load_plan import IndexCache, read_items  # noqa: E402
from shardwise._vocab.validation import validate_layout, validate_non_overlapping  # noqa: E402
from shardwise.sharding_spec import ChunkShardingSpec  # noqa: E402

Row = tuple[str, str, int, Optional[float], float]  # (section, case, shards, torch s, shardwise s)


def _torch_validate(shards: list[TorchShardMetadata], size: list[int]) -> None:
    validate_non_overlapping_shards_metadata(shards)
    check_tensor(shards, size)


def _ours(saved: dict[str, Any], local: list[Any]) -> int:
    cache = IndexCache()
    return sum(len(read_items(fqn, md, local, cache)) for fqn, md in saved.items())


def _theirs(saved: dict[str, Any], local: list[Any]) -> int:
    return sum(len(create_read_items_for_chunk_list(fqn, md, local)) for fqn, md in saved.items())


def _side_by_side(
    section: str,
    layouts: dict[str, Callable[[int], tuple[list[tuple[list[int], list[int]]], list[int]]]],
    ours: Callable[[list[ShardMetadata], list[int]], None],
    theirs: Callable[[list[TorchShardMetadata], list[int]], None],
    growth: float,
    counts: list[int],
    budget: float,
    limit: float,
) -> list[Row]:
    """shardwise's ``ours`` and torch's ``theirs`` on each layout at each count; torch skipped past ``limit``.

    ``growth``: the power of n torch's time grows by, to estimate the next cell from the last one timed.
    """
    rows: list[Row] = []
    for name, make in layouts.items():
        last: Optional[tuple[int, float]] = None
        for n in counts:
            boxes, size = make(n)
            random.Random(n).shuffle(boxes)
            mine = [ShardMetadata(o, s, "rank:0/cpu") for o, s in boxes]
            torchs = [TorchShardMetadata(o, s, "rank:0/cpu") for o, s in boxes]
            calls: dict[str, Callable[[], Any]] = {"shardwise": functools.partial(ours, mine, size)}
            if last is None or last[1] * (len(boxes) / last[0]) ** growth <= limit:
                calls["torch"] = functools.partial(theirs, torchs, size)
            got = _time(calls, budget)
            if "torch" in got:
                last = (len(boxes), got["torch"])
            rows.append((section, name, len(boxes), got.get("torch"), got["shardwise"]))
            print(_line(rows[-1]), flush=True)
            gc.collect()
    return rows


def _validation(counts: list[int], budget: float, limit: float) -> list[Row]:
    # torch's cost grows as n^1.5 or faster on grids.
    layouts = {name: LAYOUTS[name] for name in ("rows", "columns", "grid", "grid3d")}
    return _side_by_side("validation", layouts, validate_layout, _torch_validate, 1.5, counts, budget, limit)


def _split3d(n: int) -> list[tuple[list[int], list[int]]]:
    """A cube split n-1 times, each time a random shard along a random dim at a random place; every 20th dropped."""
    rnd = random.Random(n)
    boxes = [([0, 0, 0], [1 << 20] * 3)]
    while len(boxes) < n:
        k = rnd.randrange(len(boxes))
        lo, size = boxes[k]
        d = max(range(3), key=lambda e: size[e] * rnd.random())
        if size[d] < 2:
            continue
        cut = rnd.randrange(1, size[d])
        upper = ([x + cut * (e == d) for e, x in enumerate(lo)], [z - cut * (e == d) for e, z in enumerate(size)])
        boxes[k] = (lo, [cut if e == d else z for e, z in enumerate(size)])
        boxes.append(upper)
    return [box for k, box in enumerate(boxes) if k % 20 != 19]


def _slabs3d(n: int) -> list[tuple[list[int], list[int]]]:
    """n/3 slabs thin along dim 0, then as many along dim 1, then along dim 2, stacked along dim 2; one missing."""
    m = max(1, n // 3)
    boxes = []
    for i in range(m):
        boxes += [([i, 0, 0], [1, m, m]), ([0, i, m], [m, 1, m]), ([0, 0, 2 * m + i], [m, m, 1])]
    del boxes[len(boxes) // 2]
    return boxes


def _overlap(counts: list[int], budget: float, limit: float) -> list[Row]:
    # torch's sweep is quadratic on these; neither layout covers a tensor, so no size is checked.
    layouts = {"split3d": _no_size(_split3d), "slabs3d": _no_size(_slabs3d)}
    return _side_by_side(
        "overlap check, no tiling",
        layouts,
        lambda shards, _: validate_non_overlapping(shards),
        lambda shards, _: validate_non_overlapping_shards_metadata(shards),
        2.0,
        counts,
        budget,
        limit,
    )


def _no_size(
    make: Callable[[int], list[tuple[list[int], list[int]]]],
) -> Callable[[int], tuple[list[tuple[list[int], list[int]]], list[int]]]:
    return lambda n: (make(n), [])


def _reshard(worlds: list[int], budget: float) -> list[Row]:
    rows: list[Row] = []
    for world in worlds:
        size = [2 * world, 2 * world]
        places = [f"rank:{i}/cpu" for i in range(world)]
        src = ChunkShardingSpec(0, places).build_metadata(size)
        dst = ChunkShardingSpec(1, places).build_metadata(size)
        torch_spec = TorchChunkSpec(1, places)
        rank = world // 2 + 1 if world > 2 else 0
        got = _time(
            {
                "shardwise": functools.partial(plan, src, dst, rank, world),
                "torch": functools.partial(build_reshard_metadata, torch.Size(size), torch_spec, world),
            },
            budget,
        )
        rows.append(("reshard plan", "chunk dim0->dim1, one rank", world, got["torch"], got["shardwise"]))
        print(_line(rows[-1]), flush=True)
    return rows


def _saved(tensors: int, grid: int, rows: int, cols: int) -> dict[str, Any]:
    """DCP metadata of ``tensors`` tensors, each saved as a ``grid`` x ``grid`` chunk grid (built synthetically)."""
    props = TensorProperties(dtype=torch.float32)
    boxes = [
        (
            torch.Size((i * rows // grid, j * cols // grid)),
            torch.Size(((i + 1) * rows // grid - i * rows // grid, (j + 1) * cols // grid - j * cols // grid)),
        )
        for i in range(grid)
        for j in range(grid)
    ]

    def chunk(offsets: torch.Size, sizes: torch.Size) -> ChunkStorageMetadata:
        # Past the dataclass __init__, which costs more than the plan itself at 4 million chunks.
        made = object.__new__(ChunkStorageMetadata)
        made.offsets, made.sizes = offsets, sizes
        return made

    return {
        f"layer{k}.weight": TensorStorageMetadata(props, torch.Size((rows, cols)), [chunk(o, s) for o, s in boxes])
        for k in range(tensors)
    }


def _checkpoint(grids: list[int], tensors: int, budget: float) -> list[Row]:
    rows: list[Row] = []
    loaders, rank = 64, 5
    # Loaded as row bands (dim 0) and as column bands (dim 1): an index sorted one way only would scan every
    # saved chunk for the other.
    for along in (0, 1):
        for grid in grids:
            height = width = 8 * 64
            saved = _saved(tensors, grid, height, width)
            start = rank * height // loaders
            length = (rank + 1) * height // loaders - start
            box = ((start, 0), (length, width)) if along == 0 else ((0, start), (height, length))
            local = [ChunkStorageMetadata(torch.Size(box[0]), torch.Size(box[1]))]

            ours, theirs = functools.partial(_ours, saved, local), functools.partial(_theirs, saved, local)
            if ours() != theirs():
                raise AssertionError("shardwise and torch read different numbers of items")
            got = _time({"shardwise": ours, "torch": theirs}, budget)
            case = f"{tensors} tensors, G x G grids -> 64 ranks dim {along}"
            rows.append(("checkpoint load plan", case, grid * grid, got["torch"], got["shardwise"]))
            print(_line(rows[-1]), flush=True)
            gc.collect()
    return rows


def _s(seconds: Optional[float]) -> str:
    return "—" if seconds is None else f"{seconds:.4f}" if seconds < 0.1 else f"{seconds:.3f}"


def _line(row: Row) -> str:
    section, case, n, theirs, ours = row
    ratio = "—" if theirs is None else f"{theirs / ours:.2f}"
    return f"| {section} | {case} | {n} | {_s(theirs)} | {_s(ours)} | {ratio} |"


def _chart(rows: list[Row], out: Path) -> None:
    # matplotlib is heavy and only the figure needs it.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sections = list(dict.fromkeys(r[0] for r in rows))
    fig, axes = plt.subplots(1, len(sections), figsize=(5.5 * len(sections), 4.5), squeeze=False)
    for ax, section in zip(axes[0], sections, strict=True):
        cases = list(dict.fromkeys(r[1] for r in rows if r[0] == section))
        for k, case in enumerate(cases):
            mine = [r for r in rows if r[0] == section and r[1] == case]
            color = f"C{k}"
            ax.plot([r[2] for r in mine], [r[4] for r in mine], "o-", color=color, label=f"shardwise {case}")
            timed = [r for r in mine if r[3] is not None]
            ax.plot([r[2] for r in timed], [r[3] for r in timed], "x--", color=color, label=f"torch 2.13 {case}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(section)
        ax.set_xlabel(
            "ranks" if section == "reshard plan" else "chunks per tensor" if "checkpoint" in section else "shards"
        )
        ax.set_ylabel("seconds")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _targets(rows: list[Row], quick: bool) -> list[str]:
    lines = []

    def check(label: str, row: Optional[Row], limit: float) -> None:
        if row is None:
            lines.append(f"- [ ] {label} < {limit:g} s: not measured" + (" (--quick)" if quick else ""))
            return
        mark = "x" if row[4] < limit else " "
        theirs = "not timed, its estimate past --torch-limit" if row[3] is None else f"{_s(row[3])} s"
        lines.append(f"- [{mark}] {label} < {limit:g} s: {_s(row[4])} s (torch 2.13: {theirs})")

    def find(section: str, case: str, n: int) -> Optional[Row]:
        return next((r for r in rows if r[0] == section and r[1].startswith(case) and r[2] >= n), None)

    for name in ("rows", "columns", "grid", "grid3d"):
        row = find("validation", name, 90_000)
        check(f"validation {row[2] if row else 100000} shards ({name})", row, 1.0)
    for name in ("split3d", "slabs3d"):
        row = find("overlap check, no tiling", name, 90_000)
        check(f"overlap check {row[2] if row else 100000} shards ({name}, tiling nothing)", row, 1.0)
    check("reshard plan, chunk->chunk, 4096 ranks, per rank", find("reshard plan", "chunk", 4096), 0.1)
    for along in (0, 1):
        check(
            f"checkpoint load plan, 1000 tensors of 64x64 chunks -> 64 ranks, chunks along dim {along}",
            next((r for r in rows if r[0] == "checkpoint load plan" and r[1].endswith(f"dim {along}")
                  and r[1].startswith("1000") and r[2] >= 4096), None),
            2.0,
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (small sizes, < 20 s)")
    parser.add_argument("--budget", type=float, default=0.3, help="seconds of calls per cell and entry")
    parser.add_argument("--torch-limit", type=float, default=20.0, help="skip torch cells slower than this (s)")
    parser.add_argument("--out", type=Path, default=None, help="default: results/scale.md (--quick: a temp dir)")
    args = parser.parse_args()
    quick = args.quick
    if args.out is None:
        # A smoke run leaves the recorded results alone.
        args.out = (
            Path(tempfile.gettempdir()) / "scale-quick.md" if quick else Path(__file__).parent / "results" / "scale.md"
        )
    budget = 0.02 if quick else args.budget
    counts = [10, 100, 1_000] if quick else [10, 100, 1_000, 10_000, 100_000]
    worlds = [16, 256] if quick else [16, 256, 4096]
    grids, tensors = ([2, 8], 20) if quick else ([4, 16, 64], 1000)
    header = ["| what | case | shards | torch 2.13 s | shardwise s | ratio |", "|---|---|---:|---:|---:|---:|"]
    print("\n".join(header), flush=True)
    start = time.perf_counter()
    rows = _validation(counts, budget, 2.0 if quick else args.torch_limit)
    rows += _overlap(counts, budget, 2.0 if quick else args.torch_limit)
    rows += _reshard(worlds, budget)
    rows += _checkpoint(grids, tensors, budget)
    targets = _targets(rows, quick)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    png = args.out.with_suffix(".png")
    _chart(rows, png)
    body = "\n".join(header + [_line(r) for r in rows])
    args.out.write_text(
        "# Metadata that scales: torch 2.13 vs shardwise\n\n"
        f"`python benchmarks/scale.py{' --quick' if quick else ''}`: median seconds per call, one process "
        f"(ratio = torch / shardwise; above 1, shardwise is faster). Figure: {png.name}.\n\n"
        f"{body}\n\n## Targets\n\n" + "\n".join(targets) + "\n"
    )
    print(f"\n(wrote {args.out} and {png}; {time.perf_counter() - start:.0f} s)")
    print("\nTargets\n" + "\n".join(targets))


if __name__ == "__main__":
    main()
