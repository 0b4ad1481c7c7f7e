"""The parent side of :func:`run_ranks`."""

from __future__ import annotations

import atexit
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

from shardwise._vocab.switches import switched_on
from shardwise.testing._launchers import find_mpiexec, launcher_free_env, mpiexec_kind

__all__ = ["RankError", "current_rank_dir", "find_mpiexec", "launcher_free_env", "mpiexec_kind", "run_ranks"]

#: After one rank fails, how long the others get to fail on their own
#: (their collectives notice the dead peer) before they are killed.
GRACE_SECONDS = 10.0
_LOG_TAIL = 60
#: ``0`` starts every rank of launcher "spawn" as a new interpreter instead of forking it from a zygote.
FORK_ENV = "SHARDWISE_TESTING_FORK"
#: Seconds a zygote may take to import torch and shardwise before the harness spawns instead.
_ZYGOTE_START_TIMEOUT = 120.0
#: Variables that take effect when torch and its libraries load: a rank whose values of them
#: differ from a zygote's is forked from another zygote, started with its values.
IMPORT_TIME_PREFIXES = ("OMP_", "MKL_", "KMP_", "GOMP_", "TORCH_", "PYTORCH_", "CUDA_", "LD_", "PYTHON")


@dataclass(frozen=True)
class RankOutcome:
    """How one rank ended."""

    rank: int
    exitcode: Optional[int]
    traceback: str
    log_tail: str
    hung: bool


class RankError(AssertionError):
    """One or more ranks failed, or the run timed out.

    Attributes:
        outcomes: How each rank ended, in rank order.
        timed_out: True when the run hit its timeout.
    """

    def __init__(self, message: str, outcomes: Sequence[RankOutcome], timed_out: bool) -> None:
        super().__init__(message)
        self.outcomes = list(outcomes)
        self.timed_out = timed_out

    def traceback_of(self, rank: int) -> str:
        """The traceback rank ``rank`` reported ("" if it did not fail)."""
        return self.outcomes[rank].traceback


def current_rank_dir() -> Path:
    """Inside ``run_ranks``: a directory shared by all ranks of this run."""
    return Path(os.environ["SHARDWISE_TESTING_DIR"])


def _fn_ref(fn: Callable[..., Any]) -> tuple[str, str]:
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module or not qualname or module == "__main__" or "<locals>" in qualname:
        raise ValueError(
            f"run_ranks needs a function importable by module and name; {fn!r} is not "
            "(define it at module level in an importable module)"
        )
    return module, qualname


def _tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return ""
    return "\n".join(lines[-_LOG_TAIL:])


