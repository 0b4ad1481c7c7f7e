"""Conversions between shardwise ShardedTensors and torch DTensors, sharing the local storage.

A DTensor's layout is a device mesh (ranks arranged in n dimensions) and one
placement per mesh dimension: ``Shard(d)`` cuts tensor dim ``d`` into as many
``torch.chunk`` pieces as the mesh dimension has ranks (the last ones shorter
or empty), ``Replicate()`` copies, ``Partial()`` holds summands. A
ShardedTensor's layout is a list of boxes, each on one rank.

* DTensor -> ShardedTensor (:func:`from_dtensor`): every rank computes every
  mesh coordinate's box the way DTensor does; a box held by several ranks
  (replicated mesh dims) is owned by the one at coordinate 0 on those dims.
  1-D ``Shard(d)`` gives a ``ChunkShardingSpec``, anything else an
  ``EnumerableShardingSpec``. The owner's shard is ``dt.to_local()`` itself.
* ShardedTensor -> DTensor (:func:`to_dtensor`): a chunk spec becomes a 1-D
  mesh ordered like its placements with ``Shard(dim)``; boxes that form a
  grid whose cuts are ``torch.chunk``'s become an n-D mesh with ``Shard`` on
  each cut dim; a single whole shard becomes ``Replicate()`` (broadcast from
  its owner). The local tensor is the shard itself where one exists.

Both need torch.distributed initialised (DTensor's collectives run on torch
process groups: gloo, nccl, or shardwise-mpi's ``"mpi4py"``), and the
ShardedTensor's group must number ranks as the mesh does.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from shardwise import (
    ChunkShardingSpec,
    EnumerableShardingSpec,
    ShardMetadata,
    ShardedTensor,
    TensorProperties,
)
from shardwise.sdk import resolve_group
from shardwise.sharded_tensor import Shard as LocalShard

__all__ = ["from_dtensor", "to_dtensor"]

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def _chunk(length: int, parts: int, index: int) -> tuple[int, int]:
    """Offset and length of piece ``index`` of ``parts`` when ``torch.chunk`` cuts ``length``."""
    step = math.ceil(length / parts) if parts else 0
    start = min(index * step, length)
    return start, max(0, min(step, length - start))


def _box_at(size: Sequence[int], placements: Sequence[Any], mesh_shape: Sequence[int], coord: Sequence[int]) -> Box:
    offsets, sizes = [0] * len(size), list(size)
    for placement, parts, index in zip(placements, mesh_shape, coord, strict=True):
        if isinstance(placement, Shard):
            d = placement.dim % len(size)
            start, length = _chunk(sizes[d], parts, index)
            offsets[d] += start
            sizes[d] = length
    return tuple(offsets), tuple(sizes)


def from_dtensor(dt: DTensor, process_group: Any = None) -> ShardedTensor:
    """A ShardedTensor with ``dt``'s global size and values; its local shard is ``dt``'s local tensor.

    Args:
        dt: A DTensor with ``Shard``/``Replicate`` placements on any mesh.
        process_group: The shardwise Group (or torch ProcessGroup) of the
            result; None: the default group. Every rank of the mesh must
            be a member (placements name global ranks, as the mesh does).

    Raises:
        TypeError: ``dt`` is not a DTensor.
        ValueError: a ``Partial`` placement (reduce it first, e.g.
            ``dt.redistribute(mesh, [Replicate()])``), or a mesh rank outside
            the group.
    """
    if not isinstance(dt, DTensor):
        raise TypeError(f"from_dtensor takes a DTensor, got {type(dt).__name__}")
    for i, placement in enumerate(dt.placements):
        if isinstance(placement, Partial) or placement.is_partial():
            raise ValueError(
                f"from_dtensor: placement {i} is Partial ({placement}), a partial sum a ShardedTensor cannot hold; "
                "reduce it first, e.g. dt.redistribute(dt.device_mesh, [Replicate()] * dt.device_mesh.ndim)"
            )
    group = resolve_group(process_group)
    mesh = dt.device_mesh
    _check_ascending(mesh.mesh.cpu(), "from_dtensor")
    ranks = mesh.mesh.tolist() if mesh.ndim else [mesh.mesh.item()]
    mesh_shape = tuple(mesh.mesh.shape)
    size = tuple(dt.shape)
    device = mesh.device_type
    replicated = [i for i, p in enumerate(dt.placements) if isinstance(p, Replicate)]
    shards_md: list[ShardMetadata] = []
    mine: Optional[ShardMetadata] = None
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        if any(coord[i] != 0 for i in replicated):
            continue  # a copy of the box at coordinate 0 on the replicated dims
        rank = _at(ranks, coord)  # a global rank, which is what placements name
        if rank not in group.ranks:
            raise ValueError(
                f"from_dtensor: mesh rank {rank} is not a member of the group (global ranks {list(group.ranks)})"
            )
        offsets, sizes = _box_at(size, dt.placements, mesh_shape, coord)
        md = ShardMetadata(list(offsets), list(sizes), f"rank:{rank}/{device}")
        shards_md.append(md)
        if rank == group.global_rank:
            mine = md
    local = [] if mine is None else [LocalShard(dt.to_local(), mine)]
    spec: Any
    shard_dims = [p.dim % len(size) for p in dt.placements if isinstance(p, Shard)]
    if mesh.ndim == 1 and len(shard_dims) == 1:
        spec = ChunkShardingSpec(dim=shard_dims[0], placements=[f"rank:{r}/{device}" for r in ranks])
    else:
        spec = EnumerableShardingSpec(shards_md)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local, spec.build_metadata(torch.Size(size), _properties(dt)), process_group=group, sharding_spec=spec
    )


def _at(nested: Any, coord: Sequence[int]) -> int:
    for i in coord:
        nested = nested[i]
    return int(nested)


def _properties(dt: DTensor) -> Any:
    return TensorProperties(dtype=dt.dtype, requires_grad=dt.requires_grad)


def to_dtensor(st: ShardedTensor, device_mesh: Optional[DeviceMesh] = None) -> DTensor:
    """A DTensor with ``st``'s global size and values, whose local tensor is ``st``'s local shard.

    Args:
        st: A ShardedTensor whose layout a mesh can express: chunked on one
            dim (every rank of its group holding one chunk), a grid of boxes
            cut like ``torch.chunk`` (one per rank), or one whole shard.
        device_mesh: The mesh to use (its rank layout must match ``st``'s);
            None: built from ``st``'s placements (every rank calls this).

    Raises:
        ValueError: the layout is no mesh placement (an Enumerable spec that
            is not a grid, cuts that are not ``torch.chunk``'s, a rank with
            two shards or none where a mesh needs one), or ``device_mesh``
            lays the ranks out differently.
        RuntimeError: torch.distributed is not initialised.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "to_dtensor needs torch.distributed initialised (DTensor runs on torch process groups: gloo, nccl, "
            "or shardwise-mpi's 'mpi4py'); call shardwise.init() (it initialises torch.distributed on every backend) "
            "or torch.distributed.init_process_group first"
        )
    md = st.metadata()
    size = tuple(st.size())
    device = st.local_shards()[0].tensor.device.type if st.local_shards() else "cpu"
    if len(md.shards_metadata) == 1 and tuple(md.shards_metadata[0].shard_sizes) == size:
        return _replicated(st, device, device_mesh)
    spec = st.sharding_spec()
    layout: Optional[tuple[list[int], list[Any]]]
    if isinstance(spec, ChunkShardingSpec):
        # torch.chunk cuts on both sides, empty trailing chunks included: a 1-D mesh in placement order.
        ranks = [p.rank() for p in spec.placements]
        dim = spec.dim if isinstance(spec.dim, int) else -1
        layout = ([dim % len(size)], ranks) if len(set(ranks)) == len(ranks) else None
    else:
        placed = [((tuple(m.shard_offsets), tuple(m.shard_sizes)), m.rank) for m in md.shards_metadata]
        layout = _grid_of(size, [(b, r) for b, r in placed if r is not None]) if all(
            r is not None for _, r in placed) else None
    if layout is None:
        raise ValueError(
            f"to_dtensor: the {type(spec).__name__} layout of {len(md.shards_metadata)} shard(s) is not a "
            "DTensor placement: shards must form a grid cut like torch.chunk on each sharded dim, one shard per "
            "rank (or be one whole shard); reshard it, e.g. to a ChunkShardingSpec, first"
        )
    dims, rank_grid = layout
    _check_ascending(torch.tensor(rank_grid), "to_dtensor")
    mesh = device_mesh if device_mesh is not None else DeviceMesh(device, torch.tensor(rank_grid))
    expected = torch.tensor(rank_grid)
    if tuple(mesh.mesh.shape) != tuple(expected.shape) or not torch.equal(mesh.mesh.cpu(), expected):
        raise ValueError(
            f"to_dtensor: device_mesh lays ranks out as {mesh.mesh.tolist()}, the ShardedTensor's shards need "
            f"{rank_grid}"
        )
    placements = [Shard(d) for d in dims]
    local = st.local_shards()
    if len(local) > 1:
        raise ValueError("to_dtensor: a rank holds several shards; a DTensor has one local tensor per rank")
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError("to_dtensor: this rank is not in the device mesh")
    offsets, sizes = _box_at(size, placements, tuple(mesh.mesh.shape), coordinate)
    if local:
        tensor = local[0].tensor
    else:
        tensor = torch.empty(sizes, dtype=md.tensor_properties.dtype, device=device)
    return DTensor.from_local(tensor, mesh, placements, run_check=False, shape=torch.Size(size),
                              stride=_contiguous_stride(size))


