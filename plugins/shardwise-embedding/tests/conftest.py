"""Fixtures shared by the shardwise-embedding tests.

The tests directory goes on ``sys.path`` so the ranks started by
``shardwise.testing.run_ranks`` (which copy this process's ``sys.path``) can
import ``emb_helpers`` and the test modules their rank functions live in.
Installed plugins (this one, the gloo backend) load through their entry
points, so no ``SHARDWISE_PLUGINS`` is needed.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

import pytest

from shardwise.testing import isolated_plugins

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def fresh_plugin_manager() -> Iterator[None]:
    """Each test starts from a plugin manager built from its own environment."""
    with isolated_plugins():
        yield
