"""Yama's ``ptrace_scope`` 1 (``shardwise._comm.ptracer``): the ranks declare their launcher their tracer.

The kernels these tests run on have no Yama, so the multi-rank tests play
its rule: a read of a peer's memory is refused unless the peer declared a
tracer that is the reader or one of its ancestors (a marker file per
process stands for the kernel's record of ``prctl(PR_SET_PTRACER)``).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import shardwise
from shardwise._comm import cross_memory, local_collectives, local_copy, ptracer

from rank_helpers import run


def _play_yama(marks: Path, scope: int, case: str, rank: int) -> tuple[list[int], Callable[[], None]]:
    """Patch this rank's kernel view: Yama at ``scope``; returns the ``prctl`` values it was given, and an undo."""
    calls: list[int] = []
    real = (ptracer.yama_scope, ptracer._prctl, ptracer.ancestry, cross_memory.read_runs, cross_memory.write_runs)
    if case == "scopes differ" and rank == 1:
        scope = 2

    def prctl(option: int, value: int) -> int:
        assert option == ptracer._PR_SET_PTRACER
        calls.append(value)
        if case == "a rank cannot declare" and rank == 1:
            return errno.EINVAL
        (marks / str(os.getpid())).write_text(str(value))
        return 0

    def allowed(pid: int) -> bool:
        if pid == os.getpid() or scope == 0:
            return True
        mark = marks / str(pid)
        tracer = int(mark.read_text()) if mark.exists() else 0
        return case != "declaring does not help" and scope == 1 and tracer in real[2](depth=64)

    def guarded(copy: Callable[..., int]) -> Callable[..., int]:
        if case == "another error too" and rank == 0:
            return lambda pid, runs: copy(pid, runs) if pid == os.getpid() else errno.EIO
        return lambda pid, runs: copy(pid, runs) if allowed(pid) else errno.EPERM

    ptracer.yama_scope = lambda path=None: scope  # type: ignore[assignment]
    ptracer._prctl = prctl  # type: ignore[assignment]
    if case == "no common parent":
        ptracer.ancestry = lambda pid=None, **kw: [os.getpid(), 10_000_000 + rank]  # type: ignore[assignment]
    cross_memory.read_runs = guarded(real[3])  # type: ignore[assignment]
    cross_memory.write_runs = guarded(real[4])  # type: ignore[assignment]

    def undo() -> None:
        (
            ptracer.yama_scope,
            ptracer._prctl,
            ptracer.ancestry,
            cross_memory.read_runs,
            cross_memory.write_runs,
        ) = real  # type: ignore[assignment]

    return calls, undo


def _moves_under_yama(marks: str, scope: int, case: str) -> dict[str, Any]:
    g = shardwise.get_default_group()
    if case == "switched off":
        os.environ[ptracer.DECLARE_ENV] = "0"
    calls, undo = _play_yama(Path(marks), scope, case, g.rank)
    try:
        sub = g.new_group(list(range(g.size)))
        assert sub is not None
        before = sum(local_copy.stats.values())
        gathered = sub.all_gather(torch.full((local_collectives.MIN_BYTES,), float(sub.rank)))
        spec = shardwise.ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(g.size)])
        dense = torch.arange(512 * 1024, dtype=torch.float32).reshape(512, 1024)
        st = shardwise.shard_tensor(dense, spec, src_rank=0, process_group=sub)
        whole = st.full_tensor()
        return {
            "used": sum(local_copy.stats.values()) > before,
            "right": [int(t[0]) for t in gathered] == list(range(g.size)) and torch.equal(whole, dense),
            "prctl": calls,
            "declared": ptracer.declared(),
            "parent": os.getppid(),
        }
    finally:
        undo()


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_refused_by_yama_scope_1_declare_their_parent(world_size: int, tmp_path: Path) -> None:
    for res in run(_moves_under_yama, world_size, str(tmp_path), 1, "refused until declared"):
        assert res["used"] and res["right"], res
        assert res["prctl"] == [res["parent"]] and res["declared"] == res["parent"], res


@pytest.mark.parametrize(
    ("scope", "case"),
    [
        (2, "refused"),  # admin-only attach: no process can lift it
        (1, "no common parent"),  # a common ancestor further up holds other work of the user
        (1, "switched off"),
        (1, "scopes differ"),
        (1, "another error too"),  # a refusal a declaration would not lift
    ],
)
def test_ranks_yama_still_refuses_keep_the_backends_path(tmp_path: Path, scope: int, case: str) -> None:
    for res in run(_moves_under_yama, 2, str(tmp_path), scope, case):
        assert not res["used"] and res["right"], res
        assert res["prctl"] == [] and res["declared"] is None, res


@pytest.mark.parametrize("case", ["a rank cannot declare", "declaring does not help"])
def test_a_declaration_that_does_not_help_is_taken_back(tmp_path: Path, case: str) -> None:
    results = run(_moves_under_yama, 2, str(tmp_path), 1, case)
    for rank, res in enumerate(results):
        assert not res["used"] and res["right"] and res["declared"] is None, res
        declared_then_undone = [res["parent"], 0]
        assert res["prctl"] == ([res["parent"]] if case == "a rank cannot declare" and rank == 1 else declared_then_undone)


def test_ranks_that_read_each_other_already_declare_nothing(tmp_path: Path) -> None:
    # Scope 0 (or a process allowed by its capabilities): the first reads work, nothing is declared.
    for res in run(_moves_under_yama, 2, str(tmp_path), 0, "refused until declared"):
        assert res["used"] and res["right"] and res["prctl"] == [] and res["declared"] is None, res


