"""An FSDP1 extension whose sharded state dicts hold shardwise ShardedTensors.

``FullyShardedDataParallel`` (FSDP1) with ``StateDictType.SHARDED_STATE_DICT``
cuts every parameter into dim-0 chunks, one per rank, and by default wraps
each chunk in a ``torch.distributed._shard`` ShardedTensor. It builds those
tensors, and reads them back at load, through an ``FSDPExtensions`` object
kept on each FSDP state and flat-parameter handle. :class:`ShardwiseFSDPExtensions`
returns shardwise ShardedTensors there instead, so the state dict goes
straight to ``shardwise.checkpoint`` or ``dcp`` and loads into any shardwise
sharding. With tensor parallelism (DTensor parameters, FSDP over the other
mesh dim's process group) each entry is a nested ShardedTensor: the TP
layout outside, FSDP's chunks of the TP shard inside.

torch 2.13 has no public way to give FSDP1 an extension, so :func:`install`
sets it on the module's FSDP states and handles (the attributes torch's
extension hook reads), and :func:`install_on_wrap` gives it to FSDP1
wrappers as they are built (needed to flatten DTensor parameters). Tested
with torch 2.13 only.
"""

from __future__ import annotations

import contextlib
import copy
import math
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
import torch.distributed.fsdp.fully_sharded_data_parallel as fsdp_impl
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.fsdp._common_utils import _set_fsdp_flattened
from torch.distributed.fsdp._fsdp_extensions import FSDPExtensions
from torch.distributed.fsdp._shard_utils import _all_gather_dtensor, _create_chunk_dtensor
from torch.distributed.fsdp._traversal_utils import _get_fsdp_handles, _get_fsdp_states
from torch.distributed.tensor import DTensor, DeviceMesh, Replicate, Shard
from torch.distributed.tensor.parallel.fsdp import _all_gather_dtensor as _all_gather_tp_dtensor
from torch.distributed.tensor.parallel.fsdp import _chunk_dtensor, _flatten_tensor, _unflatten_tensor

from shardwise import ChunkShardingSpec, ShardedTensor, TensorProperties
from shardwise.sharded_tensor import Shard as LocalShard
from shardwise.torch_group import wrap_process_group
from shardwise_fsdp._dtensor import _check_ascending

__all__ = ["ShardwiseFSDPExtensions", "install", "install_on_wrap"]


