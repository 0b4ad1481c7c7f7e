"""torch-native distributed code over MPI: the same program under ``mpiexec`` ("mpi4py") and ``torchrun`` (gloo).

``programs/torch_native_workloads.py`` runs FSDP2 (``fully_shard``; also with
bfloat16 mixed precision) and FSDP1 (CPU) training, DTensor tensor parallelism (``parallelize_module``), a DCP
save/load of an FSDP2 model and its optimizer (loaded back and into a tensor
parallel layout) and the object collectives. It is launched once per backend
(two ranks, every scenario in one job); the gloo job also loads the checkpoint
the MPI job saved. Each test compares one scenario's results, rank by rank:
losses, parameters, checkpointed values and objects must be identical. (Two
ranks reduce by one addition, which is the same in either order, so the
backends agree to the bit; the program also checks training against the same
computation on one process.) Each job has a hard timeout; a failing rank's
traceback is in the assertion message.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from test_mpiexec import mpiexec
from test_torchrun_gloo import PROGRAMS, torchrun

PROGRAM = PROGRAMS / "torch_native_workloads.py"
SCENARIOS = ("fsdp2", "fsdp2_bf16", "fsdp1", "tp", "dcp", "objects")
RANKS = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Both jobs, once for the module: ``{"mpi4py": its output folder, "gloo": ...}``."""
    base = tmp_path_factory.mktemp("torch_native")
    mpi_out, gloo_out = base / "mpi4py", base / "gloo"
    out = mpiexec(PROGRAM, RANKS, "mpi4py", str(mpi_out))
    for name in SCENARIOS:
        assert sorted(re.findall(rf"rank (\d) {name} OK", out)) == ["0", "1"], out
    result = torchrun(PROGRAM, RANKS, args=("gloo", str(gloo_out), "--load-from", str(mpi_out)))
    assert result.returncode == 0, f"torchrun exited {result.returncode}; output:\n{result.stdout}"
    for name in SCENARIOS:
        assert sorted(re.findall(rf"rank (\d) {name} OK", result.stdout)) == ["0", "1"], result.stdout
    return {"mpi4py": mpi_out, "gloo": gloo_out}


def _assert_identical(got: Any, want: Any, where: str) -> None:
    """Exact equality of nested dicts/lists of tensors, floats and plain objects (dtype included)."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: {type(got).__name__}, not a tensor"
        assert got.dtype == want.dtype and got.shape == want.shape, f"{where}: {got.dtype}{list(got.shape)}"
        assert torch.equal(got, want), f"{where}: largest difference {(got - want).abs().max().item()}"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), f"{where}: keys {sorted(got)} != {sorted(want)}"
        for key in want:
            _assert_identical(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), f"{where}: {got!r} != {want!r}"
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            _assert_identical(a, b, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def _results(folder: Path, scenario: str, rank: int) -> dict[str, Any]:
    loaded: dict[str, Any] = torch.load(folder / f"{scenario}-rank{rank}.pt", weights_only=True)
    return loaded


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_mpi4py_matches_gloo(runs: dict[str, Path], scenario: str) -> None:
    for rank in range(RANKS):
        mpi, gloo = _results(runs["mpi4py"], scenario, rank), _results(runs["gloo"], scenario, rank)
        if scenario == "dcp":
            # gloo loaded the checkpoint that the mpi4py job saved: the values it saved.
            _assert_identical(gloo.pop("loaded_from_other_run"), mpi["saved"], f"rank {rank}: mpi4py checkpoint")
        _assert_identical(mpi, gloo, f"{scenario} rank {rank} (mpi4py vs gloo)")


def test_training_changed_the_parameters(runs: dict[str, Path]) -> None:
    # Guards the comparison above against a run that trained nothing (identical because untouched).
    torch.manual_seed(0)
    initial = torch.nn.Linear(6, 16).weight.detach()
    for scenario in ("fsdp2", "fsdp2_bf16", "fsdp1", "tp"):
        params = _results(runs["mpi4py"], scenario, 0)["params"]
        assert not torch.equal(params["0.weight"], initial), f"{scenario}: weights did not change"
        assert len(set(_results(runs["mpi4py"], scenario, 0)["losses"])) == 3, scenario
