"""``gather`` and ``full_tensor``: the whole tensor on one rank or on every rank.

Both work from a tensor's pieces (its local shards, global metadata and
group), so the :class:`~shardwise.ShardedTensor` methods that call them need
not be imported here. ``gather`` is one redistribution into "the whole
tensor on ``dst``" (:mod:`shardwise._layout.redistribute`); ``full_tensor`` is
one all-gather of each rank's shards after the ranks agree, in the same
call, that they hold the same tensor (a digest of its metadata).
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch

from shardwise._comm import buffers
from shardwise._comm.group import Group
from shardwise._layout.plan import owners
from shardwise._layout.redistribute import box, execute, match_sources, plan, row_major_start
from shardwise._tensor.layout_checks import SAME_TENSOR, check_same, layout_digest
from shardwise._tensor.specs import ShardingSpec
from shardwise._vocab.metadata import ShardMetadata, ShardedTensorMetadata, dtype_from_name, dtype_name
from shardwise._vocab.shard import Shard, ShardHolder
from shardwise._vocab.wire import shares_memory

__all__ = ["all_gather_tensor", "gather_to"]


def _whole(md: ShardedTensorMetadata, rank: int, device: str = "cpu") -> ShardedTensorMetadata:
    """``md``'s tensor as one shard on global rank ``rank``."""
    n = len(md.size)
    return ShardedTensorMetadata(
        [ShardMetadata([0] * n, list(md.size), f"rank:{rank}/{device}")], md.size, md.tensor_properties
    )


def _gather_payload(
    shards: list[Shard], md: ShardedTensorMetadata, group: Group, dst: Any, out: Any, dtype: Any, enforce: bool
) -> dict[str, Any]:
    if isinstance(dst, bool) or not isinstance(dst, int) or not 0 <= dst < group.size:
        raise ValueError(f"dst={dst!r} is not a rank of the group (size {group.size})")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or None, got {dtype!r}")
    match_sources(shards, md, group.global_rank)
    payload = {
        "dst": dst,
        "dtype": dtype_name(dtype) if dtype else None,
        "enforce_dtype": enforce,
        "layout": layout_digest(md),
        "out": None,
    }
    size = tuple(md.size)
    if group.rank != dst:
        if out is not None:
            raise ValueError(
                f"Argument ``out`` must NOT be specified on non-destination ranks "
                f"(rank {group.rank}; dst={dst}); pass None"
            )
        return payload
    if out is None:
        raise ValueError(
            f"Argument ``out`` must be specified on destination rank {dst}: a tensor of size {size} to gather into"
        )
    if not isinstance(out, torch.Tensor) or isinstance(out, ShardHolder):
        raise TypeError(f"out must be a plain torch.Tensor, got {type(out).__name__}")
    if tuple(out.size()) != size:
        raise ValueError(f"Argument ``out`` has size {tuple(out.size())}, but should be {size}")
    payload["out"] = dtype_name(out.dtype)
    return payload


def gather_to(
    shards: list[Shard],
    md: ShardedTensorMetadata,
    group: Group,
    dst: int = 0,
    out: Optional[torch.Tensor] = None,
    *,
    enforce_dtype: bool = False,
    dtype: Optional[torch.dtype] = None,
) -> None:
    """Write the whole tensor into ``out`` on rank ``dst`` (torch 2.13's ``ShardedTensor.gather``).

    Every rank sends its shards straight to ``dst`` in one all-to-all;
    ``dst`` copies its own shards without the wire and writes what arrives
    into ``out``.

    Args:
        shards: This rank's local shards.
        md: The tensor's global metadata.
        group: The tensor's group.
        dst: The receiving rank (the same on every rank).
        out: On ``dst``, a tensor of the full size; None elsewhere (torch
            2.13 only notices a non-empty tensor there, shardwise any).
        enforce_dtype: Deprecated (as in torch): cast to ``out``'s dtype.
        dtype: Cast shards to this dtype before sending.

    Raises:
        ValueError: ``out`` is missing on ``dst``, given elsewhere, of the
            wrong size, or of a dtype the data cannot be cast to safely;
            ``dst`` or ``dtype`` differ between ranks. Every rank raises
            (the rank at fault the real error, its peers PeerError when
            the fault is local).
    """
    if enforce_dtype:
        warnings.warn("`enforce_dtype` is deprecated. Please use `dtype` instead.", FutureWarning, stacklevel=4)
    if not group.is_member:
        # dst is a rank of the group, so this rank is not it: nothing to send, nothing to receive.
        if out is not None:
            raise ValueError("Argument ``out`` must NOT be specified on non-destination ranks (this rank is "
                             "outside the tensor's process group); pass None")
        return
    entries = group.agree(
        lambda: _gather_payload(shards, md, group, dst, out, dtype, bool(enforce_dtype)), op="gather", gather=True
    )
    for key in ("dst", "dtype", "enforce_dtype"):
        check_same([e[key] for e in entries], f"gather {key}", f"every rank must pass the same {key}")
    check_same([e["layout"] for e in entries], "tensor's layout (digest of its metadata)", SAME_TENSOR)
    out_dtype = dtype_from_name(entries[dst]["out"])
    wire = md.tensor_properties.dtype
    if dtype is not None:
        wire = dtype
    elif enforce_dtype:
        wire = out_dtype
    if not torch.can_cast(wire, out_dtype):
        raise ValueError(f"gather: cannot write {wire} data into ``out`` of dtype {out_dtype} without losing values")
    target = _whole(md, group.ranks[dst])
    pl = plan(md, target, group.rank, group.size, group.global_to_group())
    sources = match_sources(shards, md, group.global_rank)
    if out is not None:
        # A local shard that is a view of ``out`` (a root that keeps its shard in the result's memory) would
        # be read while the peers' rows and its own land over it: copy it out first.
        sources = {j: t.clone() if shares_memory(t, out) else t for j, t in sources.items()}
    execute(pl, sources, {0: out} if out is not None else {}, group, wire, trusted=True)


