"""Tearing the default group down: ``destroy``, the exit handler ``init`` registers, torchrun's error file.

In one process (a world of one over torch's gloo):

- destroying a group torch made for shardwise joins gloo's worker threads
  (left running until interpreter exit, they abort the process), subgroups'
  threads too, and a failed ``destroy`` still releases the group;
- the exit handler releases a group the program never destroyed, without a
  barrier (it must not wait for peers), even when the frames of the
  exception the program dies of hold its process group (Ctrl-C inside a
  collective); it is registered once: ``destroy`` unregisters it, the next
  ``init`` registers it again, and a forked child leaves its parent's
  group alone;
- under torchrun (``TORCHELASTIC_ERROR_FILE`` set) an uncaught exception is
  written to the error file the way torch's ``@record`` writes it, and the
  previous ``sys.excepthook`` still runs.

The multi-rank, real-launcher side (no abort in many runs, a raising rank
exits at once, torchrun's summary) is ``integration_tests/test_clean_exit.py``.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
from pathlib import Path
from types import TracebackType
from typing import Optional

import pytest
import torch
import torch.distributed as dist

import shardwise
from shardwise._comm.work import Work
from shardwise._session import runtime
from shardwise.errors import LaunchError, PeerLostError
from shardwise.torch_group import TorchGroup

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")


@pytest.fixture(autouse=True)
def _clean(clean_session: None) -> None:
    """Every test here starts a session: see ``clean_session``."""


def _threads() -> int:
    """How many of gloo's worker threads (torch names them) this process runs."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            names.append(Path(f"/proc/self/task/{task}/comm").read_text().strip())
        except OSError:
            pass  # the thread ended meanwhile
    return names.count("pt_gloo_runloop")


@pytest.fixture(autouse=True)
def _no_stray_groups() -> None:
    """Free process groups earlier tests left to the garbage collector, so counts start from what is live."""
    gc.collect()


def _init() -> TorchGroup:
    # torchrun's error file (when a test set it) is all this process's launch environment says.
    environ = {name: os.environ[name] for name in (runtime.ERROR_FILE_ENV,) if name in os.environ}
    group = shardwise.init("test-gloo", environ=environ)
    assert isinstance(group, TorchGroup)
    group.all_reduce(torch.ones(3))  # gloo's workers have run a collective
    return group


def test_destroy_joins_gloo_worker_threads() -> None:
    before = _threads()
    group = _init()
    assert _threads() > before  # gloo's worker threads
    shardwise.destroy()
    assert _threads() == before, "gloo's worker threads outlive destroy(): they abort the process at exit"
    with pytest.raises(
        LaunchError, match=r"rank 0 of 1: this gloo group was destroyed .* call shardwise.init\(\) again"
    ):
        group.all_reduce(torch.ones(3))
    _init()  # init -> destroy -> init
    shardwise.destroy()
    assert _threads() == before


def test_destroying_the_default_group_releases_subgroups() -> None:
    before = _threads()
    group = _init()
    sub = group.new_group([0])
    assert isinstance(sub, TorchGroup)
    sub.all_reduce(torch.ones(2))
    shardwise.destroy()  # torch destroys every group with its default one
    assert _threads() == before, "a subgroup's gloo threads outlive the default group"
    with pytest.raises(LaunchError, match="was destroyed"):
        sub.all_reduce(torch.ones(2))
    sub.destroy()  # nothing left to do, and no error


def test_a_failed_destroy_still_releases_the_group(monkeypatch: pytest.MonkeyPatch) -> None:
    before = _threads()
    group = _init()

    def lost() -> None:
        raise PeerLostError("rank 0 of 1: barrier on the gloo backend failed: Connection closed by peer")

    monkeypatch.setattr(group, "_barrier", lost)
    with pytest.raises(PeerLostError, match="Connection closed by peer"):
        shardwise.destroy()
    assert not shardwise.is_initialized() and not dist.is_initialized()
    assert _threads() == before


