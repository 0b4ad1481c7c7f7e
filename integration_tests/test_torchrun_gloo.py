"""Programs started by a real ``torchrun`` (two ranks, backend chosen automatically: gloo).

Each test launches ``python -m torch.distributed.run --standalone
--nproc-per-node 2 PROGRAM`` in a fresh session, with a hard timeout after
which the whole process group (torchrun and its workers) is killed, so a
hang fails the test instead of stalling the suite. The full output is
printed (pytest shows it on failure) and included in assertion messages.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import pytest

from shardwise.testing import launcher_free_env

PROGRAMS = Path(__file__).parent / "programs"

#: Seconds a whole torchrun job may take (two ranks importing torch on a
#: small machine need a while); below pytest's own --timeout.
JOB_TIMEOUT = 240

def _environment(**extra: str) -> dict[str, str]:
    env = launcher_free_env()
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU only: the automatic choice must be gloo
    env["SHARDWISE_TIMEOUT"] = "60"  # a lost peer becomes an error within a minute
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, grandchildren, ...), read from ``/proc``; [] where there is none."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")".
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # the process ended meanwhile
        children.setdefault(ppid, []).append(int(entry))
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill_job(pid: int) -> None:
    """SIGKILL the job started as ``pid`` in a session of its own, and every process it started.

    Killing the session is not enough: torchrun starts each worker in a
    session of its own, so those workers would outlive it (holding the
    output pipe open, which keeps ``communicate`` waiting for them).
    """
    below = _descendants(pid)  # before the kill: orphans are adopted by init and no longer found
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for target in below:
        try:
            os.kill(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _run(cmd: list[str], timeout: float, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(cmd, timeout=timeout)``, but a timeout kills the whole job.

    ``subprocess.run`` would kill only torchrun and leave its workers
    running; here the job gets its own session, and it and every process
    it started are killed.
    """
    started = time.monotonic()
    with subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env,
        start_new_session=True,
    ) as proc:
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_job(proc.pid)
            output, _ = proc.communicate()
            print(output)
            pytest.fail(f"{' '.join(cmd)} did not finish within {timeout:g}s (killed); output:\n{output}")
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # stray workers, if any
            except ProcessLookupError:
                pass
    print(f"$ {' '.join(cmd)}  # exit {proc.returncode} after {time.monotonic() - started:.1f}s")
    print(output)
    return subprocess.CompletedProcess(cmd, proc.returncode, output)


def torchrun(
    program: Path, nproc: int = 2, timeout: float = JOB_TIMEOUT, args: Sequence[str] = (), **env: str
) -> subprocess.CompletedProcess[str]:
    """Launch ``program *args`` under ``torchrun --standalone --nproc-per-node nproc``."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "0",
        str(program), *args,
    ]  # fmt: skip
    return _run(cmd, timeout, _environment(**env))


def test_collectives_and_gradients_under_torchrun() -> None:
    result = torchrun(PROGRAMS / "collectives_gloo.py")
    assert result.returncode == 0, f"torchrun exited {result.returncode}; output:\n{result.stdout}"
    for rank in (0, 1):
        assert f"rank {rank} OK" in result.stdout, f"no 'rank {rank} OK' line; output:\n{result.stdout}"


def test_failing_rank_ends_the_job_with_its_traceback() -> None:
    started = time.monotonic()
    result = torchrun(PROGRAMS / "rank1_raises.py")
    elapsed = time.monotonic() - started
    assert result.returncode != 0, f"torchrun exited 0 although rank 1 raised; output:\n{result.stdout}"
    assert "Traceback" in result.stdout, f"no traceback in the output:\n{result.stdout}"
    assert "RuntimeError: deliberate failure on rank 1" in result.stdout, (
        f"rank 1's exception is not in the output:\n{result.stdout}"
    )
    assert "finished although rank 1 failed" not in result.stdout, result.stdout
    assert elapsed < JOB_TIMEOUT, elapsed


def test_info_lists_gloo_as_available() -> None:
    cmd = [sys.executable, "-m", "shardwise", "info", "--json"]
    result = _run(cmd, timeout=120, env=_environment())
    assert result.returncode == 0, result.stdout
    info = json.loads(result.stdout)
    backends = {b["name"]: b for b in info["backends"]}
    assert "gloo" in backends, f"gloo backend not found through its entry point: {sorted(backends)}"
    assert backends["gloo"]["available"], backends["gloo"]
    assert backends["gloo"]["distribution"] == "shardwise-gloo", backends["gloo"]


def test_readme_sharded_tensor_example_under_torchrun() -> None:
    result = torchrun(PROGRAMS / "sharded_readme.py")
    assert result.returncode == 0, f"torchrun exited {result.returncode}; output:\n{result.stdout}"
    for line in (
        "rank 0 (gloo): ShardedTensor [7, 4], local rows [4, 4]",
        "rank 1 (gloo): ShardedTensor [7, 4], local rows [3, 4]",
        "rank 1: after reshard, local columns [7, 2]",
        "rank 0: gathered tensor equals the dense computation",
    ):
        assert line in result.stdout, f"missing {line!r}; output:\n{result.stdout}"


def test_readme_embedding_bag_training_under_torchrun() -> None:
    result = torchrun(PROGRAMS / "embedding_bag_train.py")
    assert result.returncode == 0, f"torchrun exited {result.returncode}; output:\n{result.stdout}"
    for line in ("rank 0: rows 0..499 match dense training", "rank 1: rows 500..999 match dense training"):
        assert line in result.stdout, f"missing {line!r}; output:\n{result.stdout}"