def _home_device(shards: list[Shard], md: ShardedTensorMetadata, group: Group) -> torch.device:
    if shards:
        return shards[0].tensor.device
    for entry in md.shards_metadata:
        if entry.placement is not None and entry.placement.rank() == group.global_rank:
            return entry.placement.device()
    return torch.device(group.device)


def _agree_to_gather_all(
    shards: list[Shard], md: ShardedTensorMetadata, spec: ShardingSpec, group: Group
) -> dict[int, torch.Tensor]:
    """This rank's shards by metadata index, once every rank has checked that all hold the same tensor.

    Every rank derives from its own metadata which bytes each peer sends
    and where they go, so ranks holding tensors built with different
    metadata (another size or spec on one rank) would otherwise fail on
    some ranks only, or silently assemble garbage. One agreement
    (``Group.agree``: each rank's status and a digest of its metadata, in
    one small all-gather) lets every rank reach the same verdict.

    Raises:
        ValueError: the ranks' metadata differ (on every rank), or this
            rank's local shards do not match its metadata (on this rank).
        PeerError: another rank's local shards do not match its metadata.
    """
    sources: dict[int, torch.Tensor] = {}

    def check() -> str:
        sources.update(match_sources(shards, md, group.global_rank))
        return layout_digest(md)

    digests = group.agree(check, op="full_tensor", gather=True)
    check_same(
        digests,
        "tensor's layout (digest of its metadata)",
        f"{SAME_TENSOR}; this rank's has size {list(md.size)} and spec {spec!r}",
    )
    return sources


def all_gather_tensor(
    shards: list[Shard], md: ShardedTensorMetadata, spec: ShardingSpec, group: Group
) -> torch.Tensor:
    """The whole tensor on every rank (a new tensor on this rank's shard device, not part of autograd).

    A small all-gather first checks that every rank holds the same tensor
    (its metadata's digest; ValueError on every rank if not), then one
    all-gather of each rank's shards: every rank receives every
    element once. When the shards, taken rank by rank, are consecutive
    row-major ranges of the tensor (a dim-0 chunk spec in rank order), the
    gathered buffer is the result and no further copy is made.
    """
    if not group.is_member:
        raise ValueError(
            "full_tensor: this rank is outside the tensor's process group (torch's GroupMember.NON_GROUP_MEMBER); "
            "only the group's members hold its data"
        )
    dtype, device = md.tensor_properties.dtype, _home_device(shards, md, group)
    if group.size > 1:
        sources = _agree_to_gather_all(shards, md, spec, group)
    else:
        sources = match_sources(shards, md, group.global_rank)
    # After the agreement: every rank holds the same metadata, so this fails on every rank or none.
    holders = owners(md.shards_metadata, len(md.size), "tensor", group.global_to_group(), group.size)
    result = buffers.empty(md.size, dtype, device)
    by_rank: list[list[int]] = [[] for _ in range(group.size)]
    for i, entry in enumerate(md.shards_metadata):
        if entry.numel() > 0:
            by_rank[holders[i]].append(i)
    with torch.no_grad():
        if group.size == 1 or result.numel() == 0:
            for i, t in sources.items():
                # An empty shard may sit anywhere, even past the end, where narrow would refuse its offsets.
                if t.numel():
                    box(result, md.shards_metadata[i].shard_offsets, t.shape).copy_(t)
            return result
        mine = [sources[i] for i in by_rank[group.rank]]
        if len(mine) == 1 and mine[0].is_contiguous() and mine[0].dtype == dtype:
            flat = mine[0].detach().reshape(-1)
        else:
            flat = torch.cat([t.detach().reshape(-1) for t in mine]) if mine else result.new_empty(0)
        parts = [p.view(dtype) for p in group.all_gather(flat.view(torch.uint8))]
        whole = _contiguous_result(parts, md, by_rank)
        if whole is not None:
            return whole.view(md.size).to(device)
        for r, part in enumerate(parts):
            pos = 0
            for i in by_rank[r]:
                entry = md.shards_metadata[i]
                n = entry.numel()
                box(result, entry.shard_offsets, entry.shard_sizes).copy_(part[pos : pos + n].view(entry.shard_sizes))
                pos += n
    return result


def _contiguous_result(
    parts: list[torch.Tensor], md: ShardedTensorMetadata, by_rank: list[list[int]]
) -> Optional[torch.Tensor]:
    """The gathered buffer as the flat result, when it already is one (else None)."""
    expected = 0
    for r in range(len(parts)):
        for i in by_rank[r]:
            entry = md.shards_metadata[i]
            if row_major_start(entry.shard_offsets, entry.shard_sizes, list(md.size)) != expected:
                return None
            expected += entry.numel()
    base = parts[0]
    storage = base.untyped_storage()
    item = base.element_size()
    if storage.nbytes() < base.storage_offset() * item + expected * item:
        return None
    for r, part in enumerate(parts):
        offset = sum(p.numel() for p in parts[:r])
        if part.numel() and part.data_ptr() != base.data_ptr() + offset * item:
            return None
    return base.new_empty(0).set_(storage, base.storage_offset(), (expected,), (1,))
