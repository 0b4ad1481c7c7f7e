"""Fixtures shared by the core's tests.

The core is tested alone (tox env ``core`` installs no backend plugin), so
multi-rank tests load ``core_test_backend`` — a backend over torch's gloo
registered through ``SHARDWISE_PLUGINS`` like any outside plugin — and
switch entry-point autoloading off so installed plugins cannot interfere.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

import shardwise
from shardwise._registry import manager as _registry
from shardwise.testing import isolated_plugins  # noqa: E402

#: Environment for ranks started by ``run_ranks`` in core tests.
RANK_ENV = {
    "SHARDWISE_PLUGINS": "core_test_backend",
    "SHARDWISE_DISABLE_PLUGIN_AUTOLOAD": "1",
}


@pytest.fixture(autouse=True)
def fresh_plugin_manager() -> Iterator[None]:
    """Each test starts from a plugin manager built from its own environment."""
    with isolated_plugins():
        yield


@pytest.fixture
def core_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the core's defaults plus the test backend, whatever is installed."""
    for name, value in RANK_ENV.items():
        monkeypatch.setenv(name, value)
    _registry.reset()


@pytest.fixture
def clean_session(core_only: None) -> Iterator[None]:
    """``core_only``, and no default group or torch process group left behind by the test."""
    yield
    shardwise.destroy()
    if dist.is_initialized():
        dist.destroy_process_group()
