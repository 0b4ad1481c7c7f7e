"""The install hint for shardwise-embedding's ops: one core table, and it matches what the plugin registers.

Issue 17, defect 4: ``F.softmax`` on a ShardedTensor without this plugin
said "no installed plugin implements it" with no hint, while ``F.embedding``
said ``pip install shardwise-embedding`` — the core's table of which
distribution provides which op (``KNOWN_OP_DISTRIBUTIONS``) listed only the
embedding ops. The table is the only list; the first test here keeps it
equal to what this plugin registers, so it cannot drift when an op is
added here.

No ranks: a ShardedTensor tied to no group is enough to reach the lookup.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

from shardwise._registry import manager as _registry
from shardwise.errors import OpNotFoundError
from shardwise.sharded_tensor import Shard, ShardMetadata, ShardedTensor, ShardedTensorMetadata, TensorProperties

DISTRIBUTION = "shardwise-embedding"


def _attributed() -> set[str]:
    """The ops the core's table sends users to this distribution for."""
    return {name for name, dist in _registry.KNOWN_OP_DISTRIBUTIONS.items() if dist == DISTRIBUTION}


def test_the_core_table_names_exactly_the_ops_this_plugin_registers() -> None:
    from shardwise_embedding import plugin

    registered = {record.op_name for record in plugin.shardwise_sharded_ops()}
    assert _attributed() == registered, (
        f"KNOWN_OP_DISTRIBUTIONS (shardwise/_registry/manager.py) attributes {sorted(_attributed())} to "
        f"{DISTRIBUTION}, but its plugin registers {sorted(registered)}"
    )


def _weight() -> ShardedTensor:
    """A 4 x 3 ShardedTensor with one chunk shard, tied to no group."""
    md = ShardedTensorMetadata([ShardMetadata([0, 0], [4, 3], "rank:0/cpu")], torch.Size([4, 3]), TensorProperties())
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        [Shard(torch.ones(4, 3), md.shards_metadata[0])], md
    )


CALLS: dict[str, Callable[[ShardedTensor], Any]] = {
    "torch.nn.functional.softmax": lambda st: F.softmax(st, dim=1),
    "torch.nn.functional.log_softmax": lambda st: F.log_softmax(st, dim=1),
    "torch.nn.functional.embedding": lambda st: F.embedding(torch.tensor([0, 2]), st),
    "torch.nn.functional.embedding_bag": lambda st: F.embedding_bag(torch.tensor([[0, 2]]), st),
}


def test_every_op_of_the_plugin_has_a_call_here() -> None:
    assert set(CALLS) == _attributed()


@pytest.mark.parametrize("name", sorted(CALLS))
def test_without_the_plugin_each_of_its_ops_says_what_to_install(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setenv("SHARDWISE_BLOCKED_PLUGINS", "embedding")
    _registry.reset()
    with pytest.raises(OpNotFoundError) as info:
        CALLS[name](_weight())
    message = str(info.value)
    assert f"no sharded implementation of {name} for ChunkShardingSpec; no installed plugin implements it" in message
    assert f"`pip install {DISTRIBUTION}`" in message, message
