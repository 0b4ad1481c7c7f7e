"""torch.distributed backend "mpi4py": its buffer fast paths give what the generic paths give.

In this process (no MPI): :func:`flat_view` over lists of tensors against
``torch.cat`` of them, :func:`list_target` against staging, and
:func:`prefer_huge_pages` leaving values alone. Under ``mpiexec``
(``programs_c10d/c10d_fast_paths.py``): the backend's list collectives
(point-to-point ``scatter``/``gather``, unstaged ``all_gather``/``all_to_all``/
``reduce_scatter``) against ``shardwise_mpi._collectives`` on flat copies, and
the ring all-reduce against MPI's ``Allreduce``; and
(``programs_c10d/c10d_one_copy_broadcast.py``) large broadcasts by one copy
per receiver from 3 ranks, through torch.distributed and ``Group.broadcast``.
"""

from __future__ import annotations

import ctypes
import re
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from shardwise_mpi._c10d_buffers import HUGE_PAGE_MIN_BYTES, flat_view, list_source, list_target, prefer_huge_pages
from shardwise_mpi._collectives import _target
from test_mpi4py_c10d import MPIEXEC, PROGRAMS, _ok_ranks, _run, _show, needs_mpiexec

DTYPES = (torch.float32, torch.float64, torch.int64, torch.bfloat16, torch.uint8, torch.bool, torch.complex64)


def _filled(numel: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.arange(numel) % 7).to(dtype)


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    counts=st.lists(st.integers(0, 6), min_size=1, max_size=5),
    rows=st.integers(1, 3),
)
def test_flat_view_of_back_to_back_pieces_is_their_memory(dtype: torch.dtype, counts: list[int], rows: int) -> None:
    whole = _filled(sum(counts) * rows, dtype).view(-1, rows) if sum(counts) else torch.zeros(0, rows, dtype=dtype)
    pieces = list(whole.split(counts))  # dim-0 pieces of a contiguous tensor: back to back
    flat = flat_view(pieces)
    if sum(counts) == 0:
        assert flat is None
        return
    assert flat is not None
    assert torch.equal(flat, torch.cat([p.reshape(-1) for p in pieces]))
    assert flat.data_ptr() == whole.data_ptr()  # no copy: writing it writes the pieces
    flat.fill_(True if dtype == torch.bool else 3)
    assert all(bool((p == flat[0]).all()) for p in pieces)
    assert torch.equal(list_source(pieces), flat)


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    counts=st.lists(st.integers(1, 6), min_size=2, max_size=4),
    kind=st.sampled_from(["separate", "reversed", "strided", "mixed dtype", "other storage", "conj"]),
)
def test_flat_view_refuses_what_is_not_one_run_of_memory(dtype: torch.dtype, counts: list[int], kind: str) -> None:
    whole = _filled(sum(counts), dtype)
    pieces = list(whole.split(counts))
    if kind == "separate":
        pieces = [p.clone() for p in pieces]
    elif kind == "reversed":
        pieces = pieces[::-1]
    elif kind == "strided":
        pieces[0] = _filled(2 * counts[0], dtype)[::2]
    elif kind == "mixed dtype":
        pieces[-1] = pieces[-1].to(torch.float64 if dtype != torch.float64 else torch.float32)
    elif kind == "other storage":
        # Same bytes, another storage over them: as_strided past its end would be out of bounds.
        pieces[1] = torch.frombuffer(bytearray(pieces[1].numpy().tobytes()), dtype=dtype) if dtype not in (
            torch.bfloat16, torch.bool) else pieces[1].clone()  # fmt: skip
    else:
        if not dtype.is_complex:
            return
        pieces[0] = pieces[0].conj()
    assert flat_view(pieces) is None
    # The generic form still gives the concatenation.
    assert torch.equal(list_source(pieces), torch.cat([p.resolve_conj().reshape(-1) for p in pieces]))