def _check_ascending(grid: torch.Tensor, what: str) -> None:
    """Refuse meshes whose ranks are not ascending along every mesh dim.

    torch 2.13's DTensor is not consistent on such meshes: a rank's mesh
    coordinate says which chunk it holds, but ``distribute_tensor`` and the
    gathers behind ``full_tensor``/``redistribute`` order chunks by rank in
    the process group (``distribute_tensor`` of 4 rows on the mesh
    ``[3, 2, 1, 0]`` gives rank 3 the last row, not the first). A layout
    there would be read differently by different torch functions, so none is
    produced or accepted.
    """
    for mesh_dim in range(grid.dim()):
        lines = grid.movedim(mesh_dim, -1).reshape(-1, grid.shape[mesh_dim]).tolist()
        if any(line != sorted(line) for line in lines):
            raise ValueError(
                f"{what}: the device mesh {grid.tolist()} does not list ranks in ascending order along mesh dim "
                f"{mesh_dim}; torch {torch.__version__}'s DTensor orders chunks by process-group rank there and "
                "by mesh position elsewhere. Place shards on ascending ranks (reshard first) or use a mesh like "
                "init_device_mesh's"
            )


def _contiguous_stride(size: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(size):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


def _grid_of(size: Sequence[int], boxes: list[tuple[Box, int]]) -> Optional[tuple[list[int], list[Any]]]:
    """The sharded dims and the rank grid if ``boxes`` cut ``size`` like nested ``torch.chunk``, else None.

    For Enumerable layouts: every box non-empty, one per rank, the cuts of
    each sharded dim exactly ``torch.chunk``'s.
    """
    if any(0 in sz for (_, sz), _ in boxes) or len({r for _, r in boxes}) != len(boxes):
        return None
    cuts = [sorted({(off[d], sz[d]) for (off, sz), _ in boxes}) for d in range(len(size))]
    dims = [d for d in range(len(size)) if len(cuts[d]) > 1]
    shape = [len(cuts[d]) for d in dims]
    if not dims or math.prod(shape) != len(boxes):
        return None
    for d, parts in zip(dims, shape, strict=True):
        if cuts[d] != [_chunk(size[d], parts, i) for i in range(parts)]:
            return None
    grid: Any = _nested(shape)
    for (off, sz), rank in boxes:
        cell = grid
        coord = [cuts[d].index((off[d], sz[d])) for d in dims]
        for c in coord[:-1]:
            cell = cell[c]
        cell[coord[-1]] = rank
    return dims, grid


def _nested(shape: Sequence[int]) -> Any:
    if len(shape) == 1:
        return [None] * shape[0]
    return [_nested(shape[1:]) for _ in range(shape[0])]


def _replicated(st: ShardedTensor, device: str, device_mesh: Optional[DeviceMesh]) -> DTensor:
    """A whole-tensor ShardedTensor (one shard) as a replicated DTensor: broadcast from its owner."""
    group = st.process_group
    owner = st.metadata().shards_metadata[0].rank
    mesh = device_mesh if device_mesh is not None else DeviceMesh(device, torch.arange(group.size))
    props = st.metadata().tensor_properties
    if st.local_shards():
        full = st.local_shards()[0].tensor
    else:
        full = torch.empty(tuple(st.size()), dtype=props.dtype, device=device)
    group.broadcast(full, src=owner)
    return DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False,
                              shape=torch.Size(st.size()), stride=_contiguous_stride(st.size()))
