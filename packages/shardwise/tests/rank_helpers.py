"""Helpers shared by the core's multi-rank tests."""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping

import torch

import shardwise
from shardwise._comm import local_collectives, local_copy
from shardwise._comm.agreement import Call
from shardwise.errors import PeerError
from shardwise.sharded_tensor import Shard, ShardMetadata, ShardedTensor, TensorProperties
from shardwise.sharding_spec import ShardingSpec
from shardwise.testing import run_ranks

from conftest import RANK_ENV

#: The backend the multi-rank tests run on. By default the test-only gloo
#: backend (tox env ``core`` has no backend plugin); ``SHARDWISE_TEST_BACKEND=mpi``
#: (tox env ``mpi``) runs the same tests over the MPI plugin, launched by ``mpiexec``.
#: Read at import: the autouse fixture clears ``SHARDWISE_*`` for each test.
TEST_BACKEND = os.environ.get("SHARDWISE_TEST_BACKEND", "test-gloo")

#: Whether ranks also have a torch process group, which comparisons with
#: torch 2.13's ``_shard`` need. The test gloo backend has one, and the MPI
#: backend initialises torch.distributed over mpi4py (``SHARDWISE_MPI_TORCH_DIST``
#: is left at its default, on); a spawned backend of another kind has none.
HAS_TORCH_PG = TEST_BACKEND in ("test-gloo", "mpi")


def run(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """``fn(*args)`` on ``world_size`` ranks over the test backend; every rank's return value."""
    if TEST_BACKEND == "test-gloo":
        return run_ranks(fn, world_size, backend="test-gloo", args=args, env=RANK_ENV, timeout=120)
    launcher = "mpiexec" if TEST_BACKEND == "mpi" else "spawn"
    # The ranks import this module too and must see the same backend.
    env = {"SHARDWISE_TEST_BACKEND": TEST_BACKEND}
    return run_ranks(fn, world_size, backend=TEST_BACKEND, args=args, env=env, launcher=launcher, timeout=120)


def outcome(fn: Callable[[], Any]) -> tuple[str, str]:
    """``("ok", "")`` or ``(error type name, message)`` of calling ``fn``."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the tests inspect every rank's error
        return type(exc).__name__, str(exc)
    return "ok", ""


def box(t: torch.Tensor, md: ShardMetadata) -> torch.Tensor:
    """The view of ``t`` that shard ``md`` covers."""
    for d, (o, n) in enumerate(zip(md.shard_offsets, md.shard_sizes, strict=True)):
        t = t.narrow(d, o, n)
    return t


def check_errors(
    results: list[Mapping[str, tuple[str, str]]],
    on_every_rank: Mapping[str, tuple[str, str]],
    at_fault: Mapping[str, tuple[int, str, str]],
    peer_says: str = "rank {culprit} ({kind})",
) -> None:
    """Assert each case's error on every rank.

    Args:
        results: Per rank, case name -> :func:`outcome`.
        on_every_rank: case -> (error type, message fragment) expected on every rank.
        at_fault: case -> (culprit rank, error type, fragment): the culprit raises
            that error, every other rank a PeerError containing ``peer_says``.
        peer_says: Fragment of the peers' message, formatted with culprit and kind.
    """
    for rank, seen in enumerate(results):
        for case, (kind, fragment) in on_every_rank.items():
            assert seen[case][0] == kind and fragment in seen[case][1], (rank, case, seen[case])
        for case, (culprit, kind, fragment) in at_fault.items():
            if rank == culprit:
                assert seen[case][0] == kind and fragment in seen[case][1], (rank, case, seen[case])
            else:
                assert seen[case][0] == PeerError.__name__, (rank, case, seen[case])
                assert peer_says.format(culprit=culprit, kind=kind) in seen[case][1], (rank, case, seen[case])


def sharded_from_dense(
    full: torch.Tensor, spec: ShardingSpec, group: Any = None, requires_grad: bool = False
) -> ShardedTensor:
    """``full`` cut by ``spec`` from this rank's own slices (no communication)."""
    group = group if group is not None else shardwise.get_default_group()
    md = spec.build_metadata(full.size(), TensorProperties(dtype=full.dtype, requires_grad=requires_grad))
    shards = [
        Shard(box(full, m).clone().requires_grad_(requires_grad), m) for m in md.shards_metadata if m.rank == group.rank
    ]
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards, md, process_group=group, sharding_spec=spec)


def group_without_local_copy(g: Any) -> Any:
    """A group of every rank of ``g`` whose ranks decided, with the switch off, to keep the backend's path.

    ``SHARDWISE_LOCAL_COPY`` is read when a group first moves enough bytes
    to consider same-host one-copy reads; one all-gather of that size
    settles the new group's verdict while the switch is off.
    """
    os.environ[local_copy.LOCAL_COPY_ENV] = "0"
    try:
        sub = g.new_group(list(range(g.size)))
        assert sub is not None
        sub.barrier()
        sub.all_gather(torch.zeros(local_collectives.MIN_BYTES))
    finally:
        del os.environ[local_copy.LOCAL_COPY_ENV]
    return sub


class ScriptedPeer(shardwise.Group):
    """Rank 0 of two in one process; the peer's handshake row is scripted (data collectives are never reached).

    It counts its handshake rounds, and (like the mpi backend) overrides
    ``destroy`` only, recording that it ran; ``waits``: its destroy waits for
    the peer (as gloo's does), so destroy's handshake applies.
    """

    def __init__(self, peer: Call, verify: bool = True, waits: bool = True) -> None:
        super().__init__(backend="scripted", rank=0, size=2, device=torch.device("cpu"), verify=verify)
        self.peer, self.waits, self.rounds, self.destroyed = peer, waits, 0, False

    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor, counts: Any) -> None:
        self.rounds += 1
        out[: inp.numel()].copy_(inp)
        out[inp.numel() :].copy_(torch.tensor(self.peer.encode(2), dtype=torch.int64))

    def _destroy_waits(self) -> bool:
        return self.waits

    def destroy(self) -> None:
        self.destroyed = True

    def _barrier(self) -> None:
        raise AssertionError("not reached")

    def _broadcast(self, buf: torch.Tensor, src: int) -> None:
        raise AssertionError("not reached")

    def _all_reduce(self, buf: torch.Tensor, op: str) -> None:
        raise AssertionError("not reached")

    def _reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, counts: Any, op: str) -> None:
        raise AssertionError("not reached")

    def _all_to_all(self, out: torch.Tensor, out_counts: Any, inp: torch.Tensor, in_counts: Any) -> None:
        raise AssertionError("not reached")

    def _new_group(self, ranks: Any) -> Any:
        raise AssertionError("not reached")
