"""The network interface gloo binds when GLOO_SOCKET_IFNAME is unset: the one that routes to the rendezvous host.

Routes are faked here (two hosts, "a" holding the rendezvous store, whose
name resolves to loopback on "a" itself, as Debian's ``127.0.1.1`` line
makes it); ``integration_tests/test_two_hosts.py`` runs the real thing
across two network namespaces.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
import threading
from datetime import timedelta
from typing import Callable, Optional

import pytest
import torch.distributed as dist

import shardwise
from shardwise import LaunchInfo
from shardwise.errors import LaunchError
from shardwise.testing import run_ranks
from shardwise_gloo._interface import IFNAME_ENV, Route, choose_interface, interface_with_address, route_to

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="interfaces are looked up on Linux only")


@pytest.fixture(autouse=True)
def no_interface_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    # setenv first, so teardown undoes what choose_interface sets: delenv of an unset name records nothing,
    # and the interface a test chose (eth-a) would reach later tests' mpiexec children.
    monkeypatch.setenv(IFNAME_ENV, "")
    monkeypatch.delenv(IFNAME_ENV)


def _launch(rank: int, world: int = 4, local_world: Optional[int] = 2, addr: str = "host-a") -> LaunchInfo:
    return LaunchInfo(
        launcher="torchrun", family="torchrun", rank=rank, world_size=world, local_rank=rank % 2,
        local_world_size=local_world, master_addr=addr, master_port=29500,
    )  # fmt: skip


# Two hosts: a (ranks 0, 1; holds the store) and b (ranks 2, 3), joined by a network 10.9.0.0/24.
_ON_A = {
    "host-a": Route("host-a", "127.0.1.1", "127.0.0.1", "lo"),
    "10.9.0.2": Route("10.9.0.2", "10.9.0.2", "10.9.0.1", "eth-a"),
}
_ON_B = {"host-a": Route("host-a", "10.9.0.1", "10.9.0.2", "eth-b")}


def _fake_route(table: dict[str, Route]) -> Callable[[str, int], Route]:
    def route(host: str, port: int) -> Route:
        if host not in table:
            raise OSError(errno.ENETUNREACH, "Network is unreachable")
        return table[host]

    return route


def _choose_on_every_rank(
    tables: list[dict[str, Route]], launches: list[LaunchInfo], timeout: float = 30
) -> list[object]:
    """Every rank's choice against one store, each rank's finish in a thread of its own; each rank's interface or error.

    The ranks share this process's environment, so every rank plans before
    any finishes (a finished rank sets GLOO_SOCKET_IFNAME, which a later
    plan would take for the user's choice).
    """
    store = dist.HashStore()
    chosen: list[object] = [None] * len(launches)
    finishes = [choose_interface(launch, timedelta(seconds=timeout), route=_fake_route(table))
                for launch, table in zip(launches, tables, strict=True)]  # fmt: skip

    def rank(r: int) -> None:
        finish = finishes[r]
        try:
            chosen[r] = None if finish is None else finish(store)
        except Exception as exc:  # noqa: BLE001 - the test compares what each rank got
            chosen[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(launches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 30)
    return chosen


def test_each_host_binds_the_interface_that_reaches_the_other() -> None:
    # Host a's own name resolves to loopback there: its ranks learn 10.9.0.2 from b's ranks and bind eth-a.
    chosen = _choose_on_every_rank([_ON_A, _ON_A, _ON_B, _ON_B], [_launch(r) for r in range(4)])
    assert chosen == ["eth-a", "eth-a", "eth-b", "eth-b"]


def test_without_the_local_world_size_the_choice_is_the_same() -> None:
    # Slurm does not say how many ranks share a host: every rank then takes part in the exchange.
    chosen = _choose_on_every_rank([_ON_A, _ON_A, _ON_B, _ON_B], [_launch(r, local_world=None) for r in range(4)])
    assert chosen == ["eth-a", "eth-a", "eth-b", "eth-b"]


def test_a_job_on_one_host_binds_loopback() -> None:
    # Every route stays on the host: whether or not the launcher says so, loopback is right.
    for local_world in (4, None):
        os.environ.pop(IFNAME_ENV, None)
        chosen = _choose_on_every_rank([_ON_A] * 4, [_launch(r, local_world=local_world) for r in range(4)])
        assert chosen == ["lo"] * 4, local_world


def test_the_rendezvous_host_given_as_an_address_routes_without_an_exchange() -> None:
    on_a = {"10.9.0.1": Route("10.9.0.1", "10.9.0.1", "10.9.0.1", "eth-a")}
    on_b = {"10.9.0.1": Route("10.9.0.1", "10.9.0.1", "10.9.0.2", "eth-b")}
    chosen = _choose_on_every_rank([on_a, on_a, on_b, on_b], [_launch(r, addr="10.9.0.1") for r in range(4)])
    assert chosen == ["eth-a", "eth-a", "eth-b", "eth-b"]


def test_the_chosen_interface_is_set_for_later_gloo_groups(caplog: pytest.LogCaptureFixture) -> None:
    finish = choose_interface(_launch(2), timedelta(seconds=5), route=_fake_route(_ON_B))
    assert finish is not None
    store = dist.HashStore()
    store.set("shardwise/gloo-interface/0/x", "")  # the store may hold anything else
    with caplog.at_level(logging.DEBUG, logger="shardwise"):
        assert finish(store) == "eth-b"
    assert os.environ[IFNAME_ENV] == "eth-b"
    assert "gloo binds interface eth-b (address 10.9.0.2): the route to host-a (10.9.0.1)" in caplog.text


def test_an_unreachable_rendezvous_host_fails_at_once_naming_the_fix() -> None:
    with pytest.raises(LaunchError) as raised:
        choose_interface(_launch(2, addr="10.77.0.1"), timedelta(seconds=5), route=_fake_route(_ON_B))
    message = str(raised.value)
    assert "rank 2: no network interface of this host" in message and "'10.77.0.1'" in message
    assert "Network is unreachable" in message
    assert "Set MASTER_ADDR" in message and IFNAME_ENV in message


def test_nothing_is_chosen_for_the_user_one_rank_or_no_rendezvous(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(host: str, port: int) -> Route:
        raise AssertionError("no route should be looked up")

    assert choose_interface(_launch(0, world=1, local_world=1), timedelta(seconds=1), route=never) is None
    no_master = LaunchInfo(launcher="env", family="env", rank=0, world_size=2)
    assert choose_interface(no_master, timedelta(seconds=1), route=never) is None
    monkeypatch.setenv(IFNAME_ENV, "eth7")
    assert choose_interface(_launch(0), timedelta(seconds=1), route=never) is None


def test_a_rank_on_the_rendezvous_host_gives_up_when_the_others_never_come() -> None:
    (chosen,) = _choose_on_every_rank([_ON_A], [_launch(0)], timeout=0.5)
    assert isinstance(chosen, LaunchError), chosen
    assert "waited 0.5s for every rank" in str(chosen) and "all 4 ranks started" in str(chosen)


def test_a_second_choice_in_one_process_does_not_reuse_the_first_ones_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    # shardwise.init() after destroy() meets the same (torchrun agent) store again.
    store = dist.HashStore()
    monkeypatch.setattr(dist, "HashStore", lambda: store)
    for _ in range(2):
        os.environ.pop(IFNAME_ENV, None)  # as in a process of its own, where the first round set it
        chosen = _choose_on_every_rank([_ON_A, _ON_A, _ON_B, _ON_B], [_launch(r) for r in range(4)], timeout=10)
        assert chosen == ["eth-a", "eth-a", "eth-b", "eth-b"]


@linux_only
def test_routes_and_interfaces_of_this_machine() -> None:
    here = route_to("127.0.0.1", 9)
    assert (here.target, here.source, here.interface, here.loopback) == ("127.0.0.1", "127.0.0.1", "lo", True)
    assert interface_with_address("127.0.0.1") == "lo"
    assert interface_with_address("192.0.2.77") is None  # TEST-NET-1: no interface holds it
    with pytest.raises(OSError):
        route_to("no-such-host.invalid", 9)


def _gloo_with_the_interface() -> tuple[str, str]:
    group = shardwise.get_default_group()
    return group.backend, os.environ.get(IFNAME_ENV, "")


@linux_only
def test_init_on_gloo_binds_the_chosen_interface() -> None:
    # run_ranks's rendezvous is 127.0.0.1: the route, and so the interface, is loopback.
    for backend, interface in run_ranks(_gloo_with_the_interface, 2, backend="gloo", timeout=120):
        assert (backend, interface) == ("gloo", "lo")
