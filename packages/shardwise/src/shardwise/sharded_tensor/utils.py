"""Building a sharded tensor's global metadata from each rank's shards, at torch 2.13's path ``sharded_tensor.utils``.

A torch-compatible public face: the same names and signatures as torch's
module, over shardwise's records and checks (:mod:`shardwise._vocab.metadata`).
``process_group`` arguments take a shardwise ``Group``, a torch
``ProcessGroup`` or None, as everywhere in shardwise; placements name global
ranks, as in torch.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Optional, Sequence

import torch

from shardwise._comm.default_group import resolve_group
from shardwise._vocab.metadata import Placement, ShardMetadata, ShardedTensorMetadata, TensorProperties
from shardwise._vocab.shard import Shard
from shardwise.sharding_spec._internals import check_tensor, validate_non_overlapping_shards_metadata

__all__ = [
    "Shard",
    "ShardedTensorMetadata",
    "TensorProperties",
    "build_global_metadata",
    "build_metadata_from_local_shards",
    "check_tensor",
    "recalc_global_sharded_tensor_metadata",
    "validate_non_overlapping_shards_metadata",
]


def _same_locally(expected: Any, actual: Any, prop: str, rank: int) -> None:
    if expected != actual:
        raise ValueError(
            f"Local shards' tensor {prop} property need to be the same on rank:{rank}! "
            f"Found one local shard tensor {prop}={expected}, the other local shard tensor {prop}={actual}."
        )


def _same_across(expected: Any, actual: Any, prop: str, first: int, other: int) -> None:
    if expected != actual:
        raise ValueError(
            f"ShardedTensor {prop} property does not match from different ranks! "
            f"Found {prop}={expected} on rank:{first}, and {prop}={actual} on rank:{other}; "
            "every rank must pass shards of the same tensor"
        )


def _parse_and_validate_remote_device(pg: Any, remote_device: Any) -> tuple[Optional[int], torch.device]:
    """A placement's (global) rank and device, once checked against ``pg`` (torch 2.13's private name).

    Args:
        pg: The group (shardwise ``Group``, torch ``ProcessGroup`` or None
            for the default group). On a rank outside it, the rank is not
            checked (as in torch).
        remote_device: A :class:`~shardwise.sharding_spec.Placement` (or a
            string or ``_remote_device`` that converts to one).

    Returns:
        ``(rank, device)``; ``rank`` is None for a placement without one.

    Raises:
        ValueError: ``remote_device`` is None, or names a rank outside ``pg``.
        RuntimeError: it names an RPC worker (shardwise has no RPC).
    """
    if remote_device is None:
        raise ValueError("remote device is None: give the shard a placement ('rank:R/DEVICE')")
    placement = Placement(remote_device)
    if placement.worker_name() is not None:
        raise RuntimeError(
            f"RPC framework needs to be initialized for using worker names: {placement.worker_name()} "
            "(shardwise has no RPC; place the shard on a global rank, 'rank:R/DEVICE')"
        )
    rank = placement.rank()
    group = resolve_group(pg)
    if rank is not None and group.is_member and rank not in group.ranks:
        raise ValueError(
            f"Global rank {rank} does not exist in input process group: {list(group.ranks)} "
            f"(placement {placement}; placements name global ranks of the group's members)"
        )
    return rank, placement.device()


def build_metadata_from_local_shards(
    local_shards: list[Shard],
    global_size: torch.Size,
    current_rank: int,
    pg: Any,
) -> ShardedTensorMetadata:
    """This rank's view of the tensor's metadata: its own shards, checked, and the global size.

    The first step of building a ShardedTensor from local shards; ranks
    then gather these and merge them with :func:`build_global_metadata`.
    No communication.

    Args:
        local_shards: This rank's shards (at least one).
        global_size: Size of the whole tensor.
        current_rank: This process's global rank; every shard must be
            placed on it.
        pg: The tensor's group (shardwise ``Group``, torch ``ProcessGroup``
            or None for the default group); shards must be placed on its
            members.

    Returns:
        A :class:`ShardedTensorMetadata` of the local shards, ``global_size``
        and the shards' common tensor properties.

    Raises:
        AssertionError: ``local_shards`` is empty (as in torch 2.13).
        ValueError: a shard is not strided or not contiguous, is placed on
            another rank, a rank outside ``pg`` or another device than its
            tensor's, its size differs from its metadata's, or the shards
            differ in dtype, ``requires_grad`` or pinning.
        RuntimeError: a shard is placed on an RPC worker name.
    """
    if len(local_shards) == 0:
        raise AssertionError("must have local shards! (build_metadata_from_local_shards needs at least one Shard)")
    group = resolve_group(pg)
    first = local_shards[0].tensor
    first_pinned = first.is_pinned()
    for i, shard in enumerate(local_shards):
        tensor, md = shard.tensor, shard.metadata
        rank, device = _parse_and_validate_remote_device(group, md.placement)
        if tensor.layout != torch.strided or tensor.layout != first.layout:
            raise ValueError(
                f"Only torch.strided layout is currently supported, but found {tensor.layout} on "
                f"rank:{current_rank}! (local shard {i})"
            )
        if not tensor.is_contiguous():
            raise ValueError(
                f"Only torch.contiguous_format memory_format is currently supported! (local shard {i} is not "
                "contiguous; call .contiguous() first)"
            )
        if rank != current_rank:
            raise ValueError(
                "Local shard metadata's rank does not match with the rank in its process group! "
                f"Found current rank in the process group: {current_rank}, "
                f"local ShardMetadata placement's rank: {rank}"
            )
        if tensor.device != device:
            raise ValueError(
                "Local shard tensor device does not match with local Shard's placement! "
                f"Found local shard tensor device: {tensor.device}, local shard metadata placement device: {device}"
            )
        _same_locally(md.shard_sizes, list(tensor.size()), "size", current_rank)
        _same_locally(tensor.is_pinned(), first_pinned, "pin_memory", current_rank)
        _same_locally(tensor.dtype, first.dtype, "dtype", current_rank)
        _same_locally(tensor.requires_grad, first.requires_grad, "requires_grad", current_rank)
    props = TensorProperties(
        dtype=first.dtype,
        layout=first.layout,
        requires_grad=first.requires_grad,
        memory_format=torch.contiguous_format,
        pin_memory=first_pinned,
    )
    return ShardedTensorMetadata([s.metadata for s in local_shards], torch.Size(global_size), props)


def _copy(md: ShardedTensorMetadata) -> ShardedTensorMetadata:
    shards = [ShardMetadata(s.shard_offsets, s.shard_sizes, s.placement) for s in md.shards_metadata]
    return ShardedTensorMetadata(shards, torch.Size(md.size), dataclasses.replace(md.tensor_properties))


def build_global_metadata(
    gathered_metadatas: Sequence[Optional[ShardedTensorMetadata]],
    recalc_metadata: bool = False,
) -> ShardedTensorMetadata:
    """Merge every rank's :func:`build_metadata_from_local_shards` into the tensor's global metadata.

    Args:
        gathered_metadatas: One entry per rank, in rank order; None for a
            rank without local shards. Not modified.
        recalc_metadata: Re-cut the shards as a row-wise (dim 0) layout
            in rank order (:func:`recalc_global_sharded_tensor_metadata`).

    Returns:
        A new :class:`ShardedTensorMetadata` holding every rank's shards.

    Raises:
        ValueError: ranks disagree on the global size, dtype,
            ``requires_grad`` or pinning (naming both ranks); the shards
            overlap or do not cover the tensor; or no rank has a shard.
    """
    merged: Optional[ShardedTensorMetadata] = None
    first_rank = 0
    for rank, entry in enumerate(gathered_metadatas):
        if entry is None:
            continue
        if merged is None:
            merged, first_rank = _copy(entry), rank
            continue
        ours, theirs = merged.tensor_properties, entry.tensor_properties
        _same_across(merged.size, entry.size, "global_size", first_rank, rank)
        _same_across(ours.dtype, theirs.dtype, "dtype", first_rank, rank)
        _same_across(ours.requires_grad, theirs.requires_grad, "requires_grad", first_rank, rank)
        _same_across(ours.pin_memory, theirs.pin_memory, "pin_memory", first_rank, rank)
        merged.shards_metadata.extend(_copy(entry).shards_metadata)
    if merged is None:
        raise ValueError("ShardedTensor have no local shards on all ranks! (every entry of gathered_metadatas is None)")
    if recalc_metadata:
        recalc_global_sharded_tensor_metadata(merged, 0)
    validate_non_overlapping_shards_metadata(merged.shards_metadata)
    check_tensor(merged.shards_metadata, merged.size)
    return merged


def recalc_global_sharded_tensor_metadata(
    global_sharded_tensor_metadata: ShardedTensorMetadata, sharded_dim: int
) -> None:
    """Lay the shards out end to end along ``sharded_dim`` in rank order, in place.

    Each shard keeps its sizes; its offset along ``sharded_dim`` becomes the
    total size of the shards before it in (rank, list position) order, and
    its other offsets 0. The tensor's size becomes the first shard's, with
    ``sharded_dim`` the total. (torch 2.13 gave the i-th shard *of the
    list* the i-th offset in rank order, which misplaces shards of
    different sizes listed out of rank order.)

    Args:
        global_sharded_tensor_metadata: Modified in place.
        sharded_dim: The dimension to lay the shards along.

    Raises:
        AssertionError: a shard's placement names no rank (as in torch 2.13).
    """
    md = global_sharded_tensor_metadata
    keyed = []
    for i, shard in enumerate(md.shards_metadata):
        rank = shard.rank
        if rank is None:
            raise AssertionError(
                f"currently only support rw, it should always have valid rank info: shard {i} "
                f"({shard.describe()}) is placed on no rank"
            )
        keyed.append((rank, i))
    order = [i for _, i in sorted(keyed)]
    sizes = [md.shards_metadata[i].shard_sizes[sharded_dim] for i in order]
    for i, offset in zip(order, itertools.accumulate([0, *sizes]), strict=False):
        offsets = md.shards_metadata[i].shard_offsets
        for d in range(len(offsets)):
            offsets[d] = 0
        offsets[sharded_dim] = offset
    if md.shards_metadata:
        total = sum(sizes)
        ndim = len(md.shards_metadata[0].shard_sizes)
        md.size = torch.Size(
            [total if d == sharded_dim % ndim else md.shards_metadata[0].shard_sizes[d] for d in range(ndim)]
        )