# -- one process -------------------------------------------------------------------


def test_the_ancestry_reads_parents_past_names_with_spaces_and_parentheses(tmp_path: Path) -> None:
    for pid, name, parent in ((40, "python (rank 1)", 30), (30, "a) b", 20), (20, "torchrun", 1)):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} ({name}) S {parent} {pid} 0 0 -1 4194560 1 0")
    assert ptracer.ancestry(40, proc=tmp_path) == [40, 30]  # a rank and its parent: all that is published
    assert ptracer.ancestry(40, proc=tmp_path, depth=8) == [40, 30, 20, 1]
    assert ptracer.ancestry(99, proc=tmp_path) == [99]  # an unreadable parent ends the chain
    assert ptracer.ancestry() == [os.getpid(), os.getppid()]


def test_the_launcher_is_every_ranks_parent_or_a_rank_and_never_the_hosts_init() -> None:
    assert ptracer.nearest_common_ancestor([[11, 10], [12, 10], [13, 10]]) == 10
    assert ptracer.nearest_common_ancestor([[11, 10], [10, 3]]) == 10  # a rank that launched the other
    assert ptracer.nearest_common_ancestor([[11, 10], [12, 9]]) is None  # only a common grandparent, or none
    assert ptracer.nearest_common_ancestor([[11, 0], [12, 0]]) is None
    assert ptracer.nearest_common_ancestor([[11, 1], [12, 1]]) is None
    assert ptracer.nearest_common_ancestor([[11, 1], [12, 1]], init_allowed=True) == 1  # a container's own
    assert ptracer.nearest_common_ancestor([]) is None


def test_a_container_is_told_by_its_pid_namespace(tmp_path: Path) -> None:
    (tmp_path / "self").mkdir()
    status = tmp_path / "self" / "status"
    status.write_text("Name:\tpython\nNSpid:\t4242\n")
    assert not ptracer.in_child_pid_namespace(tmp_path)
    status.write_text("Name:\tpython\nNSpid:\t4242\t7\n")
    assert ptracer.in_child_pid_namespace(tmp_path)
    assert ptracer.proc_is_own()


def test_yama_scope_is_read_from_proc_and_is_zero_without_yama(tmp_path: Path) -> None:
    scope = tmp_path / "ptrace_scope"
    assert ptracer.yama_scope(scope) == 0
    scope.write_text("1\n")
    assert ptracer.yama_scope(scope) == 1


@pytest.fixture
def prctl_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    calls: list[tuple[int, int]] = []

    def prctl(option: int, value: int) -> int:
        calls.append((option, value))
        return 0

    monkeypatch.setattr(ptracer, "_prctl", prctl)
    monkeypatch.setattr(ptracer, "_declared", None)
    return calls


def test_a_later_group_never_narrows_the_declaration(
    prctl_calls: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    chain = [50, 40]  # a rank (50) whose parent (40) launched it
    monkeypatch.setattr(ptracer, "ancestry", lambda *a, **k: chain)
    monkeypatch.setattr(ptracer, "_warned", False)
    assert ptracer.declare(50, chain) == (None, None, 50)  # a subgroup launched by this rank
    assert ptracer.declare(40, chain) == (None, 50, 40)  # the whole group: its launcher is higher up
    assert ptracer.declare(50, chain) == (None, 40, 40)  # the subgroup again: 40 covers it already
    assert prctl_calls == [(ptracer._PR_SET_PTRACER, 50), (ptracer._PR_SET_PTRACER, 40)]
    assert ptracer.declared() == 40
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "declared process 50" in warnings[0]  # once per process
    ptracer.undeclare(50, 99)  # a declaration changed since (another group's): left alone
    assert ptracer.declared() == 40 and len(prctl_calls) == 2
    ptracer.undeclare(50, 40)
    ptracer.undeclare(None, 50)
    assert prctl_calls[2:] == [(ptracer._PR_SET_PTRACER, 50), (ptracer._PR_SET_PTRACER, 0)]
    assert ptracer.declared() is None


def test_a_launcher_gone_before_the_declaration_is_not_kept(
    prctl_calls: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Reparented between reading /proc and the call: the pid may now name another process.
    monkeypatch.setattr(ptracer, "ancestry", lambda *a, **k: [50, 1])
    done = ptracer.declare(40, [50, 40])
    assert done == ("process 40 is no longer this process's parent", None, None)
    assert prctl_calls == [(ptracer._PR_SET_PTRACER, 40), (ptracer._PR_SET_PTRACER, 0)]
    assert ptracer.declared() is None


def test_a_refused_prctl_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ptracer, "_declared", None)
    monkeypatch.setattr(ptracer, "_prctl", lambda option, value: errno.EINVAL)
    assert ptracer.declare(40, [50, 40]).why == "prctl(PR_SET_PTRACER, 40) failed: EINVAL"
    assert ptracer.declared() is None
    monkeypatch.setenv(ptracer.DECLARE_ENV, "off")
    assert ptracer.declare(40, [50, 40]).why == f"{ptracer.DECLARE_ENV}=0"


def test_prctl_reaches_the_kernel() -> None:
    # Without Yama the kernel rejects the option (EINVAL); with it, declaring our own parent succeeds. Undone after.
    err = ptracer._prctl(ptracer._PR_SET_PTRACER, os.getppid())
    assert err in (0, errno.EINVAL)
    if err == 0:
        assert ptracer._prctl(ptracer._PR_SET_PTRACER, 0) == 0
