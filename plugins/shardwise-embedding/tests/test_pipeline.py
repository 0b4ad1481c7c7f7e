"""SparseDistPipeline and ShardedEmbeddingBagCollection.prefetch against the blocking loop.

Each rank trains the same sharded collection twice from the same weights,
once with the plain loop and once through the pipeline (with and without a
loader thread): the losses and the weights must be bit-for-bit the same.
Misuse (forwarding another batch than the prefetched one, prefetching twice,
a step that skips the collection) raises on every rank, a bad batch raises
when its exchange starts (the real error on the rank at fault, PeerError on
the others), ranks that run out of batches at different steps raise
ValueError on every rank instead of waiting, and the group goes on working
after each.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import pytest
import torch
from collection_helpers import batch, dense_collection, every_type_plan, every_type_tables, probe
from emb_helpers import battery, battery_results
from shardwise_embedding import RowSparseAdagrad, SparseDistPipeline, shard_collection
from shardwise_embedding._jagged import KeyedJaggedTensor

import shardwise

STEPS = 4


def _batches(tables: Any, seed: str, sizes: list[int], rank: int, width: int) -> Iterator[tuple[Any, torch.Tensor]]:
    for step in range(STEPS):
        yield batch(tables, sizes[rank], seed, rank, step, weighted=True), probe(width, sizes[rank], seed, rank, step)


def _train(pipelined: bool, load_ahead: bool = True) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train STEPS steps; every rank's losses (all-reduced) and its blocks' final weights."""
    group = shardwise.get_default_group()
    tables = every_type_tables("sum")
    sharded = shard_collection(dense_collection(tables), every_type_plan(tables, group.size))
    optimizer = RowSparseAdagrad(sharded.parameters(), lr=0.1)
    width = sum(t.embedding_dim * len(t.feature_names) for t in tables)
    sizes = [3 + r for r in range(group.size)]
    made = [0]

    def counted() -> Iterator[tuple[Any, torch.Tensor]]:
        for item in _batches(tables, "pipe", sizes, group.rank, width):
            made[0] += 1
            yield item

    batches: Any = counted()
    if pipelined:
        batches = SparseDistPipeline(sharded, batches, features=lambda b: b[0], load_ahead=load_ahead)
    losses = []
    for step, (kjt, weights) in enumerate(batches):
        # The current batch and at most one more have been made (the loader thread's may still be running).
        assert made[0] <= step + 2, (step, made[0])
        loss = (sharded(kjt).values() * weights).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(group.all_reduce(loss.detach().reshape(1))))
    return losses, {n: p.detach().clone() for n, p in sharded.named_parameters()}


def _same_as_blocking() -> None:
    losses, weights = _train(pipelined=False)
    for load_ahead in (True, False):
        piped_losses, piped_weights = _train(pipelined=True, load_ahead=load_ahead)
        assert piped_losses == losses, (load_ahead, piped_losses, losses)  # bit-for-bit, not approximately
        assert sorted(piped_weights) == sorted(weights)
        for name, w in weights.items():
            assert torch.equal(piped_weights[name], w), name


def _train_under_ddp(pipelined: bool) -> tuple[list[float], torch.Tensor]:
    """STEPS steps of a dense layer under DDP on torch's default process group, after the collection."""
    group = shardwise.get_default_group()
    tables = every_type_tables("sum")
    sharded = shard_collection(dense_collection(tables), every_type_plan(tables, group.size))
    width = sum(t.embedding_dim * len(t.feature_names) for t in tables)
    dense = torch.nn.Linear(width, 2, dtype=torch.float64)
    with torch.no_grad():
        dense.weight.copy_(torch.linspace(-1, 1, 2 * width, dtype=torch.float64).reshape(2, width))
        dense.bias.zero_()
    # DDP's default process group is dist.group.WORLD, the default group's own: its all-reduces run while
    # the next batch's exchange is in flight.
    ddp = torch.nn.parallel.DistributedDataParallel(dense)
    optimizers = [RowSparseAdagrad(sharded.parameters(), lr=0.1), torch.optim.SGD(ddp.parameters(), lr=0.1)]
    sizes = [3 + r for r in range(group.size)]
    batches: Any = _batches(tables, "ddp", sizes, group.rank, width)
    if pipelined:
        batches = SparseDistPipeline(sharded, batches, features=lambda b: b[0])
    losses = []
    for kjt, weights in batches:
        loss = ddp(sharded(kjt).values() * weights).square().sum()
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
        losses.append(float(group.all_reduce(loss.detach().reshape(1))))
    return losses, dense.weight.detach().clone()


def _under_ddp_on_the_default_process_group() -> None:
    losses, weight = _train_under_ddp(pipelined=False)
    piped_losses, piped_weight = _train_under_ddp(pipelined=True)
    assert piped_losses == losses, (piped_losses, losses)
    assert torch.equal(piped_weight, weight)


def _setup() -> tuple[Any, Any, Any]:
    group = shardwise.get_default_group()
    tables = every_type_tables("sum")
    sharded = shard_collection(dense_collection(tables), every_type_plan(tables, group.size))
    return group, tables, sharded


def _expect(fn: Callable[[], Any], error: type, match: str, at_fault: bool = True) -> None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - checked below
        expected = error.__name__ if at_fault else "PeerError"
        assert type(exc).__name__ == expected, f"{type(exc).__name__}: {exc}"
        if at_fault:
            assert match in str(exc), str(exc)
    else:
        raise AssertionError(f"no {error.__name__} raised")