class ShardwiseFSDPExtensions(FSDPExtensions):
    """``FSDPExtensions`` producing shardwise ShardedTensors for FSDP1's sharded state dicts.

    Args:
        tensor_parallel: FSDP was given a ``device_mesh`` sliced out of a
            2-D (FSDP x TP) mesh, so its DTensor state dicts keep a TP mesh
            dim (torch's DTensorExtensions case). :func:`install` and
            :func:`install_on_wrap` set it from the FSDP modules.
    """

    def __init__(self, tensor_parallel: bool = False) -> None:
        super().__init__()
        # FSDP's runtime sets the compute stream on whatever extension a state has.
        self.compute_stream: Any = None
        self.tensor_parallel = tensor_parallel

    def pre_flatten_transform(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Optional[Any]]:
        """DTensor parameters (TP) flatten to their local tensor, as with torch's extension; others as they are."""
        if isinstance(tensor, DTensor):
            return _flatten_tensor(tensor)
        return tensor, None

    def post_unflatten_transform(self, tensor: torch.Tensor, param_extension: Any) -> torch.Tensor:
        """The inverse of :meth:`pre_flatten_transform` (a DTensor again for TP parameters)."""
        # As torch's extension: on an accelerator the DTensor is built on FSDP's compute stream.
        handle = getattr(torch, tensor.device.type, None) if tensor.device.type != "cpu" else None
        stream = self.compute_stream or (handle.current_stream() if handle is not None else None)
        scope = handle.stream(stream) if handle is not None and stream is not None else contextlib.nullcontext()
        with scope:
            result: torch.Tensor = _unflatten_tensor(
                tensor, param_extension, device_handle=handle, compute_stream=self.compute_stream
            )
        # Nested FSDP wrapping must not flatten it again.
        _set_fsdp_flattened(result)
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
        """This rank's dim-0 chunk of ``tensor`` over FSDP's ``pg``, as a shardwise ShardedTensor.

        Chunk sizes are ``torch.chunk``'s, as FSDP1 flattens. A tensor-parallel
        parameter (a DTensor ``Shard(d)`` on a 1-D mesh, or a shardwise
        ShardedTensor with one local shard) gives a nested ShardedTensor: the
        outer one is laid out like the parameter over its tensor-parallel
        group, and its one local shard is the FSDP chunking of this rank's
        tensor-parallel shard. ``shardwise.checkpoint`` and ``dcp`` save and
        load it by global offsets, so it reloads into any other layout. A
        ``Replicate()`` DTensor is chunked like a plain tensor (its copies
        hold the same chunks; a checkpoint keeps one).

        Raises:
            ValueError: a DTensor on a mesh of more than one dimension, or with
                a placement other than ``Shard``/``Replicate``.
        """
        if isinstance(tensor, DTensor):
            return _chunk_dtensor_param(tensor, rank, world_size, pg, device)
        if isinstance(tensor, ShardedTensor):
            outer = tensor.local_shards()
            if len(outer) != 1:
                raise ValueError(
                    f"chunk_tensor: a ShardedTensor parameter must have one local shard per rank to nest FSDP "
                    f"chunks in it; rank {tensor.process_group.rank} has {len(outer)}"
                )
            inner = _chunk_plain(outer[0].tensor, rank, world_size, pg, device)
            return _nest(inner, outer[0].metadata, tensor.metadata(), tensor.process_group, tensor.sharding_spec())
        return _chunk_plain(tensor, rank, world_size, pg, device)

    def chunk_dtensor(self, tensor: torch.Tensor, rank: int, device_mesh: DeviceMesh) -> torch.Tensor:
        """FSDP's DTensor state dicts (FSDP given a ``device_mesh``) are left to torch, with or without TP."""
        if _is_tensor_parallel(device_mesh):
            return _chunk_dtensor(tensor, rank, device_mesh)
        return _create_chunk_dtensor(tensor, rank, device_mesh)

    def pre_load_state_dict_transform(self, tensor: torch.Tensor) -> tuple[torch.Tensor, list[Any]]:
        """The tensor FSDP loads from and this rank's shards of it (each with ``.tensor``).

        A nested ShardedTensor (FSDP over tensor parallelism) is unwrapped to
        its inner one: FSDP gathers the chunks of this rank's
        tensor-parallel shard.
        """
        if isinstance(tensor, ShardedTensor):
            local = tensor.local_shards()
            if len(local) == 1 and isinstance(local[0].tensor, ShardedTensor):
                inner = local[0].tensor
                return inner, list(inner.local_shards())
            return tensor, list(local)
        shards = getattr(tensor, "local_shards", None)
        if callable(shards):  # a torch._shard ShardedTensor saved without this extension
            local = list(shards())
            nested: Any = local[0].tensor if len(local) == 1 else None
            if callable(getattr(nested, "local_shards", None)):
                return nested, list(nested.local_shards())
            return tensor, local
        raise TypeError(
            f"FSDP sharded state dict entry is a {type(tensor).__name__}; expected a ShardedTensor "
            "(load a SHARDED_STATE_DICT saved from FSDP)"
        )

    def all_gather_dtensor(self, tensor: DTensor, parent_mesh: Optional[DeviceMesh]) -> torch.Tensor:
        """FSDP's DTensor state dicts are left to torch (the FSDP mesh dims gathered, the TP dim kept)."""
        if self.tensor_parallel:
            result: torch.Tensor = _all_gather_tp_dtensor(tensor, parent_mesh)
            return result
        result = _all_gather_dtensor(tensor, parent_mesh)
        return result


def _is_tensor_parallel(fsdp_mesh: Optional[DeviceMesh]) -> bool:
    """FSDP1 was given a mesh sliced out of a bigger one: the other dims are tensor parallel (torch's rule)."""
    if fsdp_mesh is None:
        return False
    return bool(fsdp_mesh._get_root_mesh() != fsdp_mesh)


