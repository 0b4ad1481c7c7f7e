"""Collectives with ``async_op=True``: the Work handle, the worker thread, and the same checks as blocking calls.

The multi-rank tests run over the test gloo backend, or over MPI with
``SHARDWISE_TEST_BACKEND=mpi`` (tox env ``mpi``); the in-process ones use a
one-rank group whose primitives the test controls.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardwise
import shardwise.nn.functional as F
from shardwise import Work
from shardwise.errors import CollectiveMismatchError

from rank_helpers import TEST_BACKEND, check_errors, outcome
from rank_helpers import run as _run

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


# -- helpers ----------------------------------------------------------------------


def _same(actual: Any, expected: Any) -> None:
    """Equal results: tensors by dtype, shape and value; lists element-wise; None."""
    if expected is None or isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected), (actual, expected)
        for a, e in zip(actual or (), expected or (), strict=True):
            _same(a, e)
        return
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (actual, expected)
    assert torch.equal(actual, expected), (actual, expected)


def _values(seed: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    base = (torch.arange(n, dtype=torch.int64) * 7 + seed * 13) % 101
    return (base % 2 == 1).reshape(shape) if dtype == torch.bool else base.to(dtype).reshape(shape)


# -- every collective: async == blocking -----------------------------------------------


def _collectives(g: Any, case: dict[str, Any], c: int) -> dict[str, Callable[[bool], Any]]:
    """Per collective, a call with this case's arguments; ``call(async_op)``. Fresh inputs each call."""
    r, w = g.rank, g.size
    dtype, trailing, rows, splits = DTYPES[case["dtype"]], case["trailing"], case["rows"], case["splits"]
    op = "max" if dtype == torch.bool else "sum"

    def t(seed: int, n: int) -> torch.Tensor:
        return _values(seed, (n, *trailing), dtype)

    def a2a_single(async_op: bool, outs: bool, into: bool) -> Any:
        data = torch.cat([t(100 * c + 10 * r + s, splits[r][s]) for s in range(w)])
        out_rows = [splits[s][r] for s in range(w)]
        out = torch.zeros((sum(out_rows), *trailing), dtype=dtype) if into else None
        return g.all_to_all_single(data, out_rows if outs else None, splits[r], out=out, async_op=async_op)

    return {
        "barrier": lambda a: g.barrier(async_op=a),
        "broadcast": lambda a: g.broadcast(t(c + r, rows[0]), src=w - 1, async_op=a),
        "all_reduce": lambda a: g.all_reduce(t(c + r, rows[0]), op, async_op=a),
        "all_gather": lambda a: g.all_gather(t(c + r, rows[r]), async_op=a),
        "all_gather_out": lambda a: g.all_gather(
            t(c + r, rows[0]), out=torch.zeros((w * rows[0], *trailing), dtype=dtype), async_op=a
        ),
        "reduce_scatter": lambda a: g.reduce_scatter([t(c + r + s, rows[s]) for s in range(w)], op, async_op=a),
        "all_to_all": lambda a: g.all_to_all([t(c + 10 * r + s, splits[r][s]) for s in range(w)], async_op=a),
        "all_to_all_single": lambda a: a2a_single(a, outs=False, into=False),
        "all_to_all_single_sizes": lambda a: a2a_single(a, outs=True, into=False),
        "all_to_all_single_out": lambda a: a2a_single(a, outs=True, into=True),
        "scatter": lambda a: g.scatter([t(c + s, rows[s]) for s in range(w)] if r == 0 else None, 0, async_op=a),
        "gather": lambda a: g.gather(t(c + r, rows[r]), dst=w - 1, async_op=a),
    }


def async_equals_blocking(cases_by_size: list[list[dict[str, Any]]], verify: bool) -> str:
    """On groups of 1, 2, ... ranks (sub-groups of the world): every collective's async result is the blocking one."""
    world = shardwise.get_default_group()
    for size, cases in enumerate(cases_by_size, start=1):
        g = world if size == world.size else world.new_group(list(range(size)))
        if g is None:
            continue
        g.verify = verify
        works: list[tuple[str, Work[Any]]] = []
        expected: dict[str, Any] = {}
        for c, case in enumerate(cases):
            for name, call in _collectives(g, case, c).items():
                # Several in flight at once, a blocking call between each (it waits for them).
                works.append((f"{c}:{name}", call(True)))
                expected[f"{c}:{name}"] = call(False)
        for key, work in reversed(works):
            _same(work.wait(), expected[key])
            assert work.is_completed() and work.exception() is None
        g.verify = True
        if g is not world:
            g.destroy()
    return "ok"