def _good_step(sharded: Any, tables: Any) -> None:
    group = shardwise.get_default_group()
    out = sharded(batch(tables, 2, "good", group.rank))
    assert out.values().shape[0] == 2


def _forward_another_batch() -> None:
    group, tables, sharded = _setup()
    first, other = batch(tables, 2, "a", group.rank), batch(tables, 2, "b", group.rank)
    sharded.prefetch(first)
    _expect(lambda: sharded(other), ValueError, "forward that batch")
    _expect(lambda: sharded.prefetch(other), ValueError, "before prefetching another")
    sharded(first)  # the prefetched batch is still there, and forwards
    _good_step(sharded, tables)


def _step_skips_the_collection() -> None:
    group, tables, sharded = _setup()
    batches = [batch(tables, 2, "skip", group.rank, s) for s in range(3)]
    seen = 0

    def loop() -> None:
        nonlocal seen
        for kjt in SparseDistPipeline(sharded, batches, features=lambda b: b):
            seen += 1
            if seen == 1:
                sharded(kjt)
            # the second step forgets to call the collection

    _expect(loop, RuntimeError, "called the collection 0 times")
    assert seen == 2
    _good_step(sharded, tables)  # the pipeline dropped its prefetched batch when it stopped


def _stop_early_and_empty() -> None:
    group, tables, sharded = _setup()
    batches = [batch(tables, 2, "stop", group.rank, s) for s in range(4)]
    for kjt in SparseDistPipeline(sharded, batches, features=lambda b: b):
        sharded(kjt)
        break
    _good_step(sharded, tables)
    assert list(SparseDistPipeline(sharded, [], features=lambda b: b)) == []
    seen = []
    for kjt in SparseDistPipeline(sharded, batches[:1], features=lambda b: b, load_ahead=False):
        sharded(kjt)
        seen.append(kjt)
    assert len(seen) == 1 and seen[0] is batches[0]
    _good_step(sharded, tables)


def _bad_batch_ahead() -> None:
    """Rank 0's third batch has an id past its table: every rank raises during step 2's forward."""
    group, tables, sharded = _setup()
    batches = [batch(tables, 2, "bad", group.rank, s) for s in range(4)]
    if group.rank == 0:
        bad = batches[2]
        values = bad.values().clone()
        values[0] = 10**6
        batches[2] = KeyedJaggedTensor.from_lengths_sync(bad.keys(), values, bad.lengths())
    steps = 0

    def loop() -> None:
        nonlocal steps
        for kjt in SparseDistPipeline(sharded, batches, features=lambda b: b):
            steps += 1
            sharded(kjt)

    _expect(loop, IndexError, "out of table", at_fault=group.rank == 0 or group.size == 1)
    assert steps == 2, steps  # step 2's forward started the third batch's exchange, which failed
    _good_step(sharded, tables)


def _uneven_batches() -> None:
    """Ranks that run out of batches at different steps all raise ValueError at once, then go on working."""
    group, tables, sharded = _setup()
    uneven = group.size > 1
    # Without verification too: the ranks that ran out join their peers' exchange itself, not a handshake.
    cases = [(v, c) for v in (True, False) for c in ([3] * (group.size - 1) + [2], [0] + [2] * (group.size - 1))]
    before = group.verify
    for verify, counts in cases:
        group.verify = verify
        mine = counts[group.rank] if uneven else 2
        batches = [batch(tables, 2, "uneven", group.rank, s) for s in range(mine)]
        steps = 0

        def loop(batches: list[Any] = batches) -> None:
            nonlocal steps
            for kjt in SparseDistPipeline(sharded, batches, features=lambda b: b):
                steps += 1
                sharded(kjt)

        if not uneven:
            loop()
            assert steps == 2
            continue
        _expect(loop, ValueError, "ran out of batches at different steps")
        # The ranks with more batches raise in the forward of the one their peers lacked; the others after their last.
        assert steps == min(counts) + (mine > min(counts)), (counts, steps)
        _good_step(sharded, tables)
    group.verify = before


def _cases() -> dict[str, Callable[[], None]]:
    return {
        "pipelined_losses_and_weights_bit_identical": _same_as_blocking,
        "under_ddp_on_the_default_process_group": _under_ddp_on_the_default_process_group,
        "forward_another_batch_or_prefetch_twice": _forward_another_batch,
        "a_step_that_skips_the_collection": _step_skips_the_collection,
        "stopped_early_or_empty": _stop_early_and_empty,
        "a_bad_batch_raises_when_its_exchange_starts": _bad_batch_ahead,
        "ranks_that_run_out_at_different_steps_raise": _uneven_batches,
    }


def _battery_rank(results_dir: str, only: tuple[str, ...]) -> dict[str, str]:
    return battery(_cases(), results_dir, only)


@pytest.mark.parametrize("world_size", (1, 3))
@pytest.mark.parametrize("case", tuple(_cases()))
def test_pipeline(world_size: int, case: str) -> None:
    results = battery_results(_battery_rank, world_size, tuple(_cases()))
    for rank, seen in enumerate(results):
        assert seen.get(case) == "ok", f"rank {rank}: {seen.get(case)}"


def test_pipeline_needs_a_sharded_collection() -> None:
    with pytest.raises(TypeError, match="shard the collection first"):
        SparseDistPipeline(dense_collection(every_type_tables()), [], features=lambda b: b)  # type: ignore[arg-type]
