"""Backend "nccl": unavailable-with-reason on CPU hosts, collectives on GPUs.

Tests that need CUDA skip without it; run them on a GPU machine with
``plugins/shardwise-nccl/scripts/run_gpu_tests.sh``.
"""

from __future__ import annotations

import pytest
import torch

import shardwise
from shardwise import LaunchInfo, plugins
from shardwise.errors import BackendUnavailableError
from shardwise.testing import run_ranks
from shardwise_nccl.plugin import local_device

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def fresh_plugin_manager() -> None:
    plugins.reset()


def test_registered_through_entry_point() -> None:
    backend = plugins.get_backend("nccl")
    assert backend.devices == ("cuda",) and backend.distribution == "shardwise-nccl"
    assert plugins.plugin_for_backend("nccl") == "nccl"
    assert backend.priority > 0  # preferred over CPU backends when usable


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only explanation")
def test_unavailable_without_cuda_says_why() -> None:
    availability = plugins.availability(plugins.get_backend("nccl"))
    assert not availability
    assert "CUDA" in availability.reason
    with pytest.raises(BackendUnavailableError, match="'nccl' is installed but cannot run here: .*CUDA"):
        shardwise.init("nccl", environ={})


def test_more_local_ranks_than_devices_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    launch = LaunchInfo(launcher="torchrun", family="torchrun", rank=1, world_size=2, local_rank=1, local_world_size=2)
    with pytest.raises(BackendUnavailableError, match="2 ranks on this node but only 1 CUDA device"):
        local_device(launch)
    ok = LaunchInfo(launcher="torchrun", family="torchrun", rank=0, world_size=1, local_rank=0, local_world_size=1)
    assert local_device(ok) == torch.device("cuda", 0)


def cuda_collectives() -> dict[str, object]:
    group = shardwise.get_default_group()
    device = torch.device("cuda", torch.cuda.current_device())
    t = torch.arange(4.0, device=device)
    group.all_reduce(t)
    gathered = group.all_gather(torch.arange(3, device=device))
    a2a = group.all_to_all_single(torch.arange(2.0, device=device))
    staged = group.all_reduce(torch.ones(2))  # a CPU tensor travels through the GPU
    bf16 = group.all_reduce(torch.ones(3, dtype=torch.bfloat16, device=device), op="max")
    return {
        "backend": group.backend,
        "device": str(group.device),
        "all_reduce": t.cpu().tolist(),
        "all_gather": [g.cpu().tolist() for g in gathered],
        "a2a_device": str(a2a.device),
        "staged_device": str(staged.device),
        "bf16": bf16.float().cpu().tolist(),
        "exchange": group.exchange({"rank": group.rank}),
    }


@needs_cuda
def test_world_size_one_on_a_gpu() -> None:
    (result,) = run_ranks(cuda_collectives, 1, backend="nccl", timeout=180)
    assert result["backend"] == "nccl" and str(result["device"]).startswith("cuda")
    assert result["all_reduce"] == [0.0, 1.0, 2.0, 3.0]
    assert result["all_gather"] == [[0, 1, 2]]
    assert str(result["a2a_device"]).startswith("cuda") and result["staged_device"] == "cpu"
    assert result["bf16"] == [1.0, 1.0, 1.0]
    assert result["exchange"] == [{"rank": 0}]
