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


def _play_yama(marks: Path, scope: int, helps: bool = True) -> tuple[list[int], Callable[[], None]]:
    """Patch this rank's kernel view: Yama at ``scope``; returns the ``prctl`` values it was given, and an undo."""
    calls: list[int] = []
    real = (ptracer.yama_scope, ptracer._prctl, cross_memory.read_runs, cross_memory.write_runs)

    def prctl(option: int, value: int) -> int:
        assert option == ptracer._PR_SET_PTRACER
        calls.append(value)
        (marks / str(os.getpid())).write_text(str(value))
        return 0

    def allowed(pid: int) -> bool:
        if pid == os.getpid() or scope == 0:
            return True
        mark = marks / str(pid)
        tracer = int(mark.read_text()) if mark.exists() else 0
        return helps and scope == 1 and tracer in ptracer.ancestry(depth=64)

    def guarded(copy: Callable[..., int]) -> Callable[..., int]:
        return lambda pid, runs: copy(pid, runs) if allowed(pid) else errno.EPERM

    ptracer.yama_scope = lambda path=None: scope  # type: ignore[assignment]
    ptracer._prctl = prctl  # type: ignore[assignment]
    cross_memory.read_runs = guarded(real[2])  # type: ignore[assignment]
    cross_memory.write_runs = guarded(real[3])  # type: ignore[assignment]

    def undo() -> None:
        ptracer.yama_scope, ptracer._prctl, cross_memory.read_runs, cross_memory.write_runs = real  # type: ignore[assignment]

    return calls, undo


def _moves_under_yama(marks: str, scope: int, case: str) -> dict[str, Any]:
    g = shardwise.get_default_group()
    if case == "switched off":
        os.environ[ptracer.DECLARE_ENV] = "0"
    calls, undo = _play_yama(Path(marks), scope, helps=case != "declaring does not help")
    if case == "only init in common":
        real_ancestry = ptracer.ancestry
        ptracer.ancestry = lambda pid=None, **kw: [os.getpid()]  # type: ignore[assignment]
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
            "chain": ptracer.ancestry(depth=64),
        }
    finally:
        undo()
        if case == "only init in common":
            ptracer.ancestry = real_ancestry  # type: ignore[assignment]


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_refused_by_yama_scope_1_declare_their_nearest_common_ancestor(world_size: int, tmp_path: Path) -> None:
    results = run(_moves_under_yama, world_size, str(tmp_path), 1, "refused until declared")
    ancestors = {res["declared"] for res in results}
    assert len(ancestors) == 1, results
    (ancestor,) = ancestors
    for res in results:
        assert res["used"] and res["right"], res
        assert res["prctl"] == [ancestor], res
        # The nearest one: an ancestor of this rank, and no nearer process is an ancestor of every rank.
        assert ancestor in res["chain"]
        nearer = res["chain"][: res["chain"].index(ancestor)]
        assert not any(all(pid in other["chain"] for other in results) for pid in nearer)


@pytest.mark.parametrize(
    ("scope", "case"),
    [
        (2, "refused"),  # admin-only attach: no process can lift it
        (1, "only init in common"),  # declaring init would open the ranks to every process of the user
        (1, "switched off"),
        (1, "declaring does not help"),  # refused for another reason too: the declaration is taken back
    ],
)
def test_ranks_yama_still_refuses_keep_the_backends_path(tmp_path: Path, scope: int, case: str) -> None:
    for res in run(_moves_under_yama, 2, str(tmp_path), scope, case):
        assert not res["used"] and res["right"], res
        assert res["declared"] is None
        if case == "declaring does not help":
            assert len(res["prctl"]) == 2 and res["prctl"][1] == 0, res
        else:
            assert res["prctl"] == [], res


def test_ranks_that_read_each_other_already_declare_nothing(tmp_path: Path) -> None:
    # Scope 0 (or a process allowed by its capabilities): the first reads work, nothing is declared.
    for res in run(_moves_under_yama, 2, str(tmp_path), 0, "refused until declared"):
        assert res["used"] and res["right"] and res["prctl"] == [] and res["declared"] is None, res


# -- one process -------------------------------------------------------------------


def test_the_ancestry_reads_parents_past_names_with_spaces_and_parentheses(tmp_path: Path) -> None:
    for pid, name, parent in ((40, "python (rank 1)", 30), (30, "a) b", 20), (20, "torchrun", 1)):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} ({name}) S {parent} {pid} 0 0 -1 4194560 1 0")
    assert ptracer.ancestry(40, proc=tmp_path) == [40, 30, 20]
    assert ptracer.ancestry(40, proc=tmp_path, depth=2) == [40, 30]
    assert ptracer.ancestry(99, proc=tmp_path) == [99]  # an unreadable parent ends the chain
    mine = ptracer.ancestry()
    assert mine[:2] == [os.getpid(), os.getppid()] or mine == [os.getpid()]


def test_the_nearest_common_ancestor_is_shared_by_every_chain_and_never_init() -> None:
    assert ptracer.nearest_common_ancestor([[11, 10, 5, 2], [12, 10, 5, 2], [13, 9, 5, 2]]) == 5
    assert ptracer.nearest_common_ancestor([[11, 10, 0, 0], [12, 10, 0, 0]]) == 10
    assert ptracer.nearest_common_ancestor([[11, 10], [10, 3]]) == 10  # a rank that launched another
    assert ptracer.nearest_common_ancestor([[11, 1], [12, 1]]) is None
    assert ptracer.nearest_common_ancestor([[11, 10], [12, 9]]) is None
    assert ptracer.nearest_common_ancestor([]) is None


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


def test_a_later_group_never_narrows_the_declaration(prctl_calls: list[tuple[int, int]]) -> None:
    chain = [50, 40, 30, 20]
    assert ptracer.declare(40, chain) is None
    assert ptracer.declare(30, chain) is None  # a larger group: its launcher is higher up
    assert ptracer.declare(40, chain) is None  # a subgroup's nearer ancestor: 30 covers it already
    assert ptracer.declare(30, chain) is None
    assert prctl_calls == [(ptracer._PR_SET_PTRACER, 40), (ptracer._PR_SET_PTRACER, 30)]
    assert ptracer.declared() == 30
    ptracer.undeclare(40)
    ptracer.undeclare(None)
    assert prctl_calls[2:] == [(ptracer._PR_SET_PTRACER, 40), (ptracer._PR_SET_PTRACER, 0)]
    assert ptracer.declared() is None


def test_a_refused_prctl_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ptracer, "_declared", None)
    monkeypatch.setattr(ptracer, "_prctl", lambda option, value: errno.EINVAL)
    assert ptracer.declare(40, [50, 40]) == "prctl(PR_SET_PTRACER, 40) failed: EINVAL"
    assert ptracer.declared() is None
    monkeypatch.setenv(ptracer.DECLARE_ENV, "off")
    assert ptracer.declare(40, [50, 40]) == f"{ptracer.DECLARE_ENV}=0"


def test_prctl_reaches_the_kernel() -> None:
    # Without Yama the kernel rejects the option (EINVAL); with it, declaring our own parent succeeds. Undone after.
    err = ptracer._prctl(ptracer._PR_SET_PTRACER, os.getppid())
    assert err in (0, errno.EINVAL)
    if err == 0:
        assert ptracer._prctl(ptracer._PR_SET_PTRACER, 0) == 0
