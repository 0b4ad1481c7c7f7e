"""An op that only an optional distribution implements says which one to install (issue 17, defect 4).

The core alone (tox env ``core``: no plugin) is the situation a user without
shardwise-embedding is in. The hint comes from the core's one table,
``KNOWN_OP_DISTRIBUTIONS``; shardwise-embedding's tests check that it names
exactly the ops that plugin registers.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

from shardwise.errors import OpNotFoundError
from shardwise.sharded_tensor import Shard, ShardMetadata, ShardedTensor, ShardedTensorMetadata, TensorProperties


def _sharded() -> ShardedTensor:
    """A 4 x 3 ShardedTensor with one chunk shard, tied to no group (enough to reach the op lookup)."""
    md = ShardedTensorMetadata([ShardMetadata([0, 0], [4, 3], "rank:0/cpu")], torch.Size([4, 3]), TensorProperties())
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        [Shard(torch.ones(4, 3), md.shards_metadata[0])], md
    )


@pytest.mark.parametrize(
    "call",
    [
        lambda st: F.softmax(st, dim=1),
        lambda st: F.log_softmax(st, dim=1),
        lambda st: F.embedding(torch.tensor([0, 2]), st),
    ],
    ids=["softmax", "log_softmax", "embedding"],
)
def test_an_op_of_shardwise_embedding_says_to_install_it(core_only: None, call: Callable[[Any], Any]) -> None:
    with pytest.raises(OpNotFoundError, match=r"no installed plugin implements it\. `pip install shardwise-embedding`"):
        call(_sharded())


def test_an_op_nobody_provides_gets_no_hint(core_only: None) -> None:
    with pytest.raises(OpNotFoundError) as info:
        torch.matmul(_sharded(), torch.ones(3, 2))
    assert "no installed plugin implements it" in str(info.value) and "pip install" not in str(info.value)
