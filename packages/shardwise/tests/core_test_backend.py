"""A test-only backend plugin: torch's gloo, registered through the public hook.

It lets the core's tests run collectives without depending on the
shardwise-gloo distribution (the ``core`` tox env installs the core alone).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Iterable

import torch

from shardwise import Availability, Backend, Group, LaunchInfo, hookimpl
from shardwise.torch_group import init_torch_process_group

NAME = "test-gloo"


def _create(launch: LaunchInfo, timeout: timedelta) -> Group:
    return init_torch_process_group("gloo", launch, timeout, device=torch.device("cpu"))


@hookimpl
def shardwise_backends() -> Iterable[Backend]:
    yield Backend(
        name=NAME,
        is_available=lambda: Availability(True),
        create_group=_create,
        devices=("cpu",),
        distribution="(core tests)",
        description="torch gloo, for the core's own tests",
    )
