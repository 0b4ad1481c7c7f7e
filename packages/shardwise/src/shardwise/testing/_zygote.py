"""A process that has imported torch and shardwise once, and forks the ranks of :func:`run_ranks` from there.

A rank started as ``python -m shardwise.testing._worker`` spends most of a
short test importing torch (one to two seconds of CPU per rank); a test
suite of hundreds of multi-rank tests on a small machine spends most of its
time there. A rank forked from this process starts with those modules
loaded and otherwise runs exactly as the spawned one does
(:func:`shardwise.testing._worker.main`, in a session of its own, with the
environment and output file the harness gives it).

Forking is safe here because this process stays single-threaded and runs no
torch operation: a fork copies only the calling thread, and OpenMP's thread
pool does not survive one. It only imports, then waits on a Unix socket.
Variables read while torch loads (``OMP_NUM_THREADS`` and the like) come
from this process's environment, so the harness keeps one zygote per set of
them (``IMPORT_TIME_PREFIXES`` in :mod:`shardwise.testing._harness`).

Protocol, one connection per rank: the harness sends one JSON line
``{"spec": PATH, "env": {...}, "log": PATH, "cwd": DIR}``; the zygote answers
``{"pid": N}`` once it has forked, ``{"exit": CODE}`` when that rank ends
(``-SIGNAL`` if a signal ended it, as ``Popen.returncode`` reads), and
closes the connection. The zygote exits when the process that started it
does.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import sys
from typing import Any, NoReturn

# What every rank would import first, loaded once here and inherited by every fork. This module is
# only ever run as a program (``python -m``), so these imports cost the harness nothing.
import torch  # noqa: F401
import torch.distributed  # noqa: F401

from shardwise.testing import _worker

__all__ = ["serve"]


def _rank(request: dict[str, Any], inherited: list[socket.socket], selector: selectors.BaseSelector) -> NoReturn:
    """In the forked child: become the rank the harness asked for, and exit with its status."""
    selector.close()
    for sock in inherited:  # the listener and every rank's connection: the harness must see them close
        sock.close()
    os.setsid()  # as start_new_session: the harness kills the rank by its process group
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    out = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    # SystemExit, not os._exit: the interpreter then runs the rank's exit handlers and flushes its output.
    raise SystemExit(_worker.main(request["spec"]))


def _exit_code(status: int) -> int:
    return os.waitstatus_to_exitcode(status)


def serve(path: str) -> None:
    """Preload, listen on the Unix socket ``path``, fork a rank per request until the parent exits."""
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # the harness waits for this name: the zygote is ready
    waiting: dict[int, socket.socket] = {}
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    while os.getppid() == parent:
        for _ in selector.select(timeout=0.05):
            conn, _ = listener.accept()
            conn.settimeout(10)
            with conn.makefile("r") as lines:
                request = json.loads(lines.readline())
            pid = os.fork()
            if pid == 0:
                _rank(request, [listener, conn, *waiting.values()], selector)
            waiting[pid] = conn
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        while waiting:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            reply = waiting.pop(pid, None)
            if reply is not None:
                try:
                    reply.sendall(json.dumps({"exit": _exit_code(status)}).encode() + b"\n")
                except OSError:
                    pass  # the harness stopped listening (it killed the rank and moved on)
                reply.close()


if __name__ == "__main__":
    serve(sys.argv[1])
