"""Registers backend ``"gloo"`` through the ``shardwise_backends`` hook."""

from __future__ import annotations

from datetime import timedelta
from typing import Iterable

import torch
import torch.distributed as dist

from shardwise import Availability, Backend, Group, LaunchInfo, hookimpl
from shardwise.torch_group import init_torch_process_group
from shardwise_gloo._interface import choose_interface

__all__ = ["shardwise_backends"]


def is_available() -> Availability:
    """Whether this torch build has gloo."""
    if not dist.is_available():
        return Availability(False, "this torch build has no torch.distributed")
    if not dist.is_gloo_available():
        return Availability(False, "this torch build was compiled without gloo")
    return Availability(True)


def create_group(launch: LaunchInfo, timeout: timedelta) -> Group:
    """Rendezvous through the launcher's MASTER_ADDR/MASTER_PORT and make a gloo group.

    Unless ``GLOO_SOCKET_IFNAME`` is set, gloo binds the network interface
    that routes to the rendezvous host (see :mod:`shardwise_gloo._interface`).

    Raises:
        LaunchError: no interface of this host routes to the rendezvous
            host, or the rendezvous fails.
    """
    # A torch.distributed the user initialised already chose its interface.
    finish = None if dist.is_initialized() else choose_interface(launch, timeout)
    return init_torch_process_group("gloo", launch, timeout, device=torch.device("cpu"), before_init=finish)


@hookimpl
def shardwise_backends() -> Iterable[Backend]:
    yield Backend(
        name="gloo",
        is_available=is_available,
        create_group=create_group,
        devices=("cpu",),
        distribution="shardwise-gloo",
        priority=0,
        description="torch.distributed gloo: CPU tensors over TCP",
    )
