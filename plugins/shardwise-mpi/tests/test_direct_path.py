"""MpiGroup's direct paths: the core's public collectives hand the checked call to the backend.

The backend overrides no public collective; after the shared checks (and the
handshake, when verifying) a plain CPU call goes straight to MPI on the
caller's memory — no staging copy, no primitive of the general path, and
with ``verify=False`` no handshake — while anything else takes the general
path with the same result.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from mpi_launch import needs_mpiexec

import shardwise
from shardwise.testing import run_ranks

_PRIMITIVES = ("_broadcast", "_all_reduce", "_all_gather", "_reduce_scatter", "_all_to_all", "_all_gather_ints")


def _count(g: Any) -> dict[str, int]:
    """Count the general path's primitive calls and the handshakes' all-gathers (``_all_gather_ints``) on ``g``."""
    calls = dict.fromkeys(_PRIMITIVES, 0)
    for name in _PRIMITIVES:
        primitive = getattr(g, name)

        def counted(*args: Any, _name: str = name, _primitive: Callable[..., Any] = primitive) -> Any:
            calls[_name] += 1
            return _primitive(*args)

        setattr(g, name, counted)
    return calls


def direct_battery() -> dict[str, Any]:
    # Imported on the ranks only: importing mpi4py initialises MPI.
    from shardwise_mpi import _collectives as C

    g = shardwise.get_default_group()
    r, w = g.rank, g.size
    calls = _count(g)
    seen: dict[str, Any] = {"backend": g.backend}
    passed: list[int] = []
    real = C.reduce_scatter

    def spy(comm: Any, out: torch.Tensor, inp: torch.Tensor, counts: Any, op: Any) -> torch.Tensor:
        passed.append(inp.data_ptr())
        return real(comm, out, inp, counts, op)

    C.reduce_scatter = spy  # type: ignore[assignment]
    # A first pass uncounted: the group's one-time agreement on cross-memory attach (three all-gathers of
    # integers, at the first collective that could take it) is not the path under test.
    for verify in (False, False, True):
        g.verify = verify
        for name in calls:
            calls[name] = 0
        t = torch.full((4,), float(r + 1))
        ptr = t.data_ptr()
        g.all_reduce(t)
        assert t.data_ptr() == ptr and t.tolist() == [float(sum(range(1, w + 1)))] * 4
        b = torch.full((3,), float(r))
        g.broadcast(b, src=w - 1)
        assert b.tolist() == [float(w - 1)] * 3
        out = torch.empty(2 * w)
        g.all_gather(torch.full((2,), float(r)), out=out)
        assert out.tolist() == [float(s) for s in range(w) for _ in range(2)]
        base = torch.arange(3.0 * w) + r
        passed.clear()
        got = g.reduce_scatter(list(base.split(3)))
        assert passed == [base.data_ptr()]  # the inputs were sent from the caller's tensor, not a copy
        assert got.tolist() == [float(sum(3 * r + i + s for s in range(w))) for i in range(3)]
        sent = torch.arange(float(w)) + 10 * r
        got = g.all_to_all_single(sent, output_split_sizes=[1] * w, input_split_sizes=[1] * w)
        assert got.tolist() == [float(r + 10 * s) for s in range(w)]
        seen[f"verify={verify}"] = dict(calls)
    # A call the direct path declines (non-contiguous) takes the general path, same result.
    g.verify = False
    for name in calls:
        calls[name] = 0
    t = torch.full((4, 2), float(r + 1)).t()
    g.all_reduce(t)
    assert t.tolist() == [[float(sum(range(1, w + 1)))] * 4] * 2
    seen["declined"] = dict(calls)
    C.reduce_scatter = real  # type: ignore[assignment]
    return seen


@needs_mpiexec
def test_direct_paths_skip_the_general_path() -> None:
    # Cross-memory attach off: its rounds (integers through _all_gather_ints, as the handshakes') would count
    # beside the handshakes; the direct path is MPI's.
    env = {"SHARDWISE_LOCAL_COPY": "0"}
    results = run_ranks(direct_battery, 2, backend="mpi", launcher="mpiexec", timeout=120, env=env)
    for seen in results:
        assert seen["backend"] == "mpi"
        # verify=False: no handshake and no general-path primitive at all.
        assert seen["verify=False"] == dict.fromkeys(_PRIMITIVES, 0), seen
        # verify=True: only the handshakes' all-gathers (one per collective), the data goes direct.
        assert seen["verify=True"] == {**dict.fromkeys(_PRIMITIVES, 0), "_all_gather_ints": 5}, seen
        assert seen["declined"]["_all_reduce"] == 1, seen
