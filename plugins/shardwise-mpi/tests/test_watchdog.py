"""The watchdog that turns a blocked MPI call into a reported, aborted job (no MPI needed: a fake expiry)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from shardwise_mpi._watchdog import EXIT_CODE, Watchdog

from shardwise.errors import PeerLostError


class Expiry:
    """Records the exit code the watchdog asked for instead of aborting the test process."""

    def __init__(self) -> None:
        self.codes: list[int] = []
        self.fired = threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self.fired.set()


def test_a_call_blocked_past_the_timeout_is_reported_and_ends_the_job(capfd: pytest.CaptureFixture[str]) -> None:
    expiry = Expiry()
    dog = Watchdog(timedelta(seconds=0.3), lambda: "rank 1 of 3", on_expiry=expiry)
    started = time.monotonic()
    with dog("all_reduce"):
        assert expiry.fired.wait(5.0)  # the "blocked MPI call"
    waited = time.monotonic() - started
    assert expiry.codes == [EXIT_CODE]
    assert 0.3 <= waited < 2.0
    err = capfd.readouterr().err
    assert "shardwise: rank 1 of 3: all_reduce on the mpi backend has waited" in err
    assert "longer than the group's timeout (0.3 s" in err and "SHARDWISE_TIMEOUT" in err
    assert f"aborts the job (exit status {EXIT_CODE})" in err


def test_calls_that_finish_in_time_never_fire() -> None:
    expiry = Expiry()
    dog = Watchdog(timedelta(seconds=0.2), lambda: "rank 0 of 2", on_expiry=expiry)
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:  # many short calls, longer in total than the timeout
        with dog("barrier"):
            time.sleep(0.01)
    time.sleep(0.4)  # idle, between calls: nothing is being waited for
    assert expiry.codes == []
    assert dog.state() == {"op": None, "timeout": 0.2, "running": True}


@pytest.mark.parametrize("timeout", [None, timedelta(0)])
def test_no_timeout_means_no_thread(timeout: timedelta | None) -> None:
    dog = Watchdog(timeout, lambda: "rank 0 of 1", on_expiry=Expiry())
    with dog("all_gather"):
        pass
    assert dog.state() == {"op": None, "timeout": None, "running": False}


def test_an_mpi_error_leaves_as_peer_lost_error_naming_rank_and_collective() -> None:
    mpi = pytest.importorskip("mpi4py.MPI")  # initialises MPI as a singleton
    dog = Watchdog(timedelta(seconds=30), lambda: "rank 2 of 4", on_expiry=Expiry())
    with pytest.raises(PeerLostError, match=r"^rank 2 of 4: scatter on the mpi backend failed: .*A peer has") as info:
        with dog("scatter"):
            raise mpi.Exception(mpi.ERR_OTHER)
    assert isinstance(info.value.__cause__, mpi.Exception)


def test_other_errors_pass_through_unchanged() -> None:
    dog = Watchdog(timedelta(seconds=30), lambda: "rank 0 of 2", on_expiry=Expiry())
    with pytest.raises(ValueError, match="counts"):
        with dog("gather"):
            raise ValueError("counts do not fit")


def test_close_stops_the_thread_and_an_unused_watchdog_is_collected() -> None:
    import gc
    import weakref

    dog = Watchdog(timedelta(seconds=30), lambda: "rank 0 of 2", on_expiry=Expiry())
    with dog("barrier"):
        pass
    thread = dog._thread
    assert thread is not None and thread.is_alive()
    dog.close()
    assert not thread.is_alive()
    with dog("barrier"):  # closed: nothing is watched any more
        pass
    assert dog.state()["timeout"] is None
    # Without close(): the thread holds only a weak reference, so a dropped watchdog goes away, and so does it.
    other = Watchdog(timedelta(seconds=0.5), lambda: "rank 0 of 2", on_expiry=Expiry())
    with other("barrier"):
        pass
    other_thread, ref = other._thread, weakref.ref(other)
    del other
    gc.collect()
    assert ref() is None
    assert other_thread is not None
    other_thread.join(timeout=2.0)
    assert not other_thread.is_alive()


def test_an_mpi_argument_error_is_not_reported_as_a_lost_peer() -> None:
    mpi = pytest.importorskip("mpi4py.MPI")
    dog = Watchdog(timedelta(seconds=30), lambda: "rank 0 of 2", on_expiry=Expiry())
    with pytest.raises(mpi.Exception) as info:
        with dog("recv"):
            raise mpi.Exception(mpi.ERR_TRUNCATE)
    assert not isinstance(info.value, PeerLostError)
