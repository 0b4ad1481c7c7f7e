"""The transfer planner, on metadata alone, simulated over every rank in one process.

``shardwise._layout.plan.plan`` decides what each rank copies locally, sends and
receives, and how; ``pack``/``unpack``/``copy_local`` are the real data movers. Here
every rank's plan is run against in-memory "wires" and the result compared
with the dense tensor, and the plans are checked against an independent
count of what must move (element owner maps).
"""

from __future__ import annotations

import itertools
import math
import re
from typing import Optional

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hst

from shardwise._layout.plan import MAX_ROUNDS, Run, restrict, slab_plans, slabs
from shardwise._layout.redistribute import (
    Piece,
    TransferPlan,
    box,
    copy_local,
    pack,
    plan,
    receive_view,
    row_major_start,
    send_view,
    unpack,
)
from shardwise._vocab.metadata import ShardMetadata, ShardedTensorMetadata, TensorProperties
from shardwise.sharding_spec import ChunkShardingSpec


def _md(shards: list[ShardMetadata], size: list[int], dtype: torch.dtype = torch.float64) -> ShardedTensorMetadata:
    return ShardedTensorMetadata(shards, torch.Size(size), TensorProperties(dtype=dtype))


def _chunk(size: list[int], dim: int, ranks: list[int]) -> ShardedTensorMetadata:
    return ChunkShardingSpec(dim, [f"rank:{r}/cpu" for r in ranks]).build_metadata(
        size, TensorProperties(torch.float64)
    )


def _grid(size: list[int], cuts: list[list[int]], ranks: list[int], empties: list[int]) -> ShardedTensorMetadata:
    """Shards on the grid cut at ``cuts`` (per dim), cell k on ``ranks[k]``, plus empty shards on ``empties``."""
    edges = [[0, *c, n] for c, n in zip(cuts, size, strict=True)]
    shards = []
    for k, cell in enumerate(itertools.product(*[range(len(e) - 1) for e in edges])):
        offsets = [edges[d][c] for d, c in enumerate(cell)]
        sizes = [edges[d][c + 1] - edges[d][c] for d, c in enumerate(cell)]
        shards.append(ShardMetadata(offsets, sizes, f"rank:{ranks[k % len(ranks)]}/cpu"))
    for r in empties:
        shards.append(ShardMetadata([0] * len(size), [0] * len(size), f"rank:{r}/cpu"))
    return _md(shards, size)


def _owners(md: ShardedTensorMetadata) -> torch.Tensor:
    """Rank owning each element (-1 where no shard does)."""
    owner = torch.full(tuple(md.size), -1, dtype=torch.int64)
    for s in md.shards_metadata:
        assert s.placement is not None
        box(owner, s.shard_offsets, s.shard_sizes).fill_(s.placement.rank())
    return owner


def simulate(src: ShardedTensorMetadata, dst: ShardedTensorMetadata, world: int, rounds: int = 1) -> list[TransferPlan]:
    """Run every rank's plan with in-memory wires and check the result against the dense tensor.

    With ``rounds`` > 1 the plans are cut into that many dim-0 slabs
    (``slab_plans``) and each slab goes through its own wire, as
    ``redistribute(..., rounds=...)`` does.
    """
    size = tuple(src.size)
    dense = torch.arange(1, 1 + torch.Size(size).numel(), dtype=torch.float64).reshape(size)
    plans = [plan(src, dst, r, world) for r in range(world)]
    sources: list[dict[int, torch.Tensor]] = [{} for _ in range(world)]
    targets: list[dict[int, torch.Tensor]] = [{} for _ in range(world)]
    for i, s in enumerate(src.shards_metadata):
        assert s.placement is not None
        sources[s.placement.rank()][i] = box(dense, s.shard_offsets, s.shard_sizes).clone()
    for j, s in enumerate(dst.shards_metadata):
        assert s.placement is not None
        targets[s.placement.rank()][j] = torch.full(s.shard_sizes, -1.0, dtype=torch.float64)
    if rounds > 1 and size and size[0] > 1:
        # Round k of every rank goes through one wire, as ``redistribute(..., rounds=...)`` runs them.
        for parts in zip(*[slab_plans(p, rounds) for p in plans], strict=True):
            _wire(list(parts), sources, targets)
    else:
        for r, flat in enumerate(_wire(plans, sources, targets)):
            whole = plans[r].recv_whole
            if whole is not None:
                # The receive buffer, as it is, is that target shard.
                md = dst.shards_metadata[whole]
                assert torch.equal(flat.view(md.shard_sizes), box(dense, md.shard_offsets, md.shard_sizes))
    for j, s in enumerate(dst.shards_metadata):
        assert s.placement is not None
        got = targets[s.placement.rank()][j]
        assert torch.equal(got, box(dense, s.shard_offsets, s.shard_sizes)), (j, s.describe())
    return plans