def test_exit_handler_releases_the_group_without_waiting_for_peers(monkeypatch: pytest.MonkeyPatch) -> None:
    before = _threads()
    group = _init()

    def wait_for_peers() -> None:
        raise AssertionError("the exit handler waited for the other ranks")

    monkeypatch.setattr(group, "_barrier", wait_for_peers)
    runtime._at_exit()
    assert not shardwise.is_initialized() and not dist.is_initialized()
    assert _threads() == before
    runtime._at_exit()  # a second call finds nothing to do


def test_exit_handler_finishes_a_subgroups_queued_collectives() -> None:
    # Every rank issued them, so every rank must run them: a sub-group's finalizer alone would drop the ones
    # its worker had not started, and a peer whose worker had started them would wait for this rank.
    group = _init()
    sub = group.new_group([0])
    assert isinstance(sub, TorchGroup)
    sub.all_reduce(torch.ones(2), async_op=True).wait()  # starts the sub-group's worker
    worker = sub._worker
    assert worker is not None
    gate = threading.Event()
    # Queued straight on the worker: a collective's own handshake would wait for the running one.
    running = worker.submit(Work("all_reduce", "rank 0 of 1"), lambda: gate.wait(30), None)
    queued = worker.submit(Work("broadcast", "rank 0 of 1"), lambda: "ran", None)
    threading.Timer(0.2, gate.set).start()
    runtime._at_exit()
    assert running.is_completed() and queued.is_completed()
    assert running.wait() is True and queued.wait() == "ran"
    assert worker._thread is not None and not worker._thread.is_alive()


def test_exit_handler_frees_what_the_fatal_exceptions_frames_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    before = _threads()
    group = _init()

    def all_reduce(pg: dist.ProcessGroup) -> None:
        raise KeyboardInterrupt  # Ctrl-C inside a collective, as in dist.all_reduce(t, group=pg)

    try:
        all_reduce(group.pg)
    except KeyboardInterrupt as exc:
        # What Python keeps of an uncaught exception until the exit handlers have run.
        monkeypatch.setattr(sys, "last_value", exc, raising=False)
        monkeypatch.setattr(sys, "last_exc", exc, raising=False)
        monkeypatch.setattr(sys, "last_traceback", exc.__traceback__, raising=False)
    runtime._at_exit()
    assert _threads() == before, "the exception's frames kept the process group, and its threads, alive"


class _Atexit:
    """Stands in for the ``atexit`` module: which handlers are registered."""

    def __init__(self) -> None:
        self.handlers: list[object] = []

    def register(self, handler: object) -> None:
        self.handlers.append(handler)

    def unregister(self, handler: object) -> None:
        self.handlers = [h for h in self.handlers if h is not handler]


