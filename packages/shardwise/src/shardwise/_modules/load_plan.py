"""A checkpoint load's local plan: which saved chunks each local chunk reads, found through an index.

torch 2.13's ``create_default_local_load_plan`` sorts and sweeps every saved
chunk of every tensor for each rank (O(n log n) per tensor over all n saved
chunks, in Python, before it looks at its own chunks). :func:`local_load_plan`
gives the same read items (same boxes, offsets and indices; listed in
another order, which DCP does not depend on) through a
:class:`~shardwise._vocab.box_index.BoxIndex` of each tensor's saved chunks,
so only the chunks near a local chunk are compared with it.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any, Optional

import torch

from shardwise._vocab.box_index import BoxIndex

__all__ = ["IndexCache", "local_load_plan", "read_items"]

_OFFSETS = attrgetter("offsets")
_SIZES = attrgetter("sizes")


class IndexCache:
    """The index of the last saved layout seen per (tensor size, chunk count), reused by tensors saved alike.

    Models hold many tensors of one shape saved the same way (the layers of
    a transformer); comparing a tensor's chunk boxes with the cached ones is
    two list comparisons in C, far cheaper than sorting them again.
    """

    def __init__(self) -> None:
        self._last: dict[tuple[Any, int], tuple[list[Any], list[Any], BoxIndex]] = {}

    def index(self, md: Any) -> BoxIndex:
        """A :class:`BoxIndex` of ``md.chunks`` (``md`` a ``TensorStorageMetadata``)."""
        offsets = list(map(_OFFSETS, md.chunks))
        sizes = list(map(_SIZES, md.chunks))
        key = (tuple(md.size), len(offsets))
        hit = self._last.get(key)
        if hit is not None and hit[0] == offsets and hit[1] == sizes:
            return hit[2]
        built = BoxIndex(offsets, sizes)
        self._last[key] = (offsets, sizes, built)
        return built


def read_items(fqn: str, md: Any, local_chunks: list[Any], cache: Optional[IndexCache] = None) -> list[Any]:
    """The ``ReadItem`` s that fill ``local_chunks`` from a tensor saved as ``md`` (``TensorStorageMetadata``).

    As torch's ``create_read_items_for_chunk_list``: one item per non-empty
    intersection of a local chunk with a saved chunk, offsets relative to
    each chunk, indices naming the chunk's offsets and its position in its
    list. ``cache`` shares indexes between the tensors of one plan.
    """
    # torch.distributed.checkpoint is heavy to import; only a checkpoint load needs it.
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    saved = md.chunks
    if not local_chunks or not saved:
        return []
    index = (cache or IndexCache()).index(md)
    items = []
    for local_idx, local in enumerate(local_chunks):
        dest_index = MetadataIndex(fqn, local.offsets, local_idx)
        for saved_idx, offsets, sizes in index.query(local.offsets, local.sizes):
            chunk = saved[saved_idx]
            items.append(
                ReadItem(
                    type=LoadItemType.TENSOR,
                    dest_index=dest_index,
                    dest_offsets=torch.Size([o - b for o, b in zip(offsets, local.offsets, strict=True)]),
                    storage_index=MetadataIndex(fqn, chunk.offsets, saved_idx),
                    storage_offsets=torch.Size([o - b for o, b in zip(offsets, chunk.offsets, strict=True)]),
                    lengths=torch.Size(sizes),
                )
            )
    return items


def local_load_plan(state_dict: dict[str, Any], metadata: Any, strict: bool = True) -> Any:
    """torch 2.13's ``create_default_local_load_plan``, its tensors' reads found by :func:`read_items`.

    Raises:
        RuntimeError: ``strict`` and a key of ``state_dict`` is not in the checkpoint.
        ValueError: a tensor's size differs from the saved one.
    """
    # torch.distributed.checkpoint is heavy to import; only a checkpoint load needs it.
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import _create_chunk_list, _create_read_items
    from torch.distributed.tensor import DTensor

    requests = []
    cache = IndexCache()
    for fqn, obj in state_dict.items():
        if fqn not in metadata.state_dict_metadata:
            if strict:
                raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
            continue
        md = metadata.state_dict_metadata[fqn]
        if isinstance(md, TensorStorageMetadata) and getattr(obj, "size", None) is not None and md.size != obj.size():
            raise ValueError(f"Size mismatch between saved {md.size} and current: {obj.size()} for {fqn}")
        if isinstance(obj, DTensor):
            # As torch: a DTensor reads only on the ranks of its mesh, by its own protocol.
            if obj.device_mesh.get_coordinate() is not None:
                requests += _create_read_items(fqn, md, obj)
        elif isinstance(md, TensorStorageMetadata):
            try:
                local_chunks = _create_chunk_list(obj)
            except ValueError as ex:
                raise ValueError(
                    f"Invalid checkpoint metadata for {fqn}, expected BytesStorageMetadata but found {type(md)}"
                ) from ex
            requests += read_items(fqn, md, local_chunks, cache)
        else:
            requests += _create_read_items(fqn, md, obj)
    return LoadPlan(requests)