def _wire(
    plans: list[TransferPlan], sources: list[dict[int, torch.Tensor]], targets: list[dict[int, torch.Tensor]]
) -> list[torch.Tensor]:
    """One all-to-all of every rank's ``plans``, in memory; returns what each rank received."""
    world = len(plans)
    wires = [pack(p, sources[r], torch.float64, torch.device("cpu")) for r, p in enumerate(plans)]
    for r, p in enumerate(plans):
        copy_local(p, sources[r], targets[r], torch.float64)
    received = []
    for r, p in enumerate(plans):
        # What rank r receives: from each sender s, the slice of s's buffer meant for r.
        parts = []
        for s in range(world):
            start = sum(plans[s].send_counts[:r])
            parts.append(wires[s][start : start + plans[s].send_counts[r]])
        flat = torch.cat(parts)
        into = receive_view(p, targets[r], torch.float64)
        if into is not None:
            into.copy_(flat)  # what the all-to-all does when given ``out=into``
        else:
            unpack(p, flat, targets[r])
        received.append(flat)
    return received


def check_plans(src: ShardedTensorMetadata, dst: ShardedTensorMetadata, plans: list[TransferPlan]) -> None:
    """Every target element arrives exactly once from its owner; volumes are exactly what must move."""
    world = len(plans)
    src_owner, dst_owner = _owners(src), _owners(dst)
    for r, p in enumerate(plans):
        assert p.send[r] == () and p.recv[r] == ()
        for s in range(world):
            # Sender and receiver list the same pieces in the same order.
            assert plans[s].send[r] == p.recv[s]
            must_move = int(((src_owner == r) & (dst_owner == s)).sum()) if s != r else 0
            assert p.send_counts[s] == must_move, (r, s, p.send_counts, must_move)
        seen = {j: torch.zeros(dst.shards_metadata[j].shard_sizes, dtype=torch.int64) for j in _on(dst, r)}
        for frm, pieces in [(r, p.local), *enumerate(p.recv)]:
            for piece in pieces:
                smd, dmd = src.shards_metadata[piece.src], dst.shards_metadata[piece.dst]
                assert smd.rank == frm and dmd.rank == r
                # The piece lies inside both shards, at the offsets it claims.
                assert [o - so for o, so in zip(piece.offsets, smd.shard_offsets, strict=True)] == list(piece.src_start)
                assert [o - do for o, do in zip(piece.offsets, dmd.shard_offsets, strict=True)] == list(piece.dst_start)
                assert all(
                    0 <= a and a + n <= m for a, n, m in zip(piece.src_start, piece.sizes, smd.shard_sizes, strict=True)
                )
                box(seen[piece.dst], piece.dst_start, piece.sizes).add_(1)
        for j, count in seen.items():
            assert bool((count == 1).all()), (r, j, count)
    wire = any(n for p in plans for n in p.send_counts)
    assert all(p.needs_wire == wire for p in plans)


def _locals(p: TransferPlan) -> list[Piece]:
    return list(p.local)


def _sent(p: TransferPlan) -> list[Piece]:
    return [q for per_rank in p.send for q in per_rank]


def _received(p: TransferPlan) -> list[Piece]:
    return [q for per_rank in p.recv for q in per_rank]


def _on(md: ShardedTensorMetadata, rank: int) -> list[int]:
    return [j for j, s in enumerate(md.shards_metadata) if s.rank == rank]


@hst.composite
def layouts(draw: hst.DrawFn, size: list[int], world: int) -> ShardedTensorMetadata:
    rank = hst.integers(0, world - 1)
    if size and draw(hst.booleans()):
        dim = draw(hst.integers(-len(size), len(size) - 1))
        return _chunk(size, dim, draw(hst.lists(rank, min_size=1, max_size=5)))
    cuts = [sorted(draw(hst.sets(hst.integers(1, n - 1), max_size=3))) if n > 1 else [] for n in size]
    cells = 1
    for c in cuts:
        cells *= len(c) + 1
    ranks = draw(hst.lists(rank, min_size=cells, max_size=cells))
    # A 0-d "empty" shard would hold the one element, so empty shards need a dim.
    return _grid(size, cuts, ranks, draw(hst.lists(rank, max_size=2 if size else 0)))


