"""Registers backend ``"nccl"`` through the ``shardwise_backends`` hook.

CUDA is touched only inside :func:`is_available` and :func:`create_group`,
never at import (importing torch initialises no CUDA).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Iterable

import torch
import torch.distributed as dist

from shardwise import Availability, Backend, Group, LaunchInfo, hookimpl
from shardwise.errors import BackendUnavailableError
from shardwise.torch_group import init_torch_process_group

__all__ = ["create_group", "is_available", "local_device", "shardwise_backends"]


def is_available() -> Availability:
    """Whether CUDA and NCCL are usable here, and if not, why."""
    if not dist.is_available():
        return Availability(False, "this torch build has no torch.distributed")
    if torch.version.cuda is None:
        return Availability(False, f"torch {torch.__version__} is a CPU-only build (no CUDA)")
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        return Availability(False, f"no CUDA device is usable{hint}: check the driver and the devices visible")
    if not dist.is_nccl_available():
        return Availability(False, "this torch build was compiled without NCCL")
    return Availability(True)


def local_device(launch: LaunchInfo) -> torch.device:
    """The CUDA device this rank binds to: its local rank.

    Raises:
        BackendUnavailableError: more ranks on this node than CUDA devices
            (NCCL refuses two ranks on one device).
    """
    count = torch.cuda.device_count()
    if launch.local_rank >= count or (launch.local_world_size or 0) > count:
        ranks = launch.local_world_size or launch.local_rank + 1
        raise BackendUnavailableError(
            f"{ranks} ranks on this node but only {count} CUDA device(s): NCCL needs one device per "
            "rank. Start fewer ranks per node, or use backend 'gloo' or 'mpi' to share a device."
        )
    return torch.device("cuda", launch.local_rank)


def create_group(launch: LaunchInfo, timeout: timedelta) -> Group:
    """Bind this rank to ``cuda:<local rank>`` and make an NCCL group."""
    device = local_device(launch)
    torch.cuda.set_device(device)
    return init_torch_process_group("nccl", launch, timeout, device=device)


@hookimpl
def shardwise_backends() -> Iterable[Backend]:
    yield Backend(
        name="nccl",
        is_available=is_available,
        create_group=create_group,
        devices=("cuda",),
        distribution="shardwise-nccl",
        priority=10,
        description="torch.distributed NCCL: CUDA tensors, one GPU per rank",
    )
