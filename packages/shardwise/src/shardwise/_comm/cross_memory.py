"""The system calls of cross-memory attach: ``process_vm_readv`` and ``process_vm_writev``.

What it holds: libc's two calls, loaded on first use (no import-time side
effects); :func:`read_runs` and :func:`write_runs`, which copy a table of
``(local address, remote address, bytes)`` runs (:func:`runs`) between this
process and another by iovec lists of up to ``IOV_MAX`` entries a side, runs
that continue one another merged into one iovec, partial copies resumed at
the first byte not copied; :func:`strerror`, what a failed copy's error
number reads as; and :func:`probe`, run once per process, which reads and
writes this process's own memory to learn whether the kernel allows the
calls at all. When and how a group uses them: :mod:`shardwise._comm.local_copy`.
"""

from __future__ import annotations

import ctypes
import errno as errno_module
import os
import sys
from typing import Callable, Optional, Sequence, cast

import torch

__all__ = ["probe", "read_runs", "runs", "strerror", "write_runs"]

#: Most iovecs one ``process_vm_readv`` takes (Linux's ``UIO_MAXIOV``).
_IOV_MAX = 1024

_readv: Optional[Callable[..., int]] = None
_writev: Optional[Callable[..., int]] = None
#: The probe's answer: None before it ran, "" when the syscall works, else why not.
_probed: Optional[str] = None


def _syscall(name: str) -> Callable[..., int]:
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, name)
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    return cast(Callable[..., int], fn)


def _load() -> Callable[..., int]:
    """libc's ``process_vm_readv``, loaded on first use (no import-time side effects)."""
    global _readv
    if _readv is None:
        _readv = _syscall("process_vm_readv")
    return _readv


def _load_writev() -> Callable[..., int]:
    """libc's ``process_vm_writev``, loaded on first use."""
    global _writev
    if _writev is None:
        _writev = _syscall("process_vm_writev")
    return _writev


def probe() -> Optional[str]:
    """Why this process cannot use ``process_vm_readv`` (None: it can), found once by reading its own memory.

    Reading a peer may still be refused (Yama's ``ptrace_scope``); the
    per-group check reads from the peers themselves.
    """
    global _probed
    if _probed is None:
        if not sys.platform.startswith("linux"):
            _probed = f"cross-memory attach is Linux only (this is {sys.platform})"
        else:
            try:
                src, dst = (
                    torch.arange(4, dtype=torch.int64, device="cpu"),
                    torch.zeros(4, dtype=torch.int64, device="cpu"),
                )
                err = read_runs(os.getpid(), runs([dst.data_ptr()], [src.data_ptr()], [32]))
                ok = err == 0 and torch.equal(src, dst)
                _probed = "" if ok else f"process_vm_readv failed: {strerror(err)}"
                if ok:
                    # Layout changes also write into peers (box_moves): a seccomp filter may allow one call only.
                    back = torch.zeros(4, dtype=torch.int64, device="cpu")
                    err = write_runs(os.getpid(), runs([src.data_ptr()], [back.data_ptr()], [32]))
                    ok = err == 0 and torch.equal(src, back)
                    _probed = "" if ok else f"process_vm_writev failed: {strerror(err)}"
            except (OSError, AttributeError) as exc:  # no libc, or a libc without the symbol
                _probed = f"process_vm_readv is unavailable: {exc}"
    return _probed or None


def strerror(err: int) -> str:
    """A copy's error number as its name and meaning (``ESRCH (No such process)``); 0: a copy that stopped short."""
    return f"{errno_module.errorcode.get(err, str(err))} ({os.strerror(err)})" if err else "short read"


# -- copying ---------------------------------------------------------------------


def runs(local: Sequence[int], remote: Sequence[int], nbytes: Sequence[int]) -> torch.Tensor:
    """An ``(n, 3)`` int64 table of (local address, remote address, bytes), dropping empty runs."""
    table = torch.tensor([list(local), list(remote), list(nbytes)], dtype=torch.int64, device="cpu").t()
    return table[table[:, 2] > 0] if table.numel() else table.reshape(0, 3)


