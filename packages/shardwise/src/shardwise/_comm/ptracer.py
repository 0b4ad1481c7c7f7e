"""Yama's ``ptrace_scope`` 1: letting the ranks of one launch read each other's memory.

Why: one copy between ranks on a host (:mod:`shardwise._comm.local_copy`)
reads and writes a peer's memory with ``process_vm_readv``/``writev``, which
the kernel allows only where it would allow ``ptrace``. Under Yama's
``ptrace_scope`` 1 (the default of Ubuntu and of many other distributions) a
process may attach only to its own descendants, or to a process that
declared it (or one of its ancestors) its tracer with
``prctl(PR_SET_PTRACER)``. Sibling ranks are neither, so on such a host every
group would keep the backend's two copies.

What: when a group's reads are refused there, each rank declares its
group's launcher its tracer: the one process that is the parent of every
rank (torchrun's agent, mpiexec's proxy, ``slurmstepd``, ``mp.spawn``'s
parent), or a rank that is the parent of all the others. That lets exactly
that process and its descendants attach to the rank, for as long as both
live, and no wider: ``PR_SET_PTRACER_ANY`` would let any process of the
user attach. A common ancestor further up (an interactive shell's parent,
``sshd``, a tmux server, ``systemd --user``) is never declared, since it
holds other work of the user; nor is init, except a container's own
(``docker run ... torchrun``: its PID namespace holds the job). A process
holds one declaration, which replaces any the program made itself; a later
group's never narrows an earlier one of shardwise's (the higher of the two
is kept), and one that does not make the reads work is taken back. Scopes 2
and 3 cannot be lifted by a process and keep the backend's path.
``SHARDWISE_DECLARE_PTRACER=0`` keeps the ranks undeclared.
"""

from __future__ import annotations

import ctypes
import errno as errno_module
import logging
import os
import threading
from pathlib import Path
from typing import NamedTuple, Optional, Sequence

from shardwise._vocab.switches import switched_on

__all__ = [
    "ANCESTRY_DEPTH",
    "DECLARE_ENV",
    "Declared",
    "ancestry",
    "declare",
    "declared",
    "in_child_pid_namespace",
    "nearest_common_ancestor",
    "proc_is_own",
    "undeclare",
    "yama_scope",
]

DECLARE_ENV = "SHARDWISE_DECLARE_PTRACER"
#: How much of a rank's ancestry it publishes: itself and its parent (the only launcher declared).
ANCESTRY_DEPTH = 2
#: ``prctl``'s option number (``"Yama"`` in ASCII), from ``<linux/prctl.h>``.
_PR_SET_PTRACER = 0x59616D61

_PROC = Path("/proc")
_SCOPE = Path("/proc/sys/kernel/yama/ptrace_scope")

_log = logging.getLogger("shardwise.comm")

#: The ancestor this process declared its tracer (None: none declared by shardwise).
_declared: Optional[int] = None
#: Guards :data:`_declared` and the declaration: groups may agree their verdicts on several threads at once.
_lock = threading.Lock()
#: Whether the declaration was logged at WARNING (once per process).
_warned = False


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
    """``pid`` (this process by default) and its ancestors, nearest first, at most ``depth``.

    The chain ends early at pid 0 or at a parent that cannot be read; init
    (pid 1) is included, :func:`nearest_common_ancestor` decides about it.
    """
    chain: list[int] = []
    current = os.getpid() if pid is None else pid
    while current > 0 and len(chain) < depth:
        chain.append(current)
        current = _parent(current, proc)
    return chain


def proc_is_own() -> bool:
    """Whether ``/proc`` shows this process's PID namespace (else pids read there name other processes)."""
    try:
        return os.readlink(_PROC / "self") == str(os.getpid())
    except OSError:
        return False


