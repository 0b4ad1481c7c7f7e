"""How shardwise-embedding registers its ops: the hook, the registry, ``shardwise info``, lazy import.

No ranks: everything here runs in the test process or in a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch.nn.functional as F

import shardwise
from shardwise import plugins
from shardwise._registry import manager as _registry
from shardwise._session.info import main as info_main
from shardwise.sharding_spec import ChunkShardingSpec

OPS = {F.embedding: "torch.nn.functional.embedding", F.embedding_bag: "torch.nn.functional.embedding_bag"}
SPEC_NAME = "shardwise.sharding_spec.ChunkShardingSpec"


def _clean_env() -> dict[str, str]:
    """This process's environment without SHARDWISE_* (plugins load through entry points only)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SHARDWISE_")}


def test_hook_returns_records_for_both_ops() -> None:
    from shardwise_embedding import plugin

    records = list(plugin.shardwise_sharded_ops())
    assert all(isinstance(r, shardwise.ShardedOp) for r in records)
    by_key = {(r.op, r.spec): r for r in records}
    for op in OPS:
        # The implementation for chunk specs, and one for every other spec that names what is supported.
        for spec in (ChunkShardingSpec, shardwise.ShardingSpec):
            record = by_key[(op, spec)]
            assert callable(record.impl) and not record.override, record
            assert record.op_name == OPS[op]


def test_registry_finds_the_plugin_through_its_entry_point() -> None:
    infos = {p.name: p for p in plugins.list_plugins()}
    assert "embedding" in infos, sorted(infos)
    info = infos["embedding"]
    assert (info.distribution, info.module) == ("shardwise-embedding", "shardwise_embedding.plugin")
    for op in OPS:
        for spec in (ChunkShardingSpec, ChunkShardingSpec(dim=1, placements=["rank:0/cpu"])):
            found = plugins.find_op(op, spec)
            assert found.spec is ChunkShardingSpec and found.impl.__module__.startswith("shardwise_embedding"), found


def test_info_json_lists_both_ops_with_the_distribution() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "shardwise", "info", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env=_clean_env(),
    )
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    ops = {(o["op"], o["spec"]) for o in info["sharded_ops"]}
    for name in OPS.values():
        assert (name, SPEC_NAME) in ops, sorted(ops)
    plugin_rows = [p for p in info["plugins"] if p["module"] == "shardwise_embedding.plugin"]
    assert [(p["name"], p["distribution"]) for p in plugin_rows] == [("embedding", "shardwise-embedding")]


def test_info_text_lists_both_ops(capsys: pytest.CaptureFixture[str]) -> None:
    # The full op table (`info --all`): op, spec, providing plugin.
    assert info_main(["info", "--all"]) == 0
    out = capsys.readouterr().out
    assert "shardwise-embedding" in out
    lines = [line.split() for line in out.splitlines()]
    for name in OPS.values():
        assert [name, SPEC_NAME, "embedding"] in lines, out


def test_import_registers_nothing_in_process() -> None:
    import shardwise_embedding
    import shardwise_embedding.plugin  # noqa: F401

    assert shardwise_embedding.__name__ == "shardwise_embedding"
    # The autouse fixture reset the registry: importing must not build a new one.
    assert _registry._current is None


def test_fresh_import_builds_no_plugin_manager() -> None:
    code = (
        "import sys, shardwise_embedding, shardwise_embedding.plugin\n"
        "from shardwise._registry import manager as _registry\n"
        "import torch.distributed as dist\n"
        "print(_registry._current is None, dist.is_initialized(), 'shardwise_gloo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=_clean_env())
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False", "False"], out.stdout
