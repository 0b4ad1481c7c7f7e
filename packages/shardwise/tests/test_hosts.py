"""Which ranks share a host: ``Group.hosts``, ``Group.local_ranks`` and ``shardwise.launch_info``.

Two real hosts are exercised by ``integration_tests/test_two_hosts.py``
(network namespaces); here the ranks run on one machine, and a rank's host
is faked where the test needs several.
"""

from __future__ import annotations

import socket
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import shardwise
from shardwise import Host, LaunchInfo
from shardwise._comm import group_agreement
from shardwise._comm.hosts import this_host
from shardwise._vocab.launch import group_by_host

from rank_helpers import run


def test_ranks_with_the_same_name_and_boot_id_share_a_host() -> None:
    hosts = group_by_host([["a", "k1"], ["b", "k1"], ["a", "k1"], ["a", "k2"], ["b", "k1"]])
    # "a" on another kernel (k2) is another machine that happens to carry the same name.
    assert hosts == (Host("a", (0, 2)), Host("b", (1, 4)), Host("a", (3,)))


@given(st.lists(st.tuples(st.sampled_from("abc"), st.sampled_from("xy")), min_size=1, max_size=12))
def test_hosts_partition_the_ranks_in_order_of_their_lowest_rank(identities: list[tuple[str, str]]) -> None:
    hosts = group_by_host([list(i) for i in identities])
    assert sorted(r for h in hosts for r in h.ranks) == list(range(len(identities)))
    assert [h.ranks[0] for h in hosts] == sorted(h.ranks[0] for h in hosts)
    for host in hosts:
        assert list(host.ranks) == sorted(host.ranks)
        assert len({identities[r] for r in host.ranks}) == 1 and identities[host.ranks[0]][0] == host.name


def test_this_host_is_the_host_name_and_the_kernels_boot_id() -> None:
    name, boot = this_host()
    assert name == socket.gethostname()
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            assert boot == f.read().strip()
    except OSError:
        assert boot == ""


def _hosts_on_one_machine() -> dict[str, Any]:
    group = shardwise.get_default_group()
    hosts = group.hosts()
    assert group.hosts() is hosts  # answered from the cache, without another collective
    return {"hosts": [(h.name, list(h.ranks)) for h in hosts], "local": list(group.local_ranks())}


@pytest.mark.parametrize("world", [1, 3])
def test_every_rank_of_one_machine_shares_its_host(world: int) -> None:
    for seen in run(_hosts_on_one_machine, world):
        assert seen == {"hosts": [(socket.gethostname(), list(range(world)))], "local": list(range(world))}


def _hosts_faked_two_per_host() -> dict[str, Any]:
    group = shardwise.get_default_group()
    rank = group.rank
    # Group.hosts (in group_agreement) looks this_host up in its own module.
    group_agreement.this_host = lambda: [f"node{rank // 2}", "same-kernel"]  # type: ignore[attr-defined]
    sub = group.new_group([1, 2, 3])
    out: dict[str, Any] = {
        "hosts": [(h.name, list(h.ranks)) for h in group.hosts()],
        "local": list(group.local_ranks()),
    }
    if sub is not None:
        # Group ranks of the subgroup: global ranks 1, 2, 3 are its ranks 0, 1, 2.
        out["sub"] = [(h.name, list(h.ranks)) for h in sub.hosts()]
    return out


def test_hosts_group_the_ranks_by_host_in_a_group_and_in_a_subgroup() -> None:
    results = run(_hosts_faked_two_per_host, 4)
    expected = [("node0", [0, 1]), ("node1", [2, 3])]
    for rank, seen in enumerate(results):
        assert seen["hosts"] == expected, (rank, seen)
        assert seen["local"] == [0, 1] if rank < 2 else [2, 3], (rank, seen)
        if rank > 0:
            assert seen["sub"] == [("node0", [0]), ("node1", [1, 2])], (rank, seen)


def test_launch_info_reads_the_launchers_variables_without_init() -> None:
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "node0", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x"}  # fmt: skip
    info = shardwise.launch_info(env)
    assert info == LaunchInfo(
        launcher="torchrun", family="torchrun", rank=3, world_size=4, local_rank=1, local_world_size=2,
        master_addr="node0", master_port=29500, rendezvous_hint=info.rendezvous_hint,
    )  # fmt: skip
    assert not shardwise.is_initialized()
    assert shardwise.launch_info({}).launcher == "single"