def _case(world: int) -> st.SearchStrategy[dict[str, Any]]:
    square = st.lists(st.integers(0, 2), min_size=world, max_size=world)
    return st.fixed_dictionaries(
        {
            "dtype": st.sampled_from(sorted(DTYPES)),
            "trailing": st.lists(st.integers(1, 3), max_size=2),
            "rows": st.lists(st.integers(0, 3), min_size=world, max_size=world),
            "splits": st.lists(square, min_size=world, max_size=world),
        }
    )


WORLD = 4


@settings(max_examples=1, deadline=None, database=None)
@given(data=st.data())
def test_async_equals_blocking(data: st.DataObject) -> None:
    # One launch of WORLD ranks covers groups of every size up to it (a launch costs seconds).
    cases_by_size = []
    for size in range(1, WORLD + 1):
        uneven = {
            "dtype": "float32",
            "trailing": [2],
            "rows": [(s + 1) % 3 for s in range(size)],
            "splits": [[(r + s) % 3 for s in range(size)] for r in range(size)],
        }
        cases_by_size.append([uneven, *data.draw(st.lists(_case(size), min_size=1, max_size=2))])
    verify = data.draw(st.booleans())
    assert _run(async_equals_blocking, WORLD, cases_by_size, verify) == ["ok"] * WORLD


# -- behaviour on real ranks ------------------------------------------------------


def behaviour(flag: str) -> dict[str, Any]:
    g = shardwise.get_default_group()
    r, w = g.rank, g.size
    seen: dict[str, Any] = {}

    # In flight together, with a blocking collective in between, waited in reverse order.
    first = g.all_reduce(torch.full((3,), float(r)), async_op=True)
    second = g.all_to_all_single(torch.arange(2.0 * w) + 10 * r, async_op=True)
    middle = g.all_gather(torch.tensor([r]))
    third = g.broadcast(torch.full((2,), float(r)), src=w - 1, async_op=True)
    _same(third.wait(), torch.full((2,), float(w - 1)))
    _same(second.wait(), torch.cat([torch.arange(2.0 * r, 2.0 * r + 2) + 10 * s for s in range(w)]))
    _same(first.wait(), torch.full((3,), float(sum(range(w)))))
    _same(middle, [torch.tensor([s]) for s in range(w)])
    assert first.wait() is first.wait()  # the same result on every call

    # is_completed() turns True without anyone calling wait().
    work = g.all_reduce(torch.ones(2), async_op=True)
    deadline = time.monotonic() + 60
    while not work.is_completed() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert work.is_completed()
    _same(work.wait(), torch.full((2,), float(w)))

    # Compute overlaps with an exchange in flight.
    tokens = torch.arange(4.0 * w).reshape(2 * w, 2) + 100 * r
    pending = g.all_to_all_single(tokens, async_op=True)
    product = torch.ones(64, 64) @ torch.ones(64, 64)
    _same(product, torch.full((64, 64), 64.0))
    _same(pending.wait(), torch.cat([torch.arange(4.0 * r, 4.0 * r + 4).reshape(2, 2) + 100 * s for s in range(w)]))

    # Bad input raises at the call (the real error on the faulty rank, PeerError on the others).
    culprit = w - 1
    seen["bad_tensor"] = outcome(lambda: g.all_reduce("x" if r == culprit else torch.ones(1), async_op=True))
    seen["bad_src"] = outcome(lambda: g.broadcast(torch.ones(1), src=w, async_op=True))
    seen["bad_splits"] = outcome(lambda: g.all_to_all_single(torch.ones(w), [1] * w if r else [2] * w, async_op=True))
    seen["bad_gather"] = outcome(
        lambda: g.all_gather(torch.ones(1, dtype=torch.int32 if r == culprit else torch.float32), async_op=True)
    )
    # ... and the group still works afterwards.
    _same(g.all_reduce(torch.ones(1), async_op=True).wait(), torch.full((1,), float(w)))

    # Work.wait(timeout) while its peers have not joined yet: rank 0 times out, then lets them in.
    if w > 1:
        g.verify = False
        if r == 0:
            late = g.all_reduce(torch.ones(1), async_op=True)
            seen["timeout"] = outcome(lambda: late.wait(timeout=0.05))
            assert not late.is_completed()
            Path(flag).touch()
            _same(late.wait(timeout=120), torch.full((1,), float(w)))
        else:
            deadline = time.monotonic() + 60
            while not os.path.exists(flag) and time.monotonic() < deadline:
                time.sleep(0.01)
            g.all_reduce(torch.ones(1))
        g.verify = True
    g.barrier()

    # nn.functional: async forms, connected to autograd at wait().
    x = (torch.arange(2.0 * w) + r).requires_grad_()
    y = F.all_to_all_single(torch.empty(2 * w), x, async_op=True).wait()
    z = F.all_reduce(x, async_op=True).wait()
    parts = F.all_gather(x, async_op=True).wait()
    (y.sum() + (z * 2).sum() + sum(p.sum() for p in parts)).backward()
    assert x.grad is not None
    # d/dx of sum(y): 1; of 2*sum(all_reduce): 2*w; of the gathered sum: w.
    _same(x.grad, torch.full((2 * w,), float(1 + 3 * w)))

    # destroy() with work still queued: it finishes first.
    last = g.all_reduce(torch.ones(4), async_op=True)
    worker = g._worker
    shardwise.destroy()
    _same(last.wait(), torch.full((4,), float(w)))
    assert worker is not None and not any(t.name == worker._name and t.is_alive() for t in threading.enumerate())
    return seen