def in_child_pid_namespace(proc: Path = _PROC) -> bool:
    """Whether this process runs in a PID namespace below the host's (a container), whose init is its own."""
    try:
        for line in (proc / "self" / "status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return len(line.split()) > 2
    except OSError:
        pass
    return False


def nearest_common_ancestor(chains: Sequence[Sequence[int]], *, init_allowed: bool = False) -> Optional[int]:
    """The first process of the first chain that is in every chain (a process counts as its own ancestor).

    Args:
        chains: Each rank's :func:`ancestry` (zeros allowed as padding).
        init_allowed: Whether pid 1 may be the answer (a container's own init).

    Returns:
        The nearest shared ancestor, or None when the chains share none
        (init aside, unless allowed), or are empty.
    """
    if not chains:
        return None
    lowest = 1 if init_allowed else 2
    others = [set(chain) for chain in chains[1:]]
    return next((pid for pid in chains[0] if pid >= lowest and all(pid in chain for chain in others)), None)


def _prctl(option: int, value: int) -> int:
    """``prctl(option, value, 0, 0, 0)``; 0 or the error number."""
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.prctl
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return 0 if fn(option, value, 0, 0, 0) == 0 else ctypes.get_errno()


class Declared(NamedTuple):
    """What :func:`declare` did: why it did not (None: it did), and the declaration before and after it."""

    why: Optional[str]
    before: Optional[int]
    after: Optional[int]


def declare(ancestor: int, chain: Sequence[int]) -> Declared:
    """Declare ``ancestor`` this process's tracer, never narrowing an earlier declaration of shardwise's.

    Args:
        ancestor: The group's launcher, one of ``chain``.
        chain: This process's :func:`ancestry`.

    Returns:
        Why not (None once declared: the switch, ``prctl``'s error, or the
        ancestor gone meanwhile), and the declarations before and after this
        call, for :func:`undeclare`.
    """
    global _declared, _warned
    with _lock:
        before = _declared
        if not switched_on(DECLARE_ENV):
            return Declared(f"{DECLARE_ENV}=0", before, before)
        if _declared is not None and _declared in chain and chain.index(_declared) > chain.index(ancestor):
            ancestor = _declared  # already declared higher up: it covers this group's ranks too
        if ancestor == _declared:
            return Declared(None, before, before)
        err = _prctl(_PR_SET_PTRACER, ancestor)
        if err:
            why = f"prctl(PR_SET_PTRACER, {ancestor}) failed: {errno_module.errorcode.get(err, str(err))}"
            return Declared(why, before, before)
        if ancestor not in ancestry():
            # It died between reading /proc and the call, and its pid may now name another process.
            _prctl(_PR_SET_PTRACER, before or 0)
            return Declared(f"process {ancestor} is no longer this process's parent", before, before)
        _declared = ancestor
        if not _warned:
            _warned = True
            _log.warning(
                "Yama's ptrace_scope is 1: declared process %d (%s), the parent of every rank of the group on this "
                "host, this process's tracer (prctl PR_SET_PTRACER), so that the ranks may copy from each other's "
                "memory; it and its descendants may now attach to this process. %s=0 does not declare it",
                ancestor,
                _name(ancestor),
                DECLARE_ENV,
            )
        return Declared(None, before, ancestor)


def undeclare(previous: Optional[int], mine: Optional[int]) -> None:
    """Restore the declaration ``previous`` after one (``mine``) that did not make the reads work.

    Nothing is done when the declaration changed since (another group's,
    which may rely on it) or this call made none.
    """
    global _declared
    with _lock:
        if _declared != mine or mine == previous:
            return
        _prctl(_PR_SET_PTRACER, previous or 0)
        _declared = previous


def declared() -> Optional[int]:
    """The ancestor this process declared its tracer (None: none)."""
    return _declared


def _name(pid: int) -> str:
    """A process's command name, for the log ("?" when unreadable)."""
    try:
        return (_PROC / str(pid) / "comm").read_text().strip()
    except OSError:
        return "?"
