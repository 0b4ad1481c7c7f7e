"""The transfer plan's decisions are what execution does: the memory bound and the executor agree.

A :class:`~shardwise._layout.plan.TransferPlan` says, for one rank, whether
its outgoing pieces are sent from a view of their source (nothing packed),
whether its incoming pieces arrive into a view of their target (nothing
unpacked, or the receive buffer becomes the target), and how many rounds
keep its buffers within its shard. The memory bound counts buffers from
those fields (``buffer_numel``); here the real executor
(:func:`~shardwise._layout.redistribute.redistribute`) runs every rank in a
thread over an in-memory all-to-all, and what it packs, unpacks and
allocates is measured and compared with what the plans said.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hst
from test_exchange_plan import _chunk, _grid, problems

from shardwise._comm import buffers
from shardwise._layout.plan import MAX_ROUNDS, TransferPlan, plan, slab_plans
from shardwise._layout.redistribute import box, executed_slabs, redistribute
from shardwise._vocab.metadata import ShardedTensorMetadata
from shardwise._vocab.shard import Shard


@dataclass
class _Round:
    """What one rank's all-to-all of one round was handed and gave back."""

    packed: int  # bytes copied into a send buffer (0: sent from a view of a source)
    received: int  # bytes received
    out_given: bool  # received straight into a view of a target
    recv: torch.Tensor  # the receive buffer (the target's view when out_given)


@dataclass
class _Rank:
    """One simulated rank's record: its source tensors, its rounds and its allocations (bytes)."""

    sources: list[torch.Tensor]
    rounds: list[_Round] = field(default_factory=list)
    allocated: int = 0


class _Wire:
    """The all-to-all between the threads that play the ranks."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=30)
        self.posted: list[tuple[torch.Tensor, list[int]]] = [(torch.empty(0), [])] * world


class _FakeGroup:
    """The parts of ``Group`` that ``redistribute`` uses, over :class:`_Wire`."""

    def __init__(self, wire: _Wire, rank: int, record: _Rank) -> None:
        self.wire, self.rank, self.size, self.global_rank = wire, rank, wire.world, rank
        self.device = torch.device("cpu")
        self.record = record

    def global_to_group(self) -> None:
        return None  # global and group ranks are the same numbers

    def unverified(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def reject(self, exc: Exception) -> None:
        raise exc

    def all_to_all_single(
        self,
        send: torch.Tensor,
        *,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
        out: Optional[torch.Tensor],
        async_op: bool = False,
    ) -> Any:
        storages = {t.untyped_storage().data_ptr() for t in self.record.sources if t.numel()}
        from_view = send.numel() > 0 and send.untyped_storage().data_ptr() in storages
        self.wire.posted[self.rank] = (send, list(input_split_sizes))
        self.wire.barrier.wait()
        # The receive buffer comes from the same allocator the real backends use.
        recv = out if out is not None else buffers.empty((sum(output_split_sizes),), torch.uint8)
        pos = 0
        for peer in range(self.wire.world):
            sent, splits = self.wire.posted[peer]
            start = sum(splits[: self.rank])
            n = splits[self.rank]
            recv[pos : pos + n].copy_(sent[start : start + n])
            pos += n
        self.wire.barrier.wait()  # nobody posts the next round before every rank has read this one
        # ``send`` and ``recv`` are bytes (the executor sends the wire dtype's bytes).
        self.record.rounds.append(_Round(0 if from_view else send.numel(), sum(output_split_sizes), out is not None, recv))
        return _Done(recv) if async_op else recv


class _Done:
    """The handle of an ``async_op=True`` call that has already finished (this wire moves data at once)."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value

    def wait(self) -> torch.Tensor:
        return self.value