def test_behaviour(tmp_path: Path) -> None:
    world = 3
    results = _run(behaviour, world, str(tmp_path / "flag"))
    check_errors(
        results,
        on_every_rank={
            "bad_src": ("ValueError", "src"),
            "bad_splits": (CollectiveMismatchError.__name__, ""),
            "bad_gather": (CollectiveMismatchError.__name__, "dtype"),
        },
        at_fault={"bad_tensor": (world - 1, "TypeError", "tensor")},
    )
    kind, message = results[0]["timeout"]
    assert kind == "TimeoutError" and "all_reduce" in message and "rank 0 of 3" in message, message


def threads_take_turns() -> dict[str, Any]:
    """Two threads of every rank call collectives on one group at once; then each on a group of its own."""
    g = shardwise.get_default_group()
    w = g.size
    steps = 30
    seen: dict[str, Any] = {}

    def race(groups: Sequence[Any]) -> tuple[list[Exception], list[list[float]]]:
        errors: list[Exception] = []
        sums: list[list[float]] = [[], []]
        start = threading.Barrier(2)

        def worker(k: int) -> None:
            start.wait()
            try:
                for i in range(steps):
                    t = torch.full((4,), 100.0**k)  # thread 0 sends 1, thread 1 sends 100
                    out = groups[k].all_reduce(t, async_op=True).wait() if i % 2 else groups[k].all_reduce(t)
                    sums[k].append(float(out[0]))
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a thread is still in a collective"
        return errors, sums

    for verify in (True, False):
        g.verify = verify
        # One group: the calls take turns (no deadlock, no error, no torn data); which thread's call meets
        # which peer's is the order they reached the group, so a sum mixes ones and hundreds.
        errors, sums = race([g, g])
        assert not errors, errors
        allowed = {float(k + 100 * (w - k)) for k in range(w + 1)}
        assert all(len(s) == steps and set(s) <= allowed for s in sums), sums
        g.barrier()
    g.verify = True
    # A group per thread (made in the same order on every rank): every sum is its own thread's.
    own = [g.new_group(list(range(w))), g.new_group(list(range(w)))]
    errors, sums = race(own)
    assert not errors, errors
    assert sums == [[float(w)] * steps, [100.0 * w] * steps], sums
    for sub in own:
        sub.destroy()
    # A destroyed group says so, whatever the backend and however it is called.
    shardwise.destroy()
    seen["blocking"] = outcome(lambda: g.all_reduce(torch.ones(1)))
    seen["async"] = outcome(lambda: g.all_reduce(torch.ones(1), async_op=True))
    g.verify = False
    seen["unverified"] = outcome(lambda: g.barrier())
    return seen


def test_threads_take_turns_on_a_group_and_a_destroyed_group_says_so() -> None:
    world = 2
    results = _run(threads_take_turns, world)
    check_errors(results, on_every_rank={k: ("LaunchError", "group was destroyed") for k in results[0]}, at_fault={})


