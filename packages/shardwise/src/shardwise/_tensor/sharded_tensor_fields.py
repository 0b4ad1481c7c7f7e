"""``ShardedTensorFields``: a ShardedTensor's fields, and the methods that need nothing but them.

:class:`~shardwise._tensor.sharded_tensor.ShardedTensor` is construction,
the public API and the dispatch of torch functions. This private base class
of it holds the fields construction sets (``_sharding_spec``, ``_metadata``,
``_local_shards``, ``_process_group``, ``_init_rrefs``), ``_replace`` (their
one writer after ``_create``), and the hooks that torch and
``torch.distributed.checkpoint`` call by dunder name and that read nothing
else: ``__torch_dispatch__`` (which refuses), ``__hash__``, ``__repr__``, and
DCP's ``__create_write_items__``, ``__create_chunk_list__`` and
``__get_tensor_shard__``. It is a module of its own only to keep
``sharded_tensor.py`` small. What stays on ``ShardedTensor``: its public
methods (the API reference documents a class's own members, not inherited
ones) and every method that names the class (``_create``, the
constructors, ``__torch_function__``, pickling's pair).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from shardwise._tensor import dcp
from shardwise._tensor.specs import ShardingSpec
from shardwise._vocab.metadata import ShardedTensorMetadata
from shardwise._vocab.shard import Shard

__all__ = ["ShardedTensorFields"]


class ShardedTensorFields(torch.Tensor):
    """The fields of a ShardedTensor and the methods that read or write only them.

    Never instantiated on its own: :class:`~shardwise._tensor.sharded_tensor.ShardedTensor`
    lists it first among its bases, so what is defined here is found on a
    ShardedTensor before anything of ``ShardedTensorBase`` or ``torch.Tensor``.
    """

    _sharding_spec: ShardingSpec
    _metadata: ShardedTensorMetadata
    _local_shards: list[Shard]
    _process_group: Any
    _init_rrefs: bool

    def _replace(
        self,
        *,
        spec: Optional[ShardingSpec] = None,
        metadata: Optional[ShardedTensorMetadata] = None,
        shards: Optional[list[Shard]] = None,
        group: Any = None,
    ) -> None:
        """Swap parts of the layout (after ``_create``, the one writer: reshard, unpickling, in-place ops).

        No validation and no communication: the caller has checked that the
        parts fit together (and, for a collective change, agreed on them).
        Parts passed as None stay as they are.
        """
        if spec is not None:
            self._sharding_spec = spec
        if metadata is not None:
            self._metadata = metadata
        if shards is not None:
            self._local_shards = shards
        if group is not None:
            self._process_group = group

    # -- torch integration -------------------------------------------------
    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        raise RuntimeError(
            f"{func} reached ShardedTensor below __torch_function__ (from C++ or autograd on the wrapper); "
            "ShardedTensor only supports ops with a sharded implementation"
        )

    def __hash__(self) -> int:
        return id(self)

    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"ShardedTensor(size={list(self._metadata.size)}, dtype={self._metadata.tensor_properties.dtype}, "
            f"spec={self._sharding_spec!r}, local_shards={len(self._local_shards)})"
        )

    # -- torch.distributed.checkpoint (see _checkpoint) ---------------------
    def __create_write_items__(self, fqn: str, object: Any) -> list[Any]:
        """DCP: what this rank saves for key ``fqn``: one item per non-empty local shard."""
        return dcp.write_items(self._local_shards, self._metadata.size, fqn)

    def __create_chunk_list__(self) -> list[Any]:
        """DCP: the chunks of the global tensor this rank holds (a load reads what overlaps them)."""
        return dcp.chunk_list(self._local_shards)

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        """DCP: the local shard tensor at ``index.offset`` (the storage itself: loads ``copy_`` into it)."""
        return dcp.tensor_shard(self._local_shards, index)