@hst.composite
def problems(draw: hst.DrawFn) -> tuple[ShardedTensorMetadata, ShardedTensorMetadata, int]:
    world = draw(hst.integers(1, 4))
    size = draw(hst.lists(hst.integers(0, 6), min_size=0, max_size=3))
    return draw(layouts(size, world)), draw(layouts(size, world)), world


@settings(max_examples=300, deadline=None)
@given(problems())
def test_random_layouts_move_every_element_once(
    problem: tuple[ShardedTensorMetadata, ShardedTensorMetadata, int],
) -> None:
    src, dst, world = problem
    check_plans(src, dst, simulate(src, dst, world))


@settings(max_examples=300, deadline=None)
@given(problems(), hst.sampled_from([2, 3, 4, 8]))
def test_random_layouts_moved_in_rounds_are_exact(
    problem: tuple[ShardedTensorMetadata, ShardedTensorMetadata, int], rounds: int
) -> None:
    src, dst, world = problem
    plans = simulate(src, dst, world, rounds)
    rows = src.size[0] if len(src.size) else 0
    for p in plans:
        needed = p.rounds
        assert 1 <= needed <= MAX_ROUNDS
        if rows > 1:
            # The slabs cut every piece without losing or repeating an element.
            cut = [restrict(p, lo, hi) for lo, hi in slabs(rows, min(rounds, rows))]
            for pieces in (_locals, _sent, _received):
                assert sum(q.numel for c in cut for q in pieces(c)) == sum(q.numel for q in pieces(p))
            assert all(c.needs_wire == p.needs_wire for c in cut)


def test_chunk_to_chunk_volumes() -> None:
    # 10 rows on 4 ranks (3, 3, 3, 1) to columns: each rank keeps its own rows of its own columns.
    src = _chunk([10, 4], 0, [0, 1, 2, 3])
    dst = _chunk([10, 4], 1, [0, 1, 2, 3])
    plans = simulate(src, dst, 4)
    check_plans(src, dst, plans)
    assert plans[0].send_counts == [0, 3, 3, 3]
    assert plans[3].send_counts == [1, 1, 1, 0]
    assert [p.numel for p in plans[0].local] == [3]


def test_whole_arrivals_are_adopted() -> None:
    # Scattering rows from rank 0: ranks 1 and 2 receive their whole shard in one piece.
    src = _chunk([5, 3], 0, [0])
    dst = _chunk([5, 3], 0, [0, 1, 2])
    plans = simulate(src, dst, 3)
    assert [p.recv_whole for p in plans] == [None, 1, 2]
    # Columns gathered from row shards arrive in row order: whole, unless part of it is local.
    src, dst = _chunk([4, 6], 0, [0, 1]), _chunk([4, 6], 1, [2, 0])
    assert [p.recv_whole for p in simulate(src, dst, 3)] == [None, None, 0]
    # Two target shards on one rank: never adopted.
    dst = _chunk([4, 6], 1, [2, 2])
    assert simulate(src, dst, 3)[2].recv_whole is None


def test_row_major_start() -> None:
    size = [4, 3, 5]
    dense = torch.arange(60).reshape(size)
    for offsets, sizes in [([1, 0, 0], [2, 3, 5]), ([2, 1, 0], [1, 2, 5]), ([3, 2, 1], [1, 1, 3]), ([0, 0, 0], size)]:
        start = row_major_start(offsets, sizes, size)
        assert start is not None
        assert torch.equal(box(dense, offsets, sizes).reshape(-1), torch.arange(start, start + math.prod(sizes)))
    for offsets, sizes in [([0, 0, 0], [2, 2, 5]), ([0, 0, 1], [1, 2, 3]), ([0, 1, 0], [2, 1, 5])]:
        assert row_major_start(offsets, sizes, size) is None
    assert row_major_start([], [], []) == 0


def test_same_layout_and_permuted_placements() -> None:
    src = _chunk([5, 3], 0, [2, 0, 1])
    plans = simulate(src, src, 3)
    assert not any(p.needs_wire for p in plans) and all(p.local for p in plans)
    # Rotating placements moves every shard to another rank, whole.
    dst = _chunk([5, 3], 0, [0, 1, 2])
    plans = simulate(src, dst, 3)
    check_plans(src, dst, plans)
    assert [p.send_counts for p in plans] == [[0, 6, 0], [0, 0, 3], [6, 0, 0]]


def test_only_remote_pairs_need_the_wire() -> None:
    # Rank 0's own pieces stay local, but ranks 1 and 2 swap: every rank must still enter the exchange.
    src = _grid([4], [[1, 2]], [0, 1, 2], [])
    dst = _grid([4], [[1, 2]], [0, 2, 1], [])
    plans = simulate(src, dst, 3)
    assert plans[0].send_counts == [0, 0, 0] and plans[0].recv_counts == [0, 0, 0]
    assert all(p.needs_wire for p in plans)