def fails_alone() -> dict[str, Any]:
    """Rank 0 cannot allocate an all_gather's result after the ranks agreed to it; then what every rank sees."""
    from shardwise._comm import buffers

    g = shardwise.get_default_group()
    seen: dict[str, Any] = {}
    if g.rank == 0:
        real = buffers.empty_like

        def no_room(*args: Any, **kwargs: Any) -> Any:
            buffers.empty_like = real
            raise MemoryError("no room for the result")

        buffers.empty_like = no_room
    started = time.monotonic()
    seen["all_gather"] = outcome(lambda: g.all_gather(torch.full((g.rank + 1, 2), 1.0)))  # uneven: agreed sizes
    seen["next"] = outcome(lambda: g.all_reduce(torch.ones(1)))
    seen["destroy"] = outcome(shardwise.destroy)
    seen["seconds"] = time.monotonic() - started
    return seen


@pytest.mark.skipif(
    TEST_BACKEND == "mpi", reason="over MPI the peers wait in the call until the group's timeout, then abort the job"
)
def test_a_rank_whose_move_fails_alone_raises_at_once_and_its_peers_hear_it() -> None:
    results = _run(fails_alone, 2)
    first, peer = results
    assert first["all_gather"][0] == "MemoryError", first
    assert first["next"][0] == "PeerLostError" and "out of step" in first["next"][1], first
    assert first["destroy"][0] == "ok", first
    # The peer, still in the all_gather, hears the connection close when rank 0 lets go: no false PeerError.
    assert peer["all_gather"][0] == "PeerLostError" and peer["next"][0] == "PeerLostError", peer
    assert max(first["seconds"], peer["seconds"]) < 30, results


# -- in process: a one-rank group whose primitives the test controls ---------------------------


class _Local(shardwise.Group):
    """One rank; ``gate`` (when set) must be opened before a primitive moves data."""

    def __init__(self, verify: bool = True) -> None:
        super().__init__(backend="local", rank=0, size=1, device=torch.device("cpu"), verify=verify)
        self.gate: Optional[threading.Event] = None
        self.fail: Optional[Exception] = None
        self.order: list[str] = []
        self.async_error: Optional[Exception] = None
        self.destroyed = False
        self.started = threading.Event()  # set when a primitive begins on the worker

    def _move(self, what: str) -> None:
        if threading.current_thread() is not threading.main_thread():
            self.started.set()
            assert self.gate is None or self.gate.wait(30)
        self.order.append(what)
        if self.fail is not None:
            raise self.fail

    def _barrier(self) -> None:
        self._move("barrier")

    def _broadcast(self, buf: torch.Tensor, src: int) -> None:
        self._move("broadcast")

    def _all_reduce(self, buf: torch.Tensor, op: str) -> None:
        self._move("all_reduce")

    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor, counts: Sequence[int]) -> None:
        out.copy_(inp)

    def _reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, counts: Sequence[int], op: str) -> None:
        out.copy_(inp)

    def _all_to_all(self, out: torch.Tensor, oc: Sequence[int], inp: torch.Tensor, ic: Sequence[int]) -> None:
        out.copy_(inp)

    def _new_group(self, ranks: Sequence[int]) -> Optional[shardwise.Group]:
        return None

    def _check_async(self) -> None:
        if self.async_error is not None:
            raise self.async_error

    def destroy(self) -> None:
        self.destroyed = True


def test_work_runs_in_order_on_a_named_worker_and_reraises() -> None:
    g = _Local(verify=False)
    assert g._worker is None  # no thread until the first asynchronous collective
    g.gate = threading.Event()
    a = g.all_reduce(torch.ones(1), async_op=True)
    b = g.broadcast(torch.ones(1), async_op=True)
    assert not a.is_completed() and a.exception() is None and "pending" in repr(a)
    with pytest.raises(TimeoutError, match=r"rank 0 of 1 \(local\): asynchronous all_reduce did not finish within"):
        a.wait(timeout=0.01)
    with pytest.raises(ValueError, match="0 or more"):
        a.wait(timeout=-1)
    assert g._worker is not None and any(t.name == "shardwise-local-rank0-collectives" for t in threading.enumerate())
    g.gate.set()
    assert b.result() is not None and a.wait() is not None and g.order == ["all_reduce", "broadcast"]

    # A blocking collective waits for queued ones: it runs after them.
    g.gate = threading.Event()
    c = g.all_reduce(torch.ones(1), async_op=True)
    threading.Timer(0.05, g.gate.set).start()
    g.barrier()
    assert c.is_completed() and g.order[-2:] == ["all_reduce", "barrier"]

    # The collective's error, on every wait().
    g.fail = RuntimeError("link down")
    d = g.all_reduce(torch.ones(1), async_op=True)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="link down"):
            d.wait()
    assert isinstance(d.exception(), RuntimeError) and "failed" in repr(d)
    g.destroy()
    # Then every collective says the group is gone, before it checks or moves anything.
    for call in (g.barrier, lambda: g.all_reduce(torch.ones(1), async_op=True), lambda: g.agree(lambda: 1, op="x")):
        with pytest.raises(shardwise.errors.LaunchError, match="this local group was destroyed"):
            call()