def _run_ranks(
    src: ShardedTensorMetadata,
    dst: ShardedTensorMetadata,
    rounds: int,
    dense: torch.Tensor,
    plans: list[TransferPlan],
    reuse: bool,
) -> tuple[list[_Rank], list[list[Shard]]]:
    """``redistribute`` on every rank (a thread each); each rank's record and new shards.

    With ``reuse`` each rank hands ``redistribute`` its plan (as ``reshard`` does) instead of letting it plan.
    """
    world = len(plans)
    wire = _Wire(world)
    records: list[_Rank] = []
    shards: list[list[Shard]] = []
    for r in range(world):
        mine = [
            Shard(box(dense, s.shard_offsets, s.shard_sizes).clone(), s)
            for s in src.shards_metadata
            if s.rank == r
        ]
        records.append(_Rank([s.tensor for s in mine]))
        shards.append(mine)
    results: list[Optional[list[Shard]]] = [None] * world
    errors: list[BaseException] = []
    real = buffers.empty
    of_thread: dict[int, _Rank] = {}

    def counted(shape: Any, dtype: torch.dtype, device: Optional[torch.device] = None) -> torch.Tensor:
        out = real(shape, dtype, device)
        record = of_thread.get(threading.get_ident())
        if record is not None:
            record.allocated += out.numel() * out.element_size()
        return out

    def play(r: int) -> None:
        of_thread[threading.get_ident()] = records[r]
        try:
            group: Any = _FakeGroup(wire, r, records[r])
            planned = plans[r] if reuse else None
            results[r] = redistribute(shards[r], src, dst, group, trusted=True, rounds=rounds, planned=planned)
        except BaseException as exc:  # re-raised below, in the test's thread
            errors.append(exc)
            wire.barrier.abort()

    buffers.empty = counted  # type: ignore[assignment]
    try:
        threads = [threading.Thread(target=play, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        buffers.empty = real  # type: ignore[assignment]
    if errors:
        raise errors[0]
    return records, [list(out or []) for out in results]


def _agree(
    src: ShardedTensorMetadata,
    dst: ShardedTensorMetadata,
    world: int,
    rounds: Optional[int],
    dense: torch.Tensor,
    reuse: bool = False,
) -> None:
    """Run every rank and compare what happened with each rank's plan (``rounds`` None: the ranks' own need)."""
    plans = [plan(src, dst, r, world) for r in range(world)]
    agreed = max(p.rounds for p in plans) if rounds is None else rounds
    records, results = _run_ranks(src, dst, agreed, dense, plans, reuse)
    itemsize = dense.element_size()
    for r, (pl, record, shards) in enumerate(zip(plans, records, results, strict=True)):
        for shard in shards:
            md = shard.metadata
            assert torch.equal(shard.tensor, box(dense, md.shard_offsets, md.shard_sizes)), (r, md.describe())
        # Every rank runs every round's collective, or (nothing on any wire) none.
        parts = executed_slabs(pl, agreed) if pl.needs_wire else ()
        assert len(record.rounds) == len(parts)
        kept = {s.tensor.untyped_storage().data_ptr() for s in shards}
        for part, done in zip(parts, record.rounds, strict=True):
            # Packing: the executor copied into a send buffer exactly what the plan said it would.
            assert done.packed == part.packed_numel * itemsize, (r, part.send_view)
            # Unpacking: received into a view, or into a buffer that became the target, exactly as decided.
            adopted = not done.out_given and done.recv.untyped_storage().data_ptr() in kept and done.received > 0
            assert adopted == (part.recv_whole is not None), (r, part.recv_whole)
            unpacked = 0 if done.out_given or adopted else done.received
            assert unpacked == part.unpacked_numel * itemsize, (r, part.recv_view)
        # Memory: beyond the new shards, the rank allocated exactly the buffers the bound counts.
        own = sum(md.numel() for md in dst.shards_metadata if md.rank == r) * itemsize
        assert record.allocated - own == sum(part.buffer_numel for part in parts) * itemsize, r


@settings(max_examples=150, deadline=None)
@given(problems(), hst.sampled_from([None, 1, 2, 3, 8]), hst.booleans())
def test_random_layouts_execute_as_planned(
    problem: tuple[ShardedTensorMetadata, ShardedTensorMetadata, int], rounds: Optional[int], reuse: bool
) -> None:
    src, dst, world = problem
    size = tuple(src.size)
    dense = torch.arange(1, 1 + torch.Size(size).numel(), dtype=torch.float64).reshape(size)
    _agree(src, dst, world, rounds, dense, reuse)


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("direction", ["rows_to_cols", "cols_to_rows", "scatter", "gather"])
def test_chunk_layouts_execute_as_planned(world: int, direction: str) -> None:
    size = [16, 12]
    rows, cols = _chunk(size, 0, list(range(world))), _chunk(size, 1, list(range(world)))
    whole = _grid(size, [[], []], [0], [])
    src, dst = {
        "rows_to_cols": (rows, cols), "cols_to_rows": (cols, rows), "scatter": (whole, rows), "gather": (rows, whole)
    }[direction]
    dense = torch.arange(192, dtype=torch.float64).reshape(size)
    _agree(src, dst, world, None, dense, reuse=world > 2)


def test_the_bound_reads_the_decisions() -> None:
    # dim 0 -> dim 1 on 4 ranks: every rank packs 3/4 of its shard; the end ranks receive theirs back to back,
    # the middle ones with a gap for their own block, so they also unpack 3/4 of a shard: over the budget of one
    # shard, so they ask for 2 rounds, in which each slab's buffers fit.
    rows, cols = _chunk([8, 8], 0, [0, 1, 2, 3]), _chunk([8, 8], 1, [0, 1, 2, 3])
    plans = [plan(rows, cols, r, 4) for r in range(4)]
    assert [p.buffer_numel for p in plans] == [12, 24, 24, 12]
    assert [(p.packed_numel, p.unpacked_numel) for p in plans] == [(12, 0), (12, 12), (12, 12), (12, 0)]
    assert [p.rounds for p in plans] == [1, 2, 2, 1]
    assert all(part.buffer_numel <= 16 for p in plans for part in slab_plans(p, 2))
    # Slabs are single rounds and never adopt a buffer as a target.
    assert all(part.rounds == 1 and part.recv_whole is None for p in plans for part in slab_plans(p, 4))
    assert all(1 <= p.rounds <= MAX_ROUNDS for p in plans)


def test_plans_are_frozen() -> None:
    rows = _chunk([4, 2], 0, [0, 1])
    pl: TransferPlan = plan(rows, rows, 0, 2)
    with pytest.raises(AttributeError):
        pl.rounds = 2  # type: ignore[misc]
