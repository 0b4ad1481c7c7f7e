"""SparseDistPipeline and ShardedEmbeddingBagCollection.prefetch against the blocking loop.

Each rank trains the same sharded collection twice from the same weights,
once with the plain loop and once through the pipeline (with and without a
loader thread): the losses and the weights must be bit-for-bit the same.
Misuse (prefetching twice, a step that passes the collection other objects
than its batch's features, a batch changed after its exchange started, a
step skipped on one rank only) raises on every rank; a bad next batch or a
loader that raises fails on every rank together (the real error on the rank
at fault, PeerError on the others) once the current step has finished;
ranks that run out of batches at different steps raise ValueError on every
rank instead of waiting; and the group goes on working after each. What the
blocking loop allows works the same through the pipeline, with the same
numbers: forwarding another batch while one is prefetched, activation
checkpointing's second forward, a step skipped on every rank, a call by
keyword.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Optional

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


class _Loop:
    """A pipeline loop over ``batches`` (their own features) running ``body(step, kjt)``; call it to run it.

    ``steps`` counts the loop bodies entered (from 1).
    """

    def __init__(self, sharded: Any, batches: Iterable[Any], body: Callable[[int, Any], None]) -> None:
        self.sharded, self.batches, self.body, self.steps = sharded, batches, body, 0

    def __call__(self) -> None:
        for kjt in SparseDistPipeline(self.sharded, self.batches, features=lambda b: b):
            self.steps += 1
            self.body(self.steps, kjt)


def _good_step(sharded: Any, tables: Any) -> None:
    group = shardwise.get_default_group()
    out = sharded(batch(tables, 2, "good", group.rank))
    assert out.values().shape[0] == 2


def _forward_another_batch() -> None:
    """Another batch forwarded while one waits prefetched exchanges its own ids; prefetching twice raises."""
    group, tables, sharded = _setup()
    first, other = batch(tables, 2, "a", group.rank), batch(tables, 2, "b", group.rank)
    expected_other, expected_first = sharded(other).values(), sharded(first).values()
    sharded.prefetch(first)
    assert torch.equal(sharded(other).values(), expected_other)
    _expect(lambda: sharded.prefetch(other), ValueError, "before prefetching another")
    assert torch.equal(sharded(first).values(), expected_first)  # the prefetched batch waited, and forwards
    _good_step(sharded, tables)


def _losses(
    sharded: Any, batches: Iterable[Any], step_fn: Optional[Callable[[Any, Any], Optional[torch.Tensor]]] = None
) -> list[float]:
    """Train on ``batches`` (``(kjt, weights)`` pairs); the all-reduced loss of each step that returned one."""
    group = shardwise.get_default_group()
    optimizer = RowSparseAdagrad(sharded.parameters(), lr=0.1)

    def plain(kjt: Any, weights: Any) -> torch.Tensor:
        out: torch.Tensor = (sharded(kjt).values() * weights).sum()
        return out

    losses = []
    for kjt, weights in batches:
        loss = (step_fn or plain)(kjt, weights)
        if loss is None:
            continue
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(group.all_reduce(loss.detach().reshape(1))))
    return losses


def _pairs(tables: Any, seed: str, steps: int = STEPS) -> list[tuple[Any, torch.Tensor]]:
    group = shardwise.get_default_group()
    width = sum(t.embedding_dim * len(t.feature_names) for t in tables)
    return [
        (batch(tables, 3, seed, group.rank, s, weighted=True), probe(width, 3, seed, group.rank, s))
        for s in range(steps)
    ]


def _skipped_on_every_rank() -> None:
    """Every rank skips step 1: the pipeline goes on with step 2, with the blocking loop's numbers."""
    group, tables, _ = _setup()
    pairs = _pairs(tables, "skip")
    expected = _losses(_setup()[2], [p for s, p in enumerate(pairs) if s != 1])
    for load_ahead in (True, False):
        sharded = _setup()[2]
        seen = [0]

        def step(kjt: Any, weights: Any, seen: list[int] = seen, sharded: Any = sharded) -> Optional[torch.Tensor]:
            seen[0] += 1
            if seen[0] == 2:
                return None
            out: torch.Tensor = (sharded(kjt).values() * weights).sum()
            return out

        piped = SparseDistPipeline(sharded, pairs, features=lambda b: b[0], load_ahead=load_ahead)
        assert _losses(sharded, piped, step) == expected
        assert seen[0] == STEPS
        _good_step(sharded, tables)


def _skipped_on_one_rank() -> None:
    """Rank 0 skips step 1 while the others forward it: every rank raises, and the group goes on working."""
    group, tables, sharded = _setup()
    batches = [batch(tables, 2, "skip1", group.rank, s) for s in range(3)]

    def body(step: int, kjt: Any) -> None:
        if step != 2 or group.rank != 0:
            sharded(kjt)

    loop = _Loop(sharded, batches, body)
    if group.size == 1:
        loop()  # a rank alone that skips a step skips it on every rank
        assert loop.steps == 3
    else:
        try:
            loop()
        except Exception as exc:  # noqa: BLE001 - which error depends on the rank; both are the mismatch
            assert type(exc).__name__ == "CollectiveMismatchError", f"{type(exc).__name__}: {exc}"
        else:
            raise AssertionError("no error")
        assert loop.steps == 2
    _good_step(sharded, tables)


def _other_objects_than_the_features() -> None:
    """A step that passes the collection a copy of its batch's features raises on every rank, at once."""
    group, tables, sharded = _setup()
    batches = [batch(tables, 2, "other", group.rank, s) for s in range(3)]
    # Each step passes a new KeyedJaggedTensor with the same bags.
    loop = _Loop(sharded, batches, lambda step, kjt: sharded(kjt.select(kjt.keys())))
    _expect(loop, ValueError, "never with its batch's features")
    assert loop.steps == 1
    _good_step(sharded, tables)