def test_several_shards_per_rank_and_empty_shards() -> None:
    src = _grid([4, 6], [[1, 3], [2, 4]], [0, 1, 0, 1, 0, 1, 1, 0, 1], [0, 1])
    dst = _chunk([4, 6], 1, [1, 1, 0, 0, 1])
    check_plans(src, dst, simulate(src, dst, 2))


def test_zero_dim_and_empty_tensors() -> None:
    scalar_a = _md([ShardMetadata([], [], "rank:0/cpu")], [])
    scalar_b = _md([ShardMetadata([], [], "rank:1/cpu")], [])
    plans = simulate(scalar_a, scalar_b, 2)
    assert plans[0].send_counts == [0, 1] and plans[1].recv[0][0].sizes == ()
    empty = _chunk([0, 3], 0, [0, 1])
    plans = simulate(empty, _chunk([0, 3], 1, [1, 0]), 2)
    assert not any(p.needs_wire for p in plans)


@pytest.mark.parametrize(
    ("src", "dst", "world", "message"),
    [
        (_chunk([4], 0, [0]), _chunk([5], 0, [0]), 1, "source size [4] and target size [5] differ"),
        (_chunk([4], 0, [0]), _chunk([4], 0, [3]), 2, "placed on rank 3, outside a group of 2"),
        (_md([ShardMetadata([0], [4], None)], [4]), _chunk([4], 0, [0]), 1, "source shard 0"),
        (_chunk([4], 0, [0]), _md([ShardMetadata([0, 0], [4, 1], "rank:0/cpu")], [4]), 1, "has 2 dims, not 1"),
    ],
)
def test_bad_metadata(
    src: ShardedTensorMetadata, dst: ShardedTensorMetadata, world: Optional[int], message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        plan(src, dst, 0, world)


def test_world_size_defaults_to_placements() -> None:
    p = plan(_chunk([6], 0, [0, 2]), _chunk([6], 0, [2, 0]), 2)
    assert p.world_size == 3 and p.recv_counts == [3, 0, 0] and p.send_counts == [3, 0, 0]


def test_rows_move_without_packing_or_unpacking() -> None:
    size = [7, 3]
    whole = _md([ShardMetadata([0, 0], size, "rank:0/cpu")], size)
    rows = _chunk(size, 0, [0, 1, 2])  # 3 + 3 + 1 rows
    dense = torch.arange(21, dtype=torch.float64).reshape(7, 3)
    # Scatter: rank 0 sends rows 3..6 (to ranks 1 and 2) straight from the whole tensor.
    sent = pack(plan(whole, rows, 0, 3), {0: dense}, torch.float64, torch.device("cpu"))
    assert sent.data_ptr() == dense[3].data_ptr() and torch.equal(sent, dense[3:].reshape(-1))
    # Gather: rank 0 receives rows 3..6 straight into ``out``.
    out = torch.empty(7, 3, dtype=torch.float64)
    into = receive_view(plan(rows, whole, 0, 3), {0: out}, torch.float64)
    assert into is not None and into.data_ptr() == out[3].data_ptr() and into.numel() == 12
    # Columns are not runs of memory: they are packed.
    cols = _chunk(size, 1, [0, 1, 2])
    assert pack(plan(whole, cols, 0, 3), {0: dense}, torch.float64, torch.device("cpu")).data_ptr() != dense.data_ptr()
    assert receive_view(plan(cols, whole, 0, 3), {0: out}, torch.float64) is None
    # Nor is a run of another dtype (the wire dtype decides what is sent).
    assert receive_view(plan(rows, whole, 0, 3), {0: out.float()}, torch.float64) is None


def test_views_need_consecutive_runs() -> None:
    rows = _chunk([4, 2], 0, [0, 1, 2, 3])
    whole = _md([ShardMetadata([0, 0], [4, 2], "rank:0/cpu")], [4, 2])
    # Rows 1, 2, 3 arrive from ranks 1, 2, 3 back to back after rank 0's own row.
    gathered = plan(rows, whole, 0, 4)
    assert gathered.recv_view == Run(0, 2, 8) and gathered.recv_whole is None
    assert receive_view(gathered, {0: torch.zeros(4, 2)}, torch.float32) is not None
    assert receive_view(gathered, {0: torch.zeros(2, 4).t()}, torch.float32) is None  # not contiguous
    # Rows 1 and 3 only (rank 2 keeps row 2): a gap between them, so no view.
    holes = _md([ShardMetadata([0, 0], [4, 2], "rank:0/cpu")], [4, 2], torch.float64)
    spread = _grid([4, 2], [[1, 2, 3], []], [0, 1, 0, 3], [])
    assert plan(spread, holes, 0, 4).recv_view is None
    # Scattering rows: rank 0 sends rows 1..3 from a view of the whole tensor, and each row arrives whole.
    scattered = [plan(whole, rows, r, 4) for r in range(4)]
    assert scattered[0].send_view == Run(0, 2, 8)
    assert [p.recv_whole for p in scattered] == [None, 1, 2, 3]
    assert send_view(scattered[0], {0: torch.zeros(4, 2)}, torch.float32) is not None
    assert send_view(scattered[0], {0: torch.zeros(4, 2)}, torch.float64) is None  # another dtype on the wire


def _buffers(p: TransferPlan, src: ShardedTensorMetadata, dst: ShardedTensorMetadata) -> int:
    """Elements this plan packs into a send buffer plus those it receives into a separate buffer."""
    sources = {i: torch.zeros(m.shard_sizes, dtype=torch.float64) for i, m in enumerate(src.shards_metadata)}
    targets = {j: torch.zeros(m.shard_sizes, dtype=torch.float64) for j, m in enumerate(dst.shards_metadata)}
    sent = pack(p, sources, torch.float64, torch.device("cpu"))
    # pack returns a view of a source when the pieces lie back to back there.
    is_view = any(sent.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for t in sources.values())
    into = receive_view(p, targets, torch.float64)
    return (0 if is_view else sent.numel()) + (0 if into is not None else sum(p.recv_counts))


def test_rounds_keep_each_ranks_buffers_within_its_shard() -> None:
    # dim 0 <-> dim 1 on 4 ranks: a middle rank's outgoing pieces are strided and its incoming ones
    # have a gap where its own block goes, so one all-to-all needs 3/4 + 3/4 of a shard in buffers.
    rows, cols = _chunk([8, 8], 0, [0, 1, 2, 3]), _chunk([8, 8], 1, [0, 1, 2, 3])
    for src, dst in ((rows, cols), (cols, rows)):
        plans = [plan(src, dst, r, 4) for r in range(4)]
        assert [_buffers(p, src, dst) for p in plans] == [12, 24, 24, 12]
        needed = [p.rounds for p in plans]
        assert needed == [1, 2, 2, 1]
        for lo, hi in slabs(8, max(needed)):
            assert all(_buffers(restrict(p, lo, hi), src, dst) <= 16 for p in plans)
        simulate(src, dst, 4, max(needed))
    # On 2 ranks one side of the exchange is always a view: no rounds.
    rows2, cols2 = _chunk([8, 8], 0, [0, 1]), _chunk([8, 8], 1, [0, 1])
    assert [plan(rows2, cols2, r, 2).rounds for r in range(2)] == [1, 1]
    # Nothing on the wire: one round, whatever the layout.
    assert plan(rows, rows, 1, 4).rounds == 1


def test_one_row_whose_buffers_fit_takes_one_round() -> None:
    # One row of 64 elements over 4 ranks: the buffers fit each rank's shard, so one round (a row that did not
    # fit would be cut inside it: test_reshard_slabs.py).
    wide_rows, wide_cols = _chunk([1, 64], 1, [0, 1, 2, 3]), _grid([1, 64], [[], [8, 24, 40]], [1, 3, 0, 2], [])
    assert [plan(wide_rows, wide_cols, r, 4).rounds for r in range(4)] == [1] * 4
    assert slabs(10, 4) == [(0, 2), (2, 5), (5, 7), (7, 10)]
    assert slabs(3, 3) == [(0, 1), (1, 2), (2, 3)]


def test_restrict_clips_pieces_to_a_slab() -> None:
    src, dst = _chunk([8, 6], 0, [0, 1]), _chunk([8, 6], 1, [0, 1])
    p = plan(src, dst, 0, 2)
    (piece,) = p.send[1]  # rows 0..4, columns 3..6 of the whole tensor
    assert (piece.offsets, piece.sizes) == ((0, 3), (4, 3))
    (clipped,) = restrict(p, 1, 3).send[1]
    assert (clipped.offsets, clipped.sizes, clipped.src_start, clipped.dst_start, clipped.numel) == (
        (1, 3), (2, 3), (1, 3), (1, 0), 6
    )
    assert restrict(p, 4, 8).send[1] == () and restrict(p, 4, 8).needs_wire
    assert restrict(p, 0, 8) == p
