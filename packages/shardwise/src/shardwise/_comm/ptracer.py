"""Yama's ``ptrace_scope`` 1: letting the ranks of one launch read each other's memory.

Why: one copy between ranks on a host (:mod:`shardwise._comm.local_copy`)
reads and writes a peer's memory with ``process_vm_readv``/``writev``, which
the kernel allows only where it would allow ``ptrace``. Under Yama's
``ptrace_scope`` 1 (the default of Ubuntu and of many other distributions) a
process may attach only to its own descendants, or to a process that
declared it (or one of its ancestors) its tracer with
``prctl(PR_SET_PTRACER)``. Sibling ranks are neither, so on such a host every
group would keep the backend's two copies.

What: when a group's reads are refused there, each rank declares the
nearest process that is an ancestor of every rank of the group (the
launcher: torchrun's agent, mpiexec's proxy, ``slurmstepd``, the harness).
That lets exactly the launcher and its descendants read the rank, no wider:
``PR_SET_PTRACER_ANY`` would let any process of the user read it, and so
would declaring init, so ranks whose only common ancestor is init are not
declared. A process holds one declaration; a later group's never narrows an
earlier one (the higher of the two ancestors is kept). Scopes 2 and 3 cannot
be lifted by a process and keep the backend's path.
``SHARDWISE_DECLARE_PTRACER=0`` keeps the ranks undeclared.
"""

from __future__ import annotations

import ctypes
import errno as errno_module
import logging
import os
from pathlib import Path
from typing import Optional, Sequence

from shardwise._vocab.switches import switched_on

__all__ = [
    "ANCESTRY_DEPTH",
    "DECLARE_ENV",
    "ancestry",
    "declare",
    "declared",
    "nearest_common_ancestor",
    "undeclare",
    "yama_scope",
]

DECLARE_ENV = "SHARDWISE_DECLARE_PTRACER"
#: How many of a rank's ancestors (itself first) it publishes; launchers sit one to three levels up.
ANCESTRY_DEPTH = 8
#: ``prctl``'s option number (``"Yama"`` in ASCII), from ``<linux/prctl.h>``.
_PR_SET_PTRACER = 0x59616D61

_PROC = Path("/proc")
_SCOPE = Path("/proc/sys/kernel/yama/ptrace_scope")

_log = logging.getLogger("shardwise.comm")

#: The ancestor this process declared its tracer (None: none declared by shardwise).
_declared: Optional[int] = None


def yama_scope(path: Path = _SCOPE) -> int:
    """Yama's ``ptrace_scope`` on this host; 0 where Yama is absent (the kernel's classic ptrace rules)."""
    try:
        return int(path.read_text().strip() or 0)
    except (OSError, ValueError):
        return 0


def _parent(pid: int, proc: Path) -> int:
    """``pid``'s parent from ``/proc/<pid>/stat`` (0 when unreadable); the name before it may hold spaces and ')'."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
        return int(stat[stat.rindex(")") + 1 :].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def ancestry(pid: Optional[int] = None, *, proc: Path = _PROC, depth: int = ANCESTRY_DEPTH) -> list[int]:
    """``pid`` (this process by default) and its ancestors, nearest first, at most ``depth``, init excluded."""
    chain: list[int] = []
    current = os.getpid() if pid is None else pid
    while current > 1 and len(chain) < depth:
        chain.append(current)
        current = _parent(current, proc)
    return chain


def nearest_common_ancestor(chains: Sequence[Sequence[int]]) -> Optional[int]:
    """The first process of the first chain that is in every chain (a process counts as its own ancestor).

    Args:
        chains: Each rank's :func:`ancestry` (zeros allowed as padding).

    Returns:
        The nearest shared ancestor, or None when the chains share none but
        init (or are empty).
    """
    if not chains:
        return None
    others = [set(chain) for chain in chains[1:]]
    return next((pid for pid in chains[0] if pid > 1 and all(pid in chain for chain in others)), None)


def _prctl(option: int, value: int) -> int:
    """``prctl(option, value, 0, 0, 0)``; 0 or the error number."""
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.prctl
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return 0 if fn(option, value, 0, 0, 0) == 0 else ctypes.get_errno()


def declare(ancestor: int, chain: Sequence[int]) -> Optional[str]:
    """Declare ``ancestor`` this process's tracer, never narrowing an earlier declaration of shardwise's.

    Args:
        ancestor: The group's nearest common ancestor, one of ``chain``.
        chain: This process's :func:`ancestry`.

    Returns:
        None once declared, else why not (the switch, or ``prctl``'s error).
    """
    global _declared
    if not switched_on(DECLARE_ENV):
        return f"{DECLARE_ENV}=0"
    if _declared is not None and _declared in chain and chain.index(_declared) > chain.index(ancestor):
        ancestor = _declared  # already declared higher up: it covers this group's ranks too
    if ancestor == _declared:
        return None
    err = _prctl(_PR_SET_PTRACER, ancestor)
    if err:
        return f"prctl(PR_SET_PTRACER, {ancestor}) failed: {errno_module.errorcode.get(err, str(err))}"
    _log.info(
        "declared process %d (an ancestor of every rank of the group) this process's tracer, so that the ranks may "
        "read each other's memory under Yama's ptrace_scope 1 (%s=0 does not)",
        ancestor,
        DECLARE_ENV,
    )
    _declared = ancestor
    return None


def undeclare(previous: Optional[int]) -> None:
    """Restore the declaration ``previous`` (None: no tracer), after one that did not make the reads work."""
    global _declared
    if _declared == previous:
        return
    _prctl(_PR_SET_PTRACER, previous or 0)
    _declared = previous


def declared() -> Optional[int]:
    """The ancestor this process declared its tracer (None: none)."""
    return _declared