@settings(max_examples=30, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    counts=st.lists(st.integers(0, 5), min_size=1, max_size=4),
    layout=st.sampled_from(["views", "separate", "strided"]),
)
def test_list_target_fills_the_outputs(dtype: torch.dtype, counts: list[int], layout: str) -> None:
    if layout == "views":
        outs = list(torch.zeros(sum(counts), dtype=dtype).split(counts))
    elif layout == "separate":
        outs = [torch.zeros(c, dtype=dtype) for c in counts]
    else:
        outs = [torch.zeros(2 * c, dtype=dtype)[::2] for c in counts]
    flat, finish = list_target(outs, dtype, torch.device("cpu"))
    want = _filled(sum(counts), dtype)
    flat.copy_(want)  # what the collective would write
    finish()
    assert torch.equal(torch.cat(outs), want)
    nonempty = sum(1 for c in counts if c)
    if layout == "views" and nonempty:
        assert flat_view(outs) is not None  # filled in place, nothing staged
    if layout == "separate" and nonempty > 1:
        assert flat_view(outs) is None


def test_prefer_huge_pages_changes_no_values() -> None:
    big = torch.arange(HUGE_PAGE_MIN_BYTES // 4 * 3, dtype=torch.float32)
    small = torch.arange(10.0)
    before = big.clone(), small.clone()
    prefer_huge_pages(big, small, None, big[::2], torch.empty(0))
    assert torch.equal(big, before[0]) and torch.equal(small, before[1])
    fresh = torch.empty(HUGE_PAGE_MIN_BYTES // 4 * 3)
    prefer_huge_pages(fresh)
    fresh.copy_(big)
    assert torch.equal(fresh, big)


@pytest.mark.parametrize("kind", ["neg", "conj"])
def test_a_flagged_output_view_receives_values_not_bytes(kind: str) -> None:
    # MPI writes raw bytes into the buffer _target gives; into a flagged view's memory they would read back flagged.
    sent = torch.tensor([1.0 + 2.0j, -3.0 + 0.5j, 4.0 - 1.0j])
    base = torch.zeros(3, dtype=torch.complex64)
    out = torch._neg_view(base) if kind == "neg" else base.conj()
    buf, finish = _target(out)
    ctypes.memmove(buf.data_ptr(), sent.data_ptr(), sent.nbytes)  # what MPI_Bcast does
    finish()
    assert torch.equal(out, sent)


@needs_mpiexec
@pytest.mark.parametrize("world_size", [2, 3])
def test_list_collectives_match_the_generic_path(world_size: int) -> None:
    cmd = [str(MPIEXEC), "-n", str(world_size), sys.executable, str(PROGRAMS / "c10d_fast_paths.py")]
    proc = _run(cmd, 120)
    assert proc.returncode == 0, _show(proc)
    found = _ok_ranks(proc)
    assert sorted(found) == list(range(world_size)), _show(proc)
    assert all(count == 30 for count in found.values()), _show(proc)  # every drawn example ran on every rank


@needs_mpiexec
@pytest.mark.parametrize("world_size", [2, 3])
def test_large_broadcasts_take_one_copy_from_three_ranks_with_the_same_values(world_size: int) -> None:
    # At 2 ranks MPICH's Bcast is as fast as a read of the root's memory (docs/performance.md), so both
    # groups keep it; from 3 ranks each receiver reads the root's tensor once.
    cmd = [str(MPIEXEC), "-n", str(world_size), sys.executable, str(PROGRAMS / "c10d_one_copy_broadcast.py")]
    proc = _run(cmd, 120)
    assert proc.returncode == 0, _show(proc)
    found = {int(r): (int(c), int(u)) for r, c, u in re.findall(r"OK (\d+) (\d+) (\d+)", proc.stdout)}
    assert sorted(found) == list(range(world_size)), _show(proc)
    # 5 dtypes x 2 sizes x 2 layouts x each root, through torch.distributed and through Group.broadcast.
    assert all(cases == 5 * 2 * 2 * world_size * 2 for cases, _ in found.values()), _show(proc)
    # By one copy: the large ones, but for torch.distributed's strided tensors (MPI stages those itself;
    # Group.broadcast stages them into a contiguous buffer first): 5 dtypes x each root x 3.
    used = 0 if world_size < 3 else 5 * world_size * 3
    assert all(u == used for _, u in found.values()), _show(proc)