def _segments(addr: torch.Tensor, nbytes: torch.Tensor) -> torch.Tensor:
    """``(addr, nbytes)`` runs as an ``(m, 2)`` iovec table, runs that continue one another merged."""
    if addr.shape[0] > 1:
        starts = addr[1:] != addr[:-1] + nbytes[:-1]
        # Small tables are the common case, and each tensor op costs microseconds: merge only when some run
        # continues the one before.
        if not bool(starts.all()):
            starts = torch.cat([torch.ones(1, dtype=torch.bool, device="cpu"), starts])
            which = starts.cumsum(0) - 1
            lengths = torch.zeros(int(which[-1]) + 1, dtype=torch.int64, device="cpu").index_add_(0, which, nbytes)
            return torch.stack([addr[starts], lengths], dim=1)
    return torch.stack([addr, nbytes], dim=1)


def _window(segs: torch.Tensor, ends: torch.Tensor, begin: int, end: int) -> torch.Tensor:
    """The iovecs of ``segs`` (cumulative byte ``ends``) that cover stream bytes ``[begin, end)``, trimmed to them."""
    first = int(torch.searchsorted(ends, begin, right=True))
    last = int(torch.searchsorted(ends, end, right=False))
    out = segs[first : last + 1].clone()
    skip = begin - (int(ends[first - 1]) if first else 0)
    out[0, 0] += skip
    out[0, 1] -= skip
    out[-1, 1] -= int(ends[last]) - end
    return out


def read_runs(pid: int, runs: torch.Tensor) -> int:
    """Copy every run of ``runs`` from process ``pid``'s memory into ours; 0, or the errno of the failed read.

    ``runs`` holds ``(local address, remote address, bytes)`` rows (see :func:`_stream`).
    """
    return _stream(_load(), pid, runs)


def write_runs(pid: int, runs: torch.Tensor) -> int:
    """Copy every run of ``runs`` from our memory into process ``pid``'s; 0, or the errno of the failed write.

    ``runs`` holds ``(local address, remote address, bytes)`` rows: the local side is the source here.
    """
    return _stream(_load_writev(), pid, runs)


def _stream(fn: Callable[..., int], pid: int, runs: torch.Tensor) -> int:
    """Copy every run of ``runs`` between this process and ``pid`` with ``fn`` (readv or writev); 0, or an errno.

    Runs that continue one another on one side become one iovec there
    (the other side may stay split): the kernel pins remote memory iovec by
    iovec, and a box whose rows are back to back in the peer's shard but
    strided in ours (or the reverse) reads about twice as fast so. Both
    sides are one stream of bytes, cut into calls of at most ``_IOV_MAX``
    iovecs a side; a partial read resumes at the first byte not read.
    """
    total = int(runs[:, 2].sum()) if runs.shape[0] else 0
    if total == 0:
        return 0
    local, remote = _segments(runs[:, 0], runs[:, 2]), _segments(runs[:, 1], runs[:, 2])
    done = 0
    if local.shape[0] <= _IOV_MAX and remote.shape[0] <= _IOV_MAX:
        # Both sides fit one call (the common case): no windows to cut. A partial copy resumes below.
        done = fn(pid, local.data_ptr(), local.shape[0], remote.data_ptr(), remote.shape[0], 0)
        if done <= 0:
            return (ctypes.get_errno() or errno_module.EIO) if done < 0 else errno_module.EFAULT
        if done == total:
            return 0
    local_ends, remote_ends = local[:, 1].cumsum(0), remote[:, 1].cumsum(0)
    while done < total:
        # The call stops where either side runs out of iovecs.
        first_l = int(torch.searchsorted(local_ends, done, right=True))
        first_r = int(torch.searchsorted(remote_ends, done, right=True))
        end = min(
            int(local_ends[min(first_l + _IOV_MAX, local.shape[0]) - 1]),
            int(remote_ends[min(first_r + _IOV_MAX, remote.shape[0]) - 1]),
        )
        lv, rv = _window(local, local_ends, done, end), _window(remote, remote_ends, done, end)
        got = fn(pid, lv.data_ptr(), lv.shape[0], rv.data_ptr(), rv.shape[0], 0)
        if got < 0:
            return ctypes.get_errno() or errno_module.EIO
        if got == 0:
            return errno_module.EFAULT
        done += got
    return 0
