"""torch.distributed backend "mpi4py": in-place and aliased-buffer forms of every collective, under real ``mpiexec``.

MPI refuses a send buffer that overlaps the receive buffer ("Buffers must not
be aliased"); torch passes such buffers (FSDP2 all-gathers into the tensor its
shard is a view of). The program ``programs_c10d/c10d_aliasing.py`` checks each
form against the value it must produce, and which calls used ``MPI_IN_PLACE``.
"""

from __future__ import annotations

import re
import sys

import pytest
from test_mpi4py_c10d import MPIEXEC, PROGRAMS, _run, _show, needs_mpiexec

# Checks every rank runs, one per form (the program prints the names it ran).
EVERY_RANK = (
    "overlaps same tensor",
    "overlaps disjoint slices",
    "overlaps touching slices",
    "overlaps transposed view",
    "overlaps column vs later rows",
    "overlaps interleaved (conservative)",
    "overlaps other storage",
    "overlaps empty view",
    "overlaps reinterpreted bytes",
    "overlaps two storages over one buffer",
    "overlaps expanded",
    "all_gather_into_tensor input is own slot",
    "all_gather_into_tensor 2-D own rows",
    "all_gather_into_tensor input is slot 0",
    "all_gather_into_tensor separate input",
    "all_gather_into_tensor input straddles slots",
    "all_gather_into_tensor input is a strided view",
    "all_gather_into_tensor non-contiguous output",
    "_allgather_base own slot",
    "allgather_into_tensor_coalesced aliased 0",
    "allgather_into_tensor_coalesced aliased 1",
    "allgather_into_tensor_coalesced direct",
    "reduce_scatter_tensor in place sum",
    "reduce_scatter_tensor in place avg",
    "reduce_scatter_tensor output is slot 0",
    "reduce_scatter_tensor output straddles slots",
    "_reduce_scatter_base in place",
    "reduce_scatter_tensor in place bfloat16",
    "reduce_scatter_tensor_coalesced aliased 0",
    "reduce_scatter_tensor_coalesced aliased 1",
    "reduce_scatter list output is an input",
    "all_reduce on a view: contiguous rows",
    "all_reduce on a view: column",
    "all_reduce on a view: transposed",
    "all_reduce on a view: every other row",
    "all_reduce on a view: flat slice",
    "all_reduce avg on a strided block",
    "all_gather output is the input",
    "all_gather output 0 is the input",
    "all_gather outputs are views of one buffer",
    "broadcast into a column",
    "broadcast into a slice",
    "scatter output is one of the root's inputs",
    "scatter into a column",
    "all_to_all_single in place",
    "all_to_all_single overlapping",
    "all_to_all outputs are the inputs",
    "premul_sum all_reduce on a view",
    "premul_sum reduce_scatter_tensor in place",
    "premul_sum tensor factor",
    "premul_sum leaves the input alone",
    "premul_sum reduce_scatter list",
    "scatterv root's output is its slot",
    "scatterv root's output overlaps another slot",
    "allgatherv uneven own slot",
    "object collectives with uneven sizes",
)
# Checks only the gathering root (the last rank) can make.
ROOT_ONLY = (
    "gather input is one of the root's outputs",
    "gather from a column",
    "gather outputs overlap one another",
    "gatherv root's input is its slot",
)


@needs_mpiexec
@pytest.mark.parametrize("world_size", [2, 3])
def test_in_place_and_aliased_buffers(world_size: int) -> None:
    cmd = [str(MPIEXEC), "-n", str(world_size), sys.executable, str(PROGRAMS / "c10d_aliasing.py")]
    proc = _run(cmd, 120)
    assert proc.returncode == 0, _show(proc)
    # Ranks' lines can interleave in the launcher's output: match up to each line's END marker.
    ran = {int(r): names.split(",") for r, names in re.findall(r"CHECKS (\d+) (.*?) END", proc.stdout)}
    assert sorted(ran) == list(range(world_size)), _show(proc)
    for rank, names in ran.items():
        want = EVERY_RANK + (ROOT_ONLY if rank == world_size - 1 else ())
        assert sorted(names) == sorted(want), f"rank {rank} ran {names}\n{_show(proc)}"