def test_a_thread_waits_for_another_threads_collective_on_the_group() -> None:
    g = _Local(verify=False)
    g.gate = threading.Event()
    entered: list[str] = []
    move = g._move

    def recorded(what: str) -> None:
        entered.append(what)
        move(what)

    g._move = recorded  # type: ignore[method-assign]
    first = threading.Thread(target=g.barrier)  # blocking, held at the gate inside its primitive
    first.start()
    assert g.started.wait(30)
    second = threading.Thread(target=lambda: g.all_reduce(torch.ones(1)))
    second.start()
    second.join(0.2)
    assert second.is_alive() and entered == ["barrier"]  # waits for the call lock, not inside its primitive
    g.gate.set()
    first.join(30)
    second.join(30)
    assert entered == g.order == ["barrier", "all_reduce"]


def test_a_move_that_fails_on_this_rank_alone_puts_the_group_out_of_step() -> None:
    g = _Local()
    g.fail = MemoryError("no room for the result")
    with pytest.raises(MemoryError):
        g.all_reduce(torch.ones(1))
    g.fail = None
    # Every later call raises at once, naming the call that failed, and never reaches the primitives.
    moved = len(g.order)
    for call in (lambda: g.all_reduce(torch.ones(1)), lambda: g.barrier(async_op=True), lambda: g.agree(lambda: 1, op="x")):
        with pytest.raises(shardwise.errors.PeerLostError, match=r"out of step .* its all_reduce failed on this rank"):
            call()
    assert len(g.order) == moved
    g.destroy()  # releases this rank's side without a closing handshake
    assert g.destroyed

    # Queued behind the failing one, an asynchronous call fails without moving anything.
    g = _Local(verify=False)
    g.gate = threading.Event()
    g.fail = KeyboardInterrupt()
    first = g.all_reduce(torch.ones(1), async_op=True)
    second = g.broadcast(torch.ones(1), async_op=True)
    g.gate.set()
    with pytest.raises(KeyboardInterrupt):
        first.wait(30)
    with pytest.raises(shardwise.errors.PeerLostError, match="its all_reduce failed on this rank"):
        second.wait(30)
    assert g.order == ["all_reduce"]
    g.destroy_local()

    # An error every rank raised together (shardwise's own) keeps the ranks in step.
    g = _Local()
    g.fail = shardwise.errors.PeerError("a peer said no")
    with pytest.raises(shardwise.errors.PeerError):
        g.all_reduce(torch.ones(1))
    g.fail = None
    g.all_reduce(torch.ones(1))


def test_bad_input_raises_at_the_call() -> None:
    g = _Local()
    with pytest.raises(TypeError, match="avg"):
        g.all_reduce(torch.ones(1, dtype=torch.int64), op="avg", async_op=True)
    g.async_error = RuntimeError("no threads here")
    with pytest.raises(RuntimeError, match="no threads here"):
        g.all_gather(torch.ones(1), async_op=True)
    assert g._worker is None


def test_destroy_local_drops_queued_work_and_destroy_finishes_it() -> None:
    g = _Local(verify=False)
    g.gate = threading.Event()
    running = g.all_reduce(torch.ones(1), async_op=True)
    queued = g.broadcast(torch.ones(1), async_op=True)
    assert g.started.wait(30)  # the first is running, the second still queued
    g.destroy_local()
    assert g.destroyed
    with pytest.raises(RuntimeError, match="broadcast never ran: the group was destroyed"):
        queued.wait(timeout=30)
    g.gate.set()
    _same(running.wait(timeout=30), torch.ones(1))
    with pytest.raises(shardwise.errors.LaunchError, match="this local group was destroyed"):
        g.all_reduce(torch.ones(1), async_op=True)

    h = _Local(verify=False)
    h.gate = threading.Event()
    pending = h.all_reduce(torch.arange(3.0), async_op=True)
    threading.Timer(0.05, h.gate.set).start()
    h.destroy()
    assert pending.is_completed() and h.destroyed
    _same(pending.wait(), torch.arange(3.0))


