"""Importing shardwise-mpi changes no torch.distributed global; asking for the "mpi4py" backend does.

DESIGN.md §3: a plugin registers no torch backend and replaces no rendezvous
handler until the user asks. The plugin manager imports ``shardwise_mpi``
(entry point ``mpi``) whenever it is built, so ``shardwise info`` and every
run would otherwise change torch's backends and its ``env://`` handler.

Each check runs in a fresh interpreter: the test process may already hold
a registration from another test.
"""

from __future__ import annotations

import re
import sys
import textwrap

from test_mpi4py_c10d import MPIEXEC, _run, _show, needs_mpiexec

# Snapshot of every torch.distributed global a backend or rendezvous
# registration touches, as shallow copies compared by value (functions and
# creators compare by identity).
_SNAPSHOT = textwrap.dedent(
    """
    import importlib, sys
    import torch.distributed as dist

    rdzv = importlib.import_module("torch.distributed.rendezvous")  # also a function: import by name


    def snapshot():
        B = dist.Backend
        return {
            "backend_list": list(B.backend_list),
            "_plugins": dict(B._plugins),
            "backend_capability": {k: list(v) for k, v in B.backend_capability.items()},
            "backend_type_map": dict(B.backend_type_map),
            "_rendezvous_handlers": dict(rdzv._rendezvous_handlers),
        }


    def assert_unchanged(before, after, what):
        for key in before:
            assert before[key] == after[key], f"{what} changed torch.distributed {key}: {before[key]!r} -> {after[key]!r}"
    """
)


def _python(body: str, timeout: float = 120) -> None:
    code = _SNAPSHOT + textwrap.dedent(body) + "\nprint('OK', flush=True)\n"
    proc = _run([sys.executable, "-c", code], timeout)
    assert proc.returncode == 0 and "OK" in proc.stdout.splitlines(), _show(proc)


def test_import_plugin_manager_and_info_leave_torch_distributed_alone() -> None:
    _python(
        """
        import contextlib, io

        before = snapshot()

        import shardwise_mpi
        import shardwise_mpi.plugin
        assert_unchanged(before, snapshot(), "import shardwise_mpi")

        from shardwise import plugins
        backends = [b.name for b in plugins.list_backends()]
        plugins.list_sharded_ops()
        plugins.list_launchers()
        # The manager did load the mpi entry point: otherwise this test proves nothing.
        assert "mpi" in backends, backends
        assert_unchanged(before, snapshot(), "building the plugin manager")

        from shardwise.__main__ import main
        with contextlib.redirect_stdout(io.StringIO()) as out:
            assert main(["info"]) == 0
        assert "mpi" in out.getvalue(), out.getvalue()
        assert_unchanged(before, snapshot(), "shardwise info")
        # is_available may import mpi4py to find libmpi; importing mpi4py.MPI would start MPI.
        assert "mpi4py.MPI" not in sys.modules, "building the plugin manager must not start MPI"

        # The snapshot sees a registration: the documented call changes what it compares.
        shardwise_mpi.register_torch_backend()
        after = snapshot()
        assert "mpi4py" in after["backend_list"] and "mpi4py" not in before["backend_list"]
        assert "MPI4PY" in after["_plugins"], after["_plugins"]
        assert "cpu" in after["backend_capability"]["mpi4py"]
        assert "mpi4py" in after["_rendezvous_handlers"]
        assert after["_rendezvous_handlers"]["env"] is not before["_rendezvous_handlers"]["env"]
        assert after["_rendezvous_handlers"]["env"].__wrapped__ is before["_rendezvous_handlers"]["env"]
        assert "mpi4py.MPI" not in sys.modules, "registering must not start MPI"
        """
    )


def test_python_dash_m_shardwise_info_runs() -> None:
    # The console entry itself (the in-process check above calls the same main).
    proc = _run([sys.executable, "-m", "shardwise", "info"], 120)
    assert proc.returncode == 0 and "mpi" in proc.stdout, _show(proc)


def test_register_torch_backend_is_idempotent_and_thread_safe() -> None:
    _python(
        """
        import threading

        import shardwise_mpi

        before = snapshot()
        start = threading.Barrier(8)

        def register():
            start.wait()
            shardwise_mpi.register_torch_backend()

        threads = [threading.Thread(target=register) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        shardwise_mpi.register_torch_backend()
        after = snapshot()
        assert after["backend_list"].count("mpi4py") == 1, after["backend_list"]
        env = after["_rendezvous_handlers"]["env"]
        # Wrapped exactly once: the wrapper falls back to torch's own handler, not to another wrapper.
        assert env.__wrapped__ is before["_rendezvous_handlers"]["env"], env
        assert not getattr(env.__wrapped__, "_shardwise_mpi", False)
        """
    )


@needs_mpiexec
def test_torch_native_init_process_group_after_the_documented_call() -> None:
    # Under a real mpiexec, no rendezvous variables: what the README tells torch-native users to write.
    code = textwrap.dedent(
        """
        import torch
        import torch.distributed as dist

        import shardwise_mpi

        assert "MPI4PY" not in dist.Backend._plugins, "importing shardwise_mpi registered the backend"
        shardwise_mpi.register_torch_backend()
        dist.init_process_group("mpi4py")
        rank, size = dist.get_rank(), dist.get_world_size()
        assert dist.get_backend() == "mpi4py" and size == 2, (dist.get_backend(), size)
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t)
        assert torch.equal(t, torch.full((3,), 3.0)), t
        dist.destroy_process_group()
        print(f"OK {rank}", flush=True)
        """
    )
    proc = _run([str(MPIEXEC), "-n", "2", sys.executable, "-c", code], 120)
    assert proc.returncode == 0, _show(proc)
    # Not by line: unbuffered, print writes the newline apart, and mpiexec may put the other
    # rank's line between ("OK 0OK 1\n\n", seen in 3 of 12 runs on a busy machine).
    assert sorted(re.findall(r"OK (\d+)", proc.stdout)) == ["0", "1"], _show(proc)