def _start_store() -> Any:
    # The parent hosts the rendezvous store on a port the OS picks and
    # keeps it open for the whole run, so concurrent runs never collide on
    # a port and no rank races another to bind it (ranks connect as
    # clients, as under torchrun's agent store). torch.distributed is
    # imported here, not at the top: the harness module is imported by
    # every test, and only a run that rendezvouses needs it.
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    backend: Optional[str] = "gloo",
    args: Sequence[Any] = (),
    kwargs: Optional[Mapping[str, Any]] = None,
    timeout: float = 120.0,
    init_timeout: Optional[float] = None,
    env: Optional[Mapping[str, str]] = None,
    launcher: str = "spawn",
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` new processes.

    Args:
        fn: A module-level function; it runs after ``shardwise.init``.
        world_size: Number of ranks.
        backend: Backend passed to ``shardwise.init``; None to let ``fn``
            initialise (or not) by itself.
        args: Positional arguments (pickled to the children).
        kwargs: Keyword arguments (pickled to the children).
        timeout: Seconds the whole run may take before every rank's stack
            is dumped and the ranks are killed.
        init_timeout: Collective timeout for ``shardwise.init``; default a
            little under ``timeout`` so ranks report their own errors first.
        env: Extra environment variables for every rank.
        launcher: ``"spawn"`` (one process per rank, torchrun's variables
            set by the harness; forked from a process that imported torch
            and shardwise once, which saves each rank the seconds of
            importing them, or a new interpreter per rank with
            ``SHARDWISE_TESTING_FORK=0`` or where there is no ``fork``),
            ``"torchrun"`` (a real
            ``python -m torch.distributed.run``) or ``"mpiexec"`` (a real
            ``mpiexec -n world_size``, see :func:`find_mpiexec`).

    Returns:
        Every rank's return value, in rank order.

    Raises:
        RankError: a rank raised or crashed, or the run timed out; the
            message holds each failing rank's traceback and log tail.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if launcher not in ("spawn", "torchrun", "mpiexec"):
        raise ValueError(f"launcher must be 'spawn', 'torchrun' or 'mpiexec', got {launcher!r}")
    module, qualname = _fn_ref(fn)
    if init_timeout is None:
        init_timeout = max(timeout * 0.75, timeout - 15.0)
    with tempfile.TemporaryDirectory(prefix="shardwise-ranks-") as tmp:
        workdir = Path(tmp)
        spec = {
            "module": module,
            "qualname": qualname,
            "args": tuple(args),
            "kwargs": dict(kwargs or {}),
            "sys_path": list(sys.path),
            "backend": backend,
            "init_timeout": init_timeout,
        }
        (workdir / "spec.pkl").write_bytes(pickle.dumps(spec))
        base_env = dict(os.environ)
        base_env.update(
            {
                "SHARDWISE_TESTING_DIR": str(workdir),
                "PYTHONUNBUFFERED": "1",
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            }
        )
        base_env.update(env or {})
        worker = [sys.executable, "-m", "shardwise.testing._worker", str(workdir / "spec.pkl")]
        store = None
        procs: list[_Proc]
        if launcher == "spawn":
            store = _start_store()
            procs = []
            for rank in range(world_size):
                rank_env = dict(base_env)
                rank_env.update(
                    {
                        "RANK": str(rank),
                        "WORLD_SIZE": str(world_size),
                        "LOCAL_RANK": str(rank),
                        "LOCAL_WORLD_SIZE": str(world_size),
                        "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(store.port),
                        "TORCHELASTIC_USE_AGENT_STORE": "True",
                    }
                )
                procs.append(_start_rank(worker, rank_env, workdir / f"launcher_{rank}.txt"))
        elif launcher == "torchrun":
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={world_size}",
                *worker[1:],
            ]
            procs = [_popen(cmd, base_env, workdir / "launcher.txt")]
        else:
            # Open MPI refuses to start as root without these; MPICH ignores them.
            base_env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
            base_env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            cmd = [find_mpiexec(), "-n", str(world_size), *worker]
            procs = [_popen(cmd, base_env, workdir / "launcher.txt")]
        try:
            return _wait(procs, world_size, workdir, timeout)
        finally:
            for proc in procs:
                _kill(proc)
            del store


class _Proc(Protocol):
    """What the harness uses of a rank's process: ``subprocess.Popen`` or :class:`_ForkedRank`."""

    pid: int
    returncode: Optional[int]

    def poll(self) -> Optional[int]: ...

    def wait(self, timeout: Optional[float] = None) -> int: ...


def _popen(cmd: list[str], env: Mapping[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, env=dict(env), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


class _ForkedRank:
    """A rank a zygote forked (:mod:`shardwise.testing._zygote`): its pid, and its exit status once reported."""

    def __init__(self, conn: socket.socket, pid: int, pending: bytes = b"") -> None:
        self._conn = conn
        self._pending = pending
        self.pid = pid
        self.returncode: Optional[int] = None
        conn.setblocking(False)

    def poll(self) -> Optional[int]:
        if self.returncode is not None:
            return self.returncode
        if b"\n" not in self._pending:
            try:
                data = self._conn.recv(4096)
            except BlockingIOError:
                return None
            except OSError:
                data = b""
            if not data:
                # The zygote went away without a word: the rank cannot be waited for any more.
                self.returncode = -signal.SIGKILL
            self._pending += data
        if b"\n" in self._pending:
            self.returncode = int(json.loads(self._pending.split(b"\n", 1)[0])["exit"])
        if self.returncode is not None:
            self._conn.close()
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout or 0.0)
            time.sleep(0.01)
        return code


# One zygote per set of import-time variables: (its process, its socket path). Runs in threads share them.
_zygotes: dict[tuple[tuple[str, str], ...], tuple[subprocess.Popen[bytes], str]] = {}
_zygotes_lock = threading.Lock()


def _zygote_socket(env: Mapping[str, str]) -> Optional[str]:
    """The socket of a ready zygote for ranks with environment ``env``, started if need be; None: spawn instead."""
    if not hasattr(os, "fork") or not switched_on(FORK_ENV):
        return None
    key = tuple(sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES)))
    with _zygotes_lock:
        return _zygote_for(key, env)


def _zygote_for(key: tuple[tuple[str, str], ...], env: Mapping[str, str]) -> Optional[str]:
    running = _zygotes.get(key)
    if running is not None and running[0].poll() is None:
        return running[1]
    home = tempfile.mkdtemp(prefix="shardwise-zygote-")
    path = os.path.join(home, "sock")
    with open(os.path.join(home, "zygote.log"), "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "shardwise.testing._zygote", path],
            env=dict(env), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
    atexit.register(_stop_zygote, proc, home)
    deadline = time.monotonic() + _ZYGOTE_START_TIMEOUT
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop_zygote(proc, home)
            return None
        time.sleep(0.02)
    _zygotes[key] = (proc, path)
    return path


def _stop_zygote(proc: subprocess.Popen[bytes], home: str) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    shutil.rmtree(home, ignore_errors=True)


def _start_rank(worker: list[str], env: Mapping[str, str], log: Path) -> _Proc:
    """Start one rank of launcher "spawn": forked from a zygote where one can serve it, else a new interpreter."""
    path = _zygote_socket(env)
    if path is not None:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.settimeout(30)
            conn.connect(path)
            request = {"spec": worker[-1], "env": dict(env), "log": str(log), "cwd": os.getcwd()}
            conn.sendall(json.dumps(request).encode() + b"\n")
            received = b""
            while b"\n" not in received:
                chunk = conn.recv(4096)
                if not chunk:
                    raise OSError("the zygote closed the connection")
                received += chunk
            line, rest = received.split(b"\n", 1)
            # A rank that ends at once may have its exit status in the same read: keep it for poll().
            return _ForkedRank(conn, int(json.loads(line)["pid"]), rest)
        except (OSError, ValueError, KeyError):
            conn.close()  # the zygote failed: this rank (and later ones, if it is gone) start the plain way
    return _popen(worker, env, log)


def _kill(proc: _Proc) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def _dump_stacks(workdir: Path, ranks: Sequence[int]) -> None:
    for rank in ranks:
        pid_file = workdir / f"pid_{rank}"
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGUSR1)
            except (ProcessLookupError, ValueError):
                pass
    time.sleep(0.5)


def _wait(procs: Sequence[_Proc], world_size: int, workdir: Path, timeout: float) -> list[Any]:
    deadline = time.monotonic() + timeout
    failed_at: Optional[float] = None
    timed_out = False

    def done(rank: int) -> bool:
        return (workdir / f"result_{rank}.pkl").exists() or (workdir / f"error_{rank}.txt").exists()

    while True:
        running = [p for p in procs if p.poll() is None]
        if not running:
            break
        failures = any((workdir / f"error_{r}.txt").exists() for r in range(world_size)) or any(
            p.returncode not in (None, 0) for p in procs
        )
        now = time.monotonic()
        if failures and failed_at is None:
            failed_at = now
        if failed_at is not None and now - failed_at > GRACE_SECONDS:
            break
        if now > deadline:
            timed_out = True
            break
        time.sleep(0.05)
    hung = [r for r in range(world_size) if not done(r)]
    if any(p.poll() is None for p in procs):
        _dump_stacks(workdir, hung)
        for proc in procs:
            _kill(proc)
    results: list[Any] = []
    outcomes: list[RankOutcome] = []
    launcher_log = _tail(workdir / "launcher.txt") if len(procs) == 1 and world_size > 1 else ""
    for rank in range(world_size):
        error_file = workdir / f"error_{rank}.txt"
        result_file = workdir / f"result_{rank}.pkl"
        proc = procs[rank] if len(procs) == world_size else procs[0]
        log = _tail(workdir / f"log_{rank}.txt") or _tail(workdir / f"launcher_{rank}.txt")
        if result_file.exists() and not error_file.exists():
            results.append(pickle.loads(result_file.read_bytes()))
            outcomes.append(RankOutcome(rank, proc.returncode, "", log, False))
        else:
            tb = error_file.read_text() if error_file.exists() else ""
            outcomes.append(RankOutcome(rank, proc.returncode, tb, log, rank in hung))
    bad = [o for o in outcomes if o.traceback or o.hung or (o.exitcode not in (0, None) and not o.traceback)]
    if not bad and len(results) == world_size and not timed_out:
        return results
    errors = [(f.stat().st_mtime_ns, r) for r in range(world_size) if (f := workdir / f"error_{r}.txt").exists()]
    first = min(errors)[1] if errors else None
    raise RankError(_report(outcomes, timed_out, timeout, launcher_log, first), outcomes, timed_out)


def _report(
    outcomes: Sequence[RankOutcome], timed_out: bool, timeout: float, launcher_log: str, first: Optional[int]
) -> str:
    failed = [o.rank for o in outcomes if o.traceback]
    hung = [o.rank for o in outcomes if o.hung and not o.traceback]
    parts = []
    if timed_out:
        parts.append(f"timed out after {timeout:g}s")
    if first is not None:
        # Peers of a failed rank fail too (their collectives lose it); the
        # first error is the cause, so it is named and shown first.
        parts.append(f"rank {first} failed first")
    if failed:
        parts.append(f"rank(s) {failed} raised")
    if hung:
        parts.append(f"rank(s) {hung} did not finish (killed; stacks below)")
    lines = ["run_ranks failed: " + "; ".join(parts or ["a rank exited without a result"])]
    for o in sorted(outcomes, key=lambda o: o.rank != first):
        if not (o.traceback or o.hung or o.exitcode not in (0, None)):
            continue
        lines.append(f"\n----- rank {o.rank} (exit code {o.exitcode}) -----")
        if o.traceback:
            lines.append(o.traceback.rstrip())
        if o.log_tail:
            lines.append(f"--- rank {o.rank} output (last {_LOG_TAIL} lines) ---")
            lines.append(o.log_tail)
    if launcher_log:
        lines.append("\n----- launcher output -----\n" + launcher_log)
    return "\n".join(lines)