def _modified_in_the_loop_body() -> None:
    """Rank 0 changes its batch's ids in place before the model runs: it raises ValueError, its peers PeerError."""
    group, tables, sharded = _setup()
    batches = [batch(tables, 2, "inplace", group.rank, s) for s in range(3)]

    def body(step: int, kjt: Any) -> None:
        if step == 2 and group.rank == 0:
            kjt.values().remainder_(2)  # a remapping of the ids, after they were sent
        sharded(kjt)

    loop = _Loop(sharded, batches, body)
    _expect(loop, ValueError, "modified in place after prefetch", at_fault=group.rank == 0)
    assert loop.steps == 2
    _good_step(sharded, tables)


def _loader_refills_one_buffer() -> None:
    """A loader yielding one batch refilled in place: ValueError on every rank, never a half-changed batch."""
    group, tables, sharded = _setup()
    fills = [batch(tables, 2, "refill", group.rank, s) for s in range(3)]
    buffer = torch.empty(max(f.values().numel() for f in fills), dtype=fills[0].values().dtype)

    def refilled() -> Iterator[Any]:
        for fill in fills:
            ids = buffer[: fill.values().numel()]
            ids.copy_(fill.values())
            yield KeyedJaggedTensor.from_lengths_sync(fill.keys(), ids, fill.lengths())

    loop = _Loop(sharded, refilled(), lambda step, kjt: sharded(kjt))
    # The loader thread refills the buffer during the step, before or after the model's forward: either
    # the forward or the start of the next exchange sees it. Which rank sees it first is a race, so a rank
    # raises ValueError (it saw it) or PeerError (a peer saw it first and told it).
    try:
        loop()
    except Exception as exc:  # noqa: BLE001 - checked below
        assert type(exc).__name__ in ("ValueError", "PeerError"), f"{type(exc).__name__}: {exc}"
        assert "modified in place after prefetch" in str(exc), str(exc)
    else:
        raise AssertionError("no error")
    _good_step(sharded, tables)


def _loader_raises_on_one_rank() -> None:
    """Rank 0's loader raises making its third batch: step 2 still trains everywhere, then every rank raises."""
    group, tables, sharded = _setup()
    batches = [batch(tables, 2, "loader", group.rank, s) for s in range(4)]
    trained = [0]

    def loader() -> Iterator[Any]:
        for s, b in enumerate(batches):
            if s == 2 and group.rank == 0:
                raise OSError("the shard of the dataset is unreadable")
            yield b

    def body(step: int, kjt: Any) -> None:
        sharded(kjt).values().sum().backward()
        trained[0] += 1

    _expect(_Loop(sharded, loader(), body), OSError, "unreadable", at_fault=group.rank == 0 or group.size == 1)
    assert trained[0] == 2, trained  # the step whose forward started the failed exchange finished
    _good_step(sharded, tables)


def _checkpointed_and_by_keyword() -> None:
    """Activation checkpointing (a second forward in backward) and a call by keyword: the blocking numbers."""
    from torch.utils.checkpoint import checkpoint  # only this case uses it

    group, tables, _ = _setup()
    pairs = _pairs(tables, "ckpt")

    def checkpointed(sharded: Any) -> Callable[[Any, Any], torch.Tensor]:
        def step(kjt: Any, weights: Any) -> torch.Tensor:
            def run(kjt: Any) -> torch.Tensor:
                out: torch.Tensor = sharded(features=kjt).values()
                return out

            values = checkpoint(run, kjt, use_reentrant=False)
            return (values * weights).sum()

        return step

    expected = _losses(_setup()[2], pairs)
    blocking = _setup()[2]
    assert _losses(blocking, pairs, checkpointed(blocking)) == expected
    for load_ahead in (True, False):
        sharded = _setup()[2]
        piped = SparseDistPipeline(sharded, pairs, features=lambda b: b[0], load_ahead=load_ahead)
        assert _losses(sharded, piped, checkpointed(sharded)) == expected
        _good_step(sharded, tables)


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
    """Rank 0's third batch has an id past its table: every rank raises once step 2 has finished."""
    group, tables, sharded = _setup()
    batches = [batch(tables, 2, "bad", group.rank, s) for s in range(4)]
    if group.rank == 0:
        bad = batches[2]
        values = bad.values().clone()
        values[0] = 10**6
        batches[2] = KeyedJaggedTensor.from_lengths_sync(bad.keys(), values, bad.lengths())
    trained = [0]

    def body(step: int, kjt: Any) -> None:
        sharded(kjt).values().sum().backward()
        trained[0] += 1

    _expect(_Loop(sharded, batches, body), IndexError, "out of table", at_fault=group.rank == 0 or group.size == 1)
    assert trained[0] == 2, trained  # step 2's forward started the third batch's exchange, which failed; it finished
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
        "a_step_skipped_on_every_rank": _skipped_on_every_rank,
        "a_step_skipped_on_one_rank_raises": _skipped_on_one_rank,
        "a_step_passing_other_objects_raises": _other_objects_than_the_features,
        "a_batch_modified_in_the_loop_body_raises": _modified_in_the_loop_body,
        "a_loader_refilling_one_buffer_raises": _loader_refills_one_buffer,
        "a_loader_raising_on_one_rank_raises_on_every_rank": _loader_raises_on_one_rank,
        "activation_checkpointing_and_a_call_by_keyword": _checkpointed_and_by_keyword,
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