def _chunk_plain(
    tensor: torch.Tensor, rank: int, world_size: int, pg: dist.ProcessGroup, device: Optional[torch.device]
) -> ShardedTensor:
    """This rank's ``torch.chunk`` piece of ``tensor`` on dim 0 (a copy), in a ShardedTensor over ``pg``."""
    group = wrap_process_group(pg)
    kind = (device or tensor.device).type
    # Placements name global ranks; chunk r goes to the group's rank r.
    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{g}/{kind}" for g in group.ranks])
    props = TensorProperties(dtype=tensor.dtype, layout=tensor.layout, requires_grad=False)
    md = spec.build_metadata(tensor.size(), props)
    step = math.ceil(tensor.size(0) / world_size) if tensor.dim() and world_size else 0
    local = []
    for shard_md in md.shards_metadata:
        if shard_md.rank == group.global_rank:
            piece = tensor.detach().narrow(0, min(rank * step, tensor.size(0)), shard_md.shard_sizes[0]).clone()
            local.append(LocalShard(piece.to(device) if device is not None else piece, shard_md))
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local, md, process_group=group, sharding_spec=spec
    )


def _chunk_dtensor_param(
    dt: DTensor, rank: int, world_size: int, pg: dist.ProcessGroup, device: Optional[torch.device]
) -> ShardedTensor:
    """FSDP chunks of a tensor-parallel DTensor's local tensor, nested in its TP layout."""
    mesh = dt.device_mesh
    if mesh.ndim != 1:
        raise ValueError(
            f"chunk_tensor: the DTensor parameter lives on a {mesh.ndim}-D mesh; FSDP over tensor parallelism "
            "takes a 1-D tensor-parallel mesh (give FSDP the other dims through its process group)"
        )
    placement = dt.placements[0]
    if not isinstance(placement, Replicate) and type(placement) is not Shard:
        raise ValueError(
            f"chunk_tensor: the DTensor parameter's placement is {type(placement).__name__} ({placement}); "
            "FSDP state dicts take Shard(d) or Replicate() tensor-parallel parameters (redistribute it first)"
        )
    inner = _chunk_plain(dt.to_local(), rank, world_size, pg, device)
    if isinstance(placement, Replicate):
        return inner
    # The outer layout numbers TP shards by group rank, DTensor by mesh position: they must agree.
    _check_ascending(mesh.mesh.cpu(), "chunk_tensor")
    tp = wrap_process_group(mesh.get_group())
    kind = inner.device.type
    spec = ChunkShardingSpec(dim=placement.dim % dt.dim(), placements=[f"rank:{g}/{kind}" for g in tp.ranks])
    md = spec.build_metadata(dt.size(), TensorProperties(dtype=dt.dtype, layout=dt.layout, requires_grad=False))
    mine = [m for m in md.shards_metadata if m.rank == tp.global_rank]
    return _nest(inner, mine[0], md, tp, spec)


def _nest(inner: ShardedTensor, outer_md: Any, md: Any, group: Any, spec: Any) -> ShardedTensor:
    """A ShardedTensor laid out by ``md`` whose one local shard (``outer_md``) is ``inner``."""
    md = copy.deepcopy(md)
    md.tensor_properties.requires_grad = False
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        [LocalShard(inner, outer_md)], md, process_group=group, sharding_spec=spec
    )


def install(fsdp_module: torch.nn.Module, extension: Optional[FSDPExtensions] = None) -> FSDPExtensions:
    """Make every FSDP1 instance in ``fsdp_module`` use ``extension`` (default: a new ShardwiseFSDPExtensions).

    Call it on every rank after wrapping, before taking or loading a
    ``SHARDED_STATE_DICT``. FSDP1 over tensor-parallel (DTensor) parameters
    and a plain process group flattens them through the extension while it
    wraps, so wrap those inside :func:`install_on_wrap` instead. Tested with
    torch 2.13.

    Returns:
        The installed extension.

    Raises:
        TypeError: ``fsdp_module`` contains no ``FullyShardedDataParallel``
            (for ``fully_shard``/FSDP2 models use ``state_dict_from_dtensors``).
    """
    if not isinstance(fsdp_module, torch.nn.Module) or not any(
        isinstance(m, FullyShardedDataParallel) for m in fsdp_module.modules()
    ):
        raise TypeError(
            f"install needs a module wrapped in FullyShardedDataParallel (FSDP1), got {type(fsdp_module).__name__}; "
            "for fully_shard (FSDP2) models convert state dicts with state_dict_from_dtensors instead"
        )
    states = _get_fsdp_states(fsdp_module)
    ext = extension if extension is not None else ShardwiseFSDPExtensions()
    if isinstance(ext, ShardwiseFSDPExtensions):
        ext.tensor_parallel = any(_is_tensor_parallel(getattr(s, "_device_mesh", None)) for s in states)
    for state in states:
        state._fsdp_extension = ext
        _reload_as_dtensors(state)
    for handle in _get_fsdp_handles(fsdp_module):
        handle._fsdp_extension = ext
    return ext


