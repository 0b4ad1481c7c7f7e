"""Backend "gloo" found through its entry point, on real ranks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import shardwise
from shardwise import plugins
from shardwise.testing import run_ranks


@pytest.fixture(autouse=True)
def fresh_plugin_manager() -> None:
    plugins.reset()


def test_registered_through_entry_point() -> None:
    backend = plugins.get_backend("gloo")
    assert plugins.plugin_for_backend("gloo") == "gloo"
    assert backend.devices == ("cpu",) and backend.distribution == "shardwise-gloo"
    assert plugins.availability(backend).available
    info = {p.name: p for p in plugins.list_plugins()}["gloo"]
    assert (info.distribution, info.module) == ("shardwise-gloo", "shardwise_gloo.plugin")


def test_info_lists_gloo_available() -> None:
    out = subprocess.run([sys.executable, "-m", "shardwise", "info", "--json"], capture_output=True, text=True, timeout=60)
    backends = {b["name"]: b for b in json.loads(out.stdout)["backends"]}
    assert backends["gloo"]["available"] is True


def test_importing_the_plugin_does_nothing() -> None:
    code = "import shardwise_gloo.plugin, torch.distributed as d; print(d.is_initialized())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


def auto_init() -> tuple[str, str, int]:
    group = shardwise.init()
    try:
        t = torch.full((2,), float(group.rank + 1))
        group.all_reduce(t)
        pieces = group.all_gather(torch.arange(group.rank + 1))
        assert [p.tolist() for p in pieces] == [list(range(s + 1)) for s in range(group.size)]
        # a torch ProcessGroup passed where a Group is expected is wrapped
        wrapped = shardwise.resolve_group(dist.group.WORLD)
        assert wrapped.exchange(group.rank) == list(range(group.size))
        return group.backend, dist.get_backend(), int(t[0].item())
    finally:
        shardwise.destroy()


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_automatic_choice_is_gloo_on_cpu(world_size: int) -> None:
    results = run_ranks(auto_init, world_size, backend=None, timeout=120)
    total = world_size * (world_size + 1) // 2
    assert results == [("gloo", "gloo", total)] * world_size


def test_plugin_named_twice_is_registered_once() -> None:
    from shardwise._registry.manager import create_registry

    registry = create_registry({"SHARDWISE_PLUGINS": "shardwise_gloo.plugin"})
    assert registry.backends["gloo"][1] == "shardwise_gloo.plugin"  # once, under its module name
