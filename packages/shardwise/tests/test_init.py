"""shardwise.init / destroy / get_default_group / resolve_group in one process."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Iterable

import pytest
import torch
import torch.distributed as dist

import shardwise
from shardwise import Availability, Backend, LaunchInfo, hookimpl, plugins
from shardwise._session.runtime import select_backend
from shardwise.errors import BackendNotFoundError, BackendUnavailableError, LaunchError
from shardwise.torch_group import TorchGroup


@pytest.fixture(autouse=True)
def _clean(clean_session: None) -> None:
    """Every test here starts a session: see ``clean_session``."""


class Fake:
    def __init__(self, *records: Backend) -> None:
        self.records = records

    @hookimpl
    def shardwise_backends(self) -> Iterable[Backend]:
        return self.records


def _fake(name: str, ok: bool = True, **kw: Any) -> Backend:
    avail = Availability(True) if ok else Availability(False, f"{name} has no widgets")
    return Backend(name=name, is_available=lambda: avail, create_group=lambda launch, timeout: None, **kw)  # type: ignore[arg-type,return-value]


def _launch(family: str) -> LaunchInfo:
    return LaunchInfo(launcher=family, family=family, rank=0, world_size=2)


def test_single_process_init_and_destroy() -> None:
    group = shardwise.init("test-gloo", environ={})
    assert (group.rank, group.size, group.backend) == (0, 1, "gloo")
    assert shardwise.is_initialized() and shardwise.get_default_group() is group
    assert shardwise.resolve_group(None) is group
    # One group for one process group: blocking calls through WORLD wait for the default group's queued ones.
    assert shardwise.resolve_group(dist.group.WORLD) is group
    t = torch.arange(4.0)
    assert group.all_reduce(t).tolist() == [0.0, 1.0, 2.0, 3.0]
    assert group.exchange({"a": [1, 2]}) == [{"a": [1, 2]}]
    shardwise.destroy()
    assert not shardwise.is_initialized() and not dist.is_initialized()
    shardwise.destroy()  # idempotent


def test_init_twice_is_a_clear_error() -> None:
    shardwise.init("test-gloo", environ={})
    with pytest.raises(LaunchError, match=r"already called \(backend 'gloo', rank 0 of 1\); call shardwise.destroy\(\)"):
        shardwise.init("test-gloo", environ={})
    shardwise.destroy()
    shardwise.init("test-gloo", environ={})  # fine after destroy


def test_unknown_backend_names_distribution() -> None:
    with pytest.raises(BackendNotFoundError, match=r"'mpi' is not installed; installed: test-gloo.*pip install shardwise-mpi"):
        shardwise.init("mpi", environ={})
    assert not shardwise.is_initialized()


def test_env_override_and_explicit_argument() -> None:
    with pytest.raises(BackendNotFoundError, match="'from-env' is not installed"):
        shardwise.init(environ={"SHARDWISE_BACKEND": "from-env"})
    group = shardwise.init("test-gloo", environ={"SHARDWISE_BACKEND": "from-env"})
    assert group.backend == "gloo"


def test_unavailable_backend_says_why() -> None:
    plugins.register(Fake(_fake("widget", ok=False)), name="fake")
    with pytest.raises(BackendUnavailableError, match="'widget' is installed but cannot run here: widget has no widgets"):
        shardwise.init("widget", environ={})


def test_create_group_must_return_a_group() -> None:
    plugins.register(Fake(_fake("liar")), name="fake")
    with pytest.raises(BackendUnavailableError, match="returned NoneType from create_group"):
        shardwise.init("liar", environ={})


def test_missing_rendezvous_names_the_variables() -> None:
    env = {"PMI_RANK": "0", "PMI_SIZE": "2"}
    with pytest.raises(LaunchError) as info:
        shardwise.init("test-gloo", environ=env, timeout=5)
    message = str(info.value)
    assert "needs a rendezvous address" in message and "MASTER_ADDR and MASTER_PORT" in message
    assert "mpiexec -genv MASTER_ADDR" in message and "shardwise-mpi" in message
    env["MASTER_ADDR"] = "127.0.0.1"
    with pytest.raises(LaunchError, match="does not provide MASTER_PORT"):
        shardwise.init("test-gloo", environ=env, timeout=5)


def test_bad_timeouts() -> None:
    with pytest.raises(LaunchError, match="SHARDWISE_TIMEOUT='soon' is not a number"):
        shardwise.init("test-gloo", environ={"SHARDWISE_TIMEOUT": "soon"})
    with pytest.raises(ValueError, match="timeout must be positive"):
        shardwise.init("test-gloo", environ={}, timeout=-1)
    group = shardwise.init("test-gloo", environ={}, timeout=timedelta(seconds=30))
    assert group.size == 1


def test_automatic_choice() -> None:
    plugins.unregister("core_test_backend")
    plugins.register(
        Fake(
            _fake("gloo"),
            _fake("nccl", priority=10),
            _fake("mpi", priority=-1, preferred_under=("mpi",)),
        ),
        name="fake",
    )
    assert select_backend(_launch("mpi")).name == "mpi"
    assert select_backend(_launch("torchrun")).name == "nccl"
    plugins.unregister("fake")
    plugins.register(
        Fake(_fake("gloo"), _fake("nccl", ok=False, priority=10), _fake("mpi", priority=-1, preferred_under=("mpi",))),
        name="fake",
    )
    assert select_backend(_launch("torchrun")).name == "gloo"
    assert select_backend(_launch("slurm")).name == "gloo"
    assert select_backend(_launch("mpi")).name == "mpi"


def test_no_usable_backend() -> None:
    plugins.unregister("core_test_backend")
    with pytest.raises(BackendNotFoundError, match="no backend plugin is installed.*pip install shardwise-gloo"):
        select_backend(_launch("single"))
    plugins.register(Fake(_fake("nccl", ok=False)), name="fake")
    with pytest.raises(BackendNotFoundError, match="nccl: nccl has no widgets"):
        shardwise.init(environ={})


def test_default_group_falls_back_to_torch() -> None:
    with pytest.raises(LaunchError, match=r"no default group: call shardwise.init\(\) first"):
        shardwise.get_default_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    group = shardwise.get_default_group()
    assert isinstance(group, TorchGroup) and group.backend == "gloo"
    assert shardwise.resolve_group(dist.group.WORLD) is group
    assert shardwise.resolve_group(group) is group
    with pytest.raises(
        TypeError,
        match=r"process_group must be a shardwise Group, a torch.distributed.ProcessGroup, None or \(on a rank "
        r"outside the group\) torch's GroupMember.NON_GROUP_MEMBER, got str",
    ):
        shardwise.resolve_group("WORLD")


def test_init_reuses_torch_when_already_initialised() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    group = shardwise.init("test-gloo", environ={})
    assert isinstance(group, TorchGroup) and group.pg is dist.group.WORLD
    shardwise.destroy()
    assert dist.is_initialized()  # the user's process group is left alone


def test_a_transport_failure_becomes_peer_lost_error_naming_rank_and_collective(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from shardwise.errors import PeerLostError

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    group = shardwise.get_default_group()

    def closed(*args: object, **kwargs: object) -> None:
        raise dist.DistBackendError("[pair.cc:553] Connection closed by peer [127.0.0.1]:4246")

    monkeypatch.setattr(dist, "all_reduce", closed)
    with pytest.raises(PeerLostError, match=r"^rank 0 of 1: all_reduce on the gloo backend failed: \[pair.cc:553\] "
                       r"Connection closed by peer .*A peer has probably died.*SHARDWISE_TIMEOUT") as info:
        group.all_reduce(torch.ones(3))
    assert isinstance(info.value.__cause__, dist.DistBackendError)
    assert isinstance(info.value, RuntimeError)  # existing `except RuntimeError` clauses still catch it
    # A failure inside the handshake names the collective the caller made, not the handshake's all-gather.
    monkeypatch.setattr(dist, "all_gather_single", closed)
    monkeypatch.setattr(dist, "all_to_all_single", closed)  # gloo's small all-gathers go as one all-to-all
    with pytest.raises(PeerLostError, match=r"^rank 0 of 1: broadcast \(agreeing on its arguments\) on the gloo"):
        group.broadcast(torch.ones(3))
    monkeypatch.undo()
    assert group.all_reduce(torch.ones(3)).tolist() == [1.0, 1.0, 1.0]  # the handshake label was reset

    def out_of_memory(*args: object, **kwargs: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(dist, "all_reduce", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):  # a local failure, not a lost peer: its type is kept
        group.all_reduce(torch.ones(3), op="max")