def _reload_as_dtensors(fsdp_state: Any) -> None:
    """Let FSDP1's sharded load put tensor-parallel values back as DTensors.

    Loading a ``SHARDED_STATE_DICT`` through a process group, FSDP1 gathers
    each parameter's chunks into this rank's local tensor and hands that
    plain tensor to ``nn.Module``'s loading, which cannot copy it into a
    DTensor parameter (torch 2.13 has the same gap with its own extension).
    This hook runs after FSDP's own (hooks run in registration order) and
    wraps each such value in the parameter's layout. Registered once per
    FSDP module.
    """
    if getattr(fsdp_state, "_shardwise_reload_hook", None) is not None:
        return

    def hook(module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        for owner_name, owner in module.named_modules():
            for name, param in owner._parameters.items():
                key = f"{prefix}{owner_name}.{name}" if owner_name else f"{prefix}{name}"
                value = state_dict.get(key)
                if (isinstance(param, DTensor) and isinstance(value, torch.Tensor)
                        and not isinstance(value, (DTensor, ShardedTensor))
                        and value.shape == param.to_local().shape):
                    state_dict[key] = DTensor.from_local(
                        value, param.device_mesh, param.placements, run_check=False,
                        shape=param.shape, stride=param.stride(),
                    )

    fsdp_state._shardwise_reload_hook = fsdp_state.register_load_state_dict_pre_hook(hook)


@contextlib.contextmanager
def install_on_wrap(extension: Optional[FSDPExtensions] = None) -> Iterator[FSDPExtensions]:
    """Give every FSDP1 wrapper built inside the block ``extension`` (default: a new ShardwiseFSDPExtensions).

    FSDP1 reads its extension while it flattens the parameters, so
    tensor-parallel (DTensor) parameters wrapped with a plain process group
    need it before wrapping, where :func:`install` is too late::

        parallelize_module(model, mesh_2d["tp"], plan)
        with shardwise_fsdp.install_on_wrap():
            model = FSDP(model, process_group=mesh_2d["dp"].get_group(), use_orig_params=True)

    Its ``SHARDED_STATE_DICT`` then holds nested shardwise ShardedTensors
    (see :meth:`ShardwiseFSDPExtensions.chunk_tensor`), and loading one puts
    the tensor-parallel parameters back as DTensors (from the end of the
    block on: take and load state dicts after it). torch 2.13 has no
    public hook for this; the block replaces the private function FSDP1's
    constructor calls to choose an extension and restores it on exit.
    Tested with torch 2.13.

    Yields:
        The extension the wrappers get.

    Raises:
        RuntimeError: this torch has no such function to replace.
    """
    original = getattr(fsdp_impl, "_init_extension", None)
    if original is None:
        raise RuntimeError(
            f"install_on_wrap: torch {torch.__version__} has no FSDP1 _init_extension to replace (tested with "
            "torch 2.13); wrap first and call shardwise_fsdp.install(model)"
        )
    ext = extension if extension is not None else ShardwiseFSDPExtensions()
    built: list[torch.nn.Module] = []

    def init_extension(state: Any, device_mesh: Optional[DeviceMesh] = None) -> Any:
        original(state, device_mesh)
        if isinstance(ext, ShardwiseFSDPExtensions) and _is_tensor_parallel(device_mesh):
            ext.tensor_parallel = True
        state._fsdp_extension = ext
        built.append(state)
        return state

    fsdp_impl._init_extension = init_extension
    try:
        yield ext
    finally:
        fsdp_impl._init_extension = original
        # FSDP registers its own load hook after choosing the extension; ours must follow it.
        for state in built:
            _reload_as_dtensors(state)