def test_close_without_drain_joins_a_worker_with_nothing_running() -> None:
    # After its last job's Work is finished the worker still drops that job's references (the move's
    # tensors, whose deallocation releases the GIL). A group dropped without destroy() (a sub-group) is
    # closed at exit by its finalizer: left running, the daemon thread retakes the GIL during interpreter
    # finalization inside torch's tensor dealloc, and the process aborts ("terminate called without an
    # active exception"). close(drain=False) must join it when nothing is running.
    from shardwise._comm.work import Worker

    released = threading.Event()

    class SlowToFree:
        def __del__(self) -> None:
            time.sleep(0.2)
            released.set()

    def job(held: SlowToFree) -> Callable[[], int]:
        return lambda: 1 if held else 0

    worker = Worker("test-worker")
    work = worker.submit(Work("all_reduce", "here"), job(SlowToFree()), None)
    assert work.wait(30) == 1
    worker.close("the group was garbage-collected", drain=False)
    assert released.is_set()
    assert worker._thread is not None and not worker._thread.is_alive()


def test_new_group_runs_after_queued_work_with_verify_off() -> None:
    # Making a sub-group communicates on the group (MPI_Comm_split): never beside a collective on the worker.
    g = _Local(verify=False)
    g._new_group = lambda ranks: g.order.append("new_group")  # type: ignore[method-assign]
    g.gate = threading.Event()
    pending = g.all_reduce(torch.ones(1), async_op=True)
    assert g.started.wait(30)
    threading.Timer(0.05, g.gate.set).start()
    assert g.new_group([0]) is None
    assert pending.is_completed() and g.order == ["all_reduce", "new_group"]
    g.destroy()


def test_inference_mode_reaches_the_worker() -> None:
    # Inference mode is per thread, like grad mode: the worker writes into inference tensors under the caller's.
    g = _Local()
    g._all_reduce = lambda buf, op: buf.mul_(1)  # type: ignore[method-assign,assignment]  # writes like a real backend
    with torch.inference_mode():
        tensor = torch.arange(3.0)
        work = g.all_reduce(tensor, "avg", async_op=True)
        blocking = g.all_reduce(torch.arange(3.0), "avg")
    _same(work.wait(), blocking)
    assert tensor.is_inference()
    g.destroy()


def test_a_rank_outside_the_group_raises_at_an_asynchronous_call() -> None:
    from shardwise._comm.non_member import NON_MEMBER

    for async_op in (False, True):
        with pytest.raises(RuntimeError, match="not a member of the process group"):
            NON_MEMBER.all_reduce(torch.ones(1), async_op=async_op)
    assert NON_MEMBER._worker is None


def torch_on_world_beside_pending_async() -> dict[str, Any]:
    import torch.distributed as dist

    g = shardwise.get_default_group()
    gate = threading.Event()
    with g.unverified():
        # Rank 0's worker is held, so its asynchronous all_reduce reaches the wire after the torch one below;
        # rank 1's goes first. On one process group they would meet each other's (silently wrong sums).
        held = g._issue("hold", gate.wait if g.rank == 0 else gate.is_set, True)
        shardwise_sum = g.all_reduce(torch.full((4,), 1.0), async_op=True)
    torch_sum = torch.full((4,), 10.0)
    if g.rank == 0:
        threading.Timer(0.5, gate.set).start()
        dist.all_reduce(torch_sum)  # on dist.group.WORLD, as DDP's all-reduces are
    else:
        shardwise_sum.wait()
        dist.all_reduce(torch_sum)
    held.wait()
    seen = {"shardwise": shardwise_sum.wait().tolist(), "torch": torch_sum.tolist()}
    wire = getattr(g, "_wire_pg", None)
    seen["own_process_group"] = wire is not None and wire is not dist.group.WORLD and g.pg is dist.group.WORLD
    return seen


def test_torch_collectives_on_world_do_not_meet_pending_async_ones() -> None:
    # The default group talks on a process group of its own (made by shardwise.init), so torch code on
    # dist.group.WORLD (DDP beside SparseDistPipeline) may run while one of its collectives is pending.
    results = _run(torch_on_world_beside_pending_async, 2)
    for rank, seen in enumerate(results):
        assert seen["shardwise"] == [2.0] * 4 and seen["torch"] == [20.0] * 4, (rank, seen)
        if TEST_BACKEND == "test-gloo":
            assert seen["own_process_group"], rank
