"""An FSDP1 extension whose sharded state dicts hold shardwise ShardedTensors.

``FullyShardedDataParallel`` (FSDP1) with ``StateDictType.SHARDED_STATE_DICT``
cuts every parameter into dim-0 chunks, one per rank, and by default wraps
each chunk in a ``torch.distributed._shard`` ShardedTensor. It builds those
tensors, and reads them back at load, through an ``FSDPExtensions`` object
kept on each FSDP state and flat-parameter handle. :class:`ShardwiseFSDPExtensions`
returns shardwise ShardedTensors there instead, so the state dict goes
straight to ``shardwise.checkpoint`` or ``dcp`` and loads into any shardwise
sharding. DTensor parameters (tensor parallelism) are handled as torch's own
extension handles them.

torch 2.13 has no public way to give FSDP1 an extension, so :func:`install`
sets it on the module's FSDP states and handles (the attributes torch's
extension hook reads). Tested with torch 2.13 only.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fsdp_extensions import FSDPExtensions
from torch.distributed.tensor import DTensor, DeviceMesh

from shardwise import ChunkShardingSpec, ShardedTensor, TensorProperties
from shardwise.sharded_tensor import Shard as LocalShard
from shardwise.torch_group import wrap_process_group

__all__ = ["ShardwiseFSDPExtensions", "install"]


class ShardwiseFSDPExtensions(FSDPExtensions):
    """``FSDPExtensions`` producing shardwise ShardedTensors for FSDP1's sharded state dicts."""

    def __init__(self) -> None:
        super().__init__()
        # FSDP's runtime sets the compute stream on whatever extension a state has.
        self.compute_stream: Any = None

    def pre_flatten_transform(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Optional[Any]]:
        """DTensor parameters (TP) flatten to their local tensor, as with torch's extension; others as they are."""
        if isinstance(tensor, DTensor):
            from torch.distributed.tensor.parallel.fsdp import _flatten_tensor

            return _flatten_tensor(tensor)
        return tensor, None

    def post_unflatten_transform(self, tensor: torch.Tensor, param_extension: Any) -> torch.Tensor:
        """The inverse of :meth:`pre_flatten_transform` (a DTensor again for TP parameters)."""
        from torch.distributed.tensor.parallel.fsdp import _unflatten_tensor

        result: torch.Tensor = _unflatten_tensor(tensor, param_extension)
        return result

    def chunk_tensor(
        self,
        tensor: torch.Tensor,
        rank: int,
        world_size: int,
        num_devices_per_node: int,
        pg: dist.ProcessGroup,
        device: Optional[torch.device] = None,
    ) -> torch.Tensor:
        """This rank's dim-0 chunk of ``tensor`` as a shardwise ShardedTensor over ``pg`` (``torch.chunk`` sizes).

        Raises:
            NotImplementedError: ``tensor`` is already distributed (a DTensor
                or ShardedTensor: FSDP over tensor parallelism), which this
                extension does not nest yet.
        """
        if isinstance(tensor, (DTensor, ShardedTensor)):
            raise NotImplementedError(
                "ShardwiseFSDPExtensions.chunk_tensor: nesting an FSDP chunk inside an already distributed "
                f"parameter ({type(tensor).__name__}, FSDP + tensor parallel) is not supported yet; use "
                "torch's DTensorExtensions (the default) for 2-D FSDP + TP"
            )
        group = wrap_process_group(pg)
        kind = (device or tensor.device).type
        spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/{kind}" for r in range(world_size)])
        props = TensorProperties(dtype=tensor.dtype, layout=tensor.layout, requires_grad=False)
        md = spec.build_metadata(tensor.size(), props)
        step = math.ceil(tensor.size(0) / world_size) if tensor.dim() and world_size else 0
        local = []
        for shard_md in md.shards_metadata:
            if shard_md.rank == rank:
                piece = tensor.detach().narrow(0, min(rank * step, tensor.size(0)), shard_md.shard_sizes[0]).clone()
                local.append(LocalShard(piece.to(device) if device is not None else piece, shard_md))
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            local, md, process_group=group, sharding_spec=spec
        )

    def chunk_dtensor(self, tensor: torch.Tensor, rank: int, device_mesh: DeviceMesh) -> torch.Tensor:
        """FSDP's DTensor state dicts (``_use_dtensor``) are left to torch."""
        from torch.distributed.fsdp._shard_utils import _create_chunk_dtensor

        return _create_chunk_dtensor(tensor, rank, device_mesh)

    def pre_load_state_dict_transform(self, tensor: torch.Tensor) -> tuple[torch.Tensor, list[Any]]:
        """The tensor FSDP loads from and this rank's shards of it (each with ``.tensor``)."""
        if isinstance(tensor, ShardedTensor):
            return tensor, list(tensor.local_shards())
        shards = getattr(tensor, "local_shards", None)
        if callable(shards):  # a torch._shard ShardedTensor saved without this extension
            return tensor, list(shards())
        raise TypeError(
            f"FSDP sharded state dict entry is a {type(tensor).__name__}; expected a ShardedTensor "
            "(load a SHARDED_STATE_DICT saved from FSDP)"
        )

    def all_gather_dtensor(self, tensor: DTensor, parent_mesh: Optional[DeviceMesh]) -> torch.Tensor:
        """FSDP's DTensor state dicts are left to torch."""
        from torch.distributed.fsdp._shard_utils import _all_gather_dtensor

        result: torch.Tensor = _all_gather_dtensor(tensor, parent_mesh)
        return result


def install(fsdp_module: torch.nn.Module, extension: Optional[FSDPExtensions] = None) -> FSDPExtensions:
    """Make every FSDP1 instance in ``fsdp_module`` use ``extension`` (default: a new ShardwiseFSDPExtensions).

    Call it on every rank after wrapping, before taking or loading a
    ``SHARDED_STATE_DICT``. Tested with torch 2.13.

    Returns:
        The installed extension.

    Raises:
        TypeError: ``fsdp_module`` contains no ``FullyShardedDataParallel``
            (for ``fully_shard``/FSDP2 models use ``state_dict_from_dtensors``).
    """
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp._traversal_utils import _get_fsdp_handles, _get_fsdp_states

    if not isinstance(fsdp_module, torch.nn.Module) or not any(
        isinstance(m, FullyShardedDataParallel) for m in fsdp_module.modules()
    ):
        raise TypeError(
            f"install needs a module wrapped in FullyShardedDataParallel (FSDP1), got {type(fsdp_module).__name__}; "
            "for fully_shard (FSDP2) models convert state dicts with state_dict_from_dtensors instead"
        )
    ext = extension if extension is not None else ShardwiseFSDPExtensions()
    for state in _get_fsdp_states(fsdp_module):
        state._fsdp_extension = ext
    for handle in _get_fsdp_handles(fsdp_module):
        handle._fsdp_extension = ext
    return ext