def test_init_registers_the_exit_handler_once_and_destroy_unregisters_it(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _Atexit()
    monkeypatch.setattr(runtime, "atexit", fake)
    _init()
    assert fake.handlers == [runtime._at_exit]
    shardwise.destroy()
    assert fake.handlers == []
    _init()
    assert fake.handlers == [runtime._at_exit]
    with pytest.raises(LaunchError, match="already called"):
        shardwise.init("test-gloo", environ={})
    assert fake.handlers == [runtime._at_exit]


def test_exit_handler_of_a_forked_child_leaves_the_parents_group_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    group = _init()
    monkeypatch.setattr(runtime, "_owner_pid", os.getpid() + 1)  # as in a child forked after init
    runtime._at_exit()
    assert shardwise.get_default_group() is group
    assert group.all_reduce(torch.ones(2)).tolist() == [1.0, 1.0]


# -- torchrun's error file ------------------------------------------------------------------


class _Previous:
    """The ``sys.excepthook`` that was there before: records what it was called with."""

    def __init__(self) -> None:
        self.calls: list[tuple[type[BaseException], BaseException, Optional[TracebackType]]] = []

    def __call__(self, kind: type[BaseException], value: BaseException, tb: Optional[TracebackType]) -> None:
        self.calls.append((kind, value, tb))


def _raised(exc: BaseException) -> tuple[type[BaseException], BaseException, Optional[TracebackType]]:
    try:
        raise exc
    except BaseException as caught:
        return type(caught), caught, caught.__traceback__


@pytest.fixture
def records(monkeypatch: pytest.MonkeyPatch) -> list[BaseException]:
    """Every exception the error hook records; ``sys.excepthook`` is a :class:`_Previous` before ``init``.

    ``init`` puts its hook in front of that one; torch's ``init_process_group``
    then puts its own (which prefixes the rank) in front of both.
    """
    recorded: list[BaseException] = []
    record = runtime._record

    def counting(handler: object, value: BaseException, tb: Optional[TracebackType]) -> None:
        recorded.append(value)
        record(handler, value, tb)

    monkeypatch.setattr(runtime, "_record", counting)
    monkeypatch.setattr(runtime, "_error_hook_installed", False)
    monkeypatch.setattr(sys, "excepthook", _Previous())
    return recorded


@pytest.fixture
def error_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The error file torchrun names for this worker."""
    path = tmp_path / "error.json"
    monkeypatch.setenv(runtime.ERROR_FILE_ENV, str(path))
    return path


def test_uncaught_exception_is_written_to_torchruns_error_file(error_file: Path, records: list[BaseException]) -> None:
    previous = sys.excepthook
    assert isinstance(previous, _Previous)
    _init()
    kind, value, tb = _raised(ValueError("deliberate failure"))
    sys.excepthook(kind, value, tb)
    assert records == [value]
    data = json.loads(error_file.read_text())
    assert data["message"]["message"] == "ValueError: deliberate failure"
    stack = data["message"]["extraInfo"]["py_callstack"]
    assert stack.startswith("Traceback (most recent call last):"), stack
    assert "raise exc" in stack and "in _raised" in stack, stack  # where it was raised
    assert "in _record" not in stack, stack  # not the hook's own re-raise
    assert int(data["message"]["extraInfo"]["timestamp"]) > 0
    assert previous.calls == [(kind, value, tb)]  # the traceback is still printed
    assert value.__traceback__ is tb


def test_the_error_file_appears_whole(error_file: Path, records: list[BaseException]) -> None:
    # torchrun may read the file while the worker writes it: it must never see it empty or half-written.
    seen: list[tuple[str, bool]] = []

    class Handler:
        def record_exception(self, e: BaseException) -> None:
            path = os.environ[runtime.ERROR_FILE_ENV]
            Path(path).write_text(json.dumps({"message": {"message": f"{type(e).__name__}: {e}"}}))
            seen.append((path, error_file.exists()))

    _, value, tb = _raised(ValueError("whole"))
    runtime._record(Handler(), value, tb)
    ((written, existed),) = seen
    assert written != str(error_file) and Path(written).parent == error_file.parent and not existed
    assert json.loads(error_file.read_text())["message"]["message"] == "ValueError: whole"
    assert not Path(written).exists() and os.environ[runtime.ERROR_FILE_ENV] == str(error_file)


def test_keyboard_interrupt_is_not_written_as_an_error(error_file: Path, records: list[BaseException]) -> None:
    previous = sys.excepthook
    assert isinstance(previous, _Previous)
    _init()
    kind, value, tb = _raised(KeyboardInterrupt())
    sys.excepthook(kind, value, tb)
    assert records == [] and not error_file.exists()  # as torch's @record, which records Exceptions only
    assert previous.calls == [(kind, value, tb)]


def test_the_error_hook_is_installed_once(error_file: Path, records: list[BaseException]) -> None:
    _init()
    shardwise.destroy()
    _init()
    kind, value, tb = _raised(ValueError("once"))
    sys.excepthook(kind, value, tb)
    assert records == [value]


def test_no_error_hook_outside_torchrun(monkeypatch: pytest.MonkeyPatch, records: list[BaseException]) -> None:
    monkeypatch.delenv(runtime.ERROR_FILE_ENV, raising=False)
    previous = sys.excepthook
    assert isinstance(previous, _Previous)
    _init()
    kind, value, tb = _raised(ValueError("not under torchrun"))
    sys.excepthook(kind, value, tb)
    assert records == [] and previous.calls == [(kind, value, tb)]
