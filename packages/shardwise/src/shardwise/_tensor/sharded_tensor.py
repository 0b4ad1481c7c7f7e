"""``ShardedTensor``: a ``torch.Tensor`` wrapper whose data lives in shards on many ranks.

Its fields, and the dunder hooks that read nothing but them, are on its
private base class :class:`~shardwise._tensor.sharded_tensor_fields.ShardedTensorFields`.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch
from torch.utils import _pytree as pytree

from shardwise._comm.default_group import resolve_group
from shardwise._registry.manager import get_registry
from shardwise._tensor import pickling
from shardwise._tensor.from_shards import assemble_local_shards
from shardwise._tensor.gather import all_gather_tensor, gather_to
from shardwise._tensor.local_shards import match_local_shards, no_default_group, shards_without_group
from shardwise._tensor.placements import (
    agree_on_local_devices,
    check_no_rrefs,
    flatten_size,
    is_local,
    local_device,
    validate_placements,
)
from shardwise._tensor.reshard import reshard_shards
from shardwise._tensor.sharded_tensor_fields import ShardedTensorFields
from shardwise._tensor.specs import ShardingSpec, infer_sharding_spec
from shardwise._vocab.metadata import ShardMetadata, ShardedTensorMetadata, TensorProperties
from shardwise._vocab.shard import Shard
from shardwise._vocab.validation import validate_layout

__all__ = ["ShardedTensor", "ShardedTensorBase", "flatten_size", "validate_placements"]


def _checked_shards_metadata(metadata: ShardedTensorMetadata) -> list[ShardMetadata]:
    """``metadata``'s shards, refused when there are none or the layout is not strided (both init forms check this).

    Raises:
        ValueError: no shards, or a layout other than ``torch.strided``.
    """
    layout = metadata.tensor_properties.layout
    if not metadata.shards_metadata:
        raise ValueError("shards_metadata must not be empty")
    if layout != torch.strided:
        raise ValueError(
            f"only torch.strided layout is supported, got {layout} (Only torch.strided layout is currently supported)"
        )
    return metadata.shards_metadata


class ShardedTensorBase(torch.Tensor):
    """torch 2.13's base class of :class:`ShardedTensor`; every ShardedTensor is one.

    It adds one constructor of its own, the container form of
    :meth:`_init_from_local_shards_and_global_metadata` that ties the
    tensor to no process group.
    """

    @staticmethod
    def __new__(cls, sharding_spec: ShardingSpec, *size: Any, **kwargs: Any) -> ShardedTensor:
        # Only ShardedTensor holds data: the base builds one, as constructing it did when it was an alias.
        return ShardedTensor(sharding_spec, *size, **kwargs)

    @classmethod
    def _init_from_local_shards_and_global_metadata(
        cls,
        local_shards: list[Shard],
        sharded_tensor_metadata: ShardedTensorMetadata,
        sharding_spec: Optional[ShardingSpec] = None,
    ) -> ShardedTensor:
        """Build from shards and the global metadata with no process group and no rank checks.

        As torch 2.13's ``ShardedTensorBase`` variant, which "does not do
        cross rank validations": every shard passed is held by this object,
        whichever rank its placement names and whether or not a process
        group exists, and the tensor is tied to no group.

        Args:
            local_shards: The shards this object holds; each must be an
                entry of the metadata (they need not be contiguous).
            sharded_tensor_metadata: The global metadata.
            sharding_spec: The spec; inferred from the metadata when None.

        Returns:
            A :class:`ShardedTensor` (as torch's) with no process group.

        Raises:
            ValueError: the metadata has no shards, is not strided, its
                shards overlap or do not tile the size, or a shard's tensor
                disagrees with the properties.
            LocalShardsMismatchError: a shard is not an entry of the
                metadata, or two shards have the same entry.
        """
        shards_md = _checked_shards_metadata(sharded_tensor_metadata)
        validate_layout(shards_md, list(sharded_tensor_metadata.size))
        local = shards_without_group(local_shards, sharded_tensor_metadata)
        spec = sharding_spec
        if spec is None:
            spec = infer_sharding_spec(shards_md, sharded_tensor_metadata.size)
        return ShardedTensor._create(spec, sharded_tensor_metadata, local, None)


class ShardedTensor(ShardedTensorFields, ShardedTensorBase):
    """A tensor cut into shards that live on the ranks of a process group.

    Every rank holds a ``ShardedTensor`` object with the global metadata
    (:meth:`metadata`: every shard's box and placement) and the data of its
    own shards (:meth:`local_shards`). Torch functions called on it are
    looked up in the sharded-op registry (fed by the
    ``shardwise_sharded_ops`` hook); an op nobody implements raises
    :class:`~shardwise.errors.OpNotFoundError`.

    Autograd works on the local shards: an op's result holds local tensors
    that are functions of the inputs' local tensors, so ``backward`` on
    them fills ``shard.tensor.grad`` of the inputs' shards.

    Construct with ``ShardedTensor(spec, *size, dtype=..., process_group=...)``
    (uninitialised local shards), the creation functions (:func:`zeros`,
    :func:`rand`, ...), :func:`~shardwise.shard_tensor`, or
    :func:`init_from_local_shards`.

    The constructor's arguments (taken by ``__new__``; a list rather than
    an ``Args:`` section, which doc tools match against ``__init__``):

    - ``sharding_spec``: How to cut the tensor.
    - ``*size``: The size of the whole tensor.
    - ``dtype``: Element type (default ``torch.get_default_dtype()``).
    - ``layout``: Only ``torch.strided``.
    - ``requires_grad``: Whether local shards require grad.
    - ``pin_memory``: Pin CPU shards.
    - ``memory_format``: Only ``torch.contiguous_format``.
    - ``process_group``: Group, torch ProcessGroup or None (default group).
    - ``init_rrefs``: Accepted for torch compatibility; must be False (RPC
      is not supported).
    """

    @staticmethod
    def __new__(
        cls,
        sharding_spec: ShardingSpec,
        *size: Any,
        dtype: Optional[torch.dtype] = None,
        layout: torch.layout = torch.strided,
        requires_grad: bool = False,
        pin_memory: bool = False,
        memory_format: torch.memory_format = torch.contiguous_format,
        process_group: Any = None,
        init_rrefs: bool = False,
    ) -> ShardedTensor:
        if not isinstance(sharding_spec, ShardingSpec):
            raise TypeError(f"expected a ShardingSpec, got {type(sharding_spec).__name__}")
        if layout != torch.strided:
            raise ValueError(
                f"only torch.strided layout is supported, got {layout} (Only torch.strided layout is currently "
                "supported)"
            )
        if memory_format != torch.contiguous_format:
            raise ValueError(
                f"only torch.contiguous_format is supported, got {memory_format} (Only torch.contiguous_format "
                "memory_format is currently supported)"
            )
        check_no_rrefs(init_rrefs)
        group = resolve_group(process_group)
        props = TensorProperties(
            dtype=dtype if dtype is not None else torch.get_default_dtype(),
            layout=layout,
            requires_grad=requires_grad,
            memory_format=memory_format,
            pin_memory=pin_memory,
        )
        metadata = sharding_spec.build_metadata(flatten_size(size), props)
        validate_placements(metadata.shards_metadata, group)
        # Before any rank allocates: a rank without a shard's device raises, and its peers with it.
        agree_on_local_devices([md.placement for md in metadata.shards_metadata], group, "ShardedTensor")
        local = []
        for shard_md in metadata.shards_metadata:
            assert shard_md.placement is not None
            if is_local(shard_md, group):
                tensor = torch.empty(
                    shard_md.shard_sizes,
                    dtype=props.dtype,
                    device=shard_md.placement.device(),
                    requires_grad=requires_grad,
                    pin_memory=pin_memory,
                )
                local.append(Shard(tensor, shard_md))
        return cls._create(sharding_spec, metadata, local, group)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # All work happens in __new__; torch.Tensor.__init__ takes no arguments.
        pass

    @classmethod
    def _create(
        cls,
        spec: ShardingSpec,
        metadata: ShardedTensorMetadata,
        local_shards: list[Shard],
        group: Any,
    ) -> ShardedTensor:
        """The wrapper itself: no validation, no communication."""
        props = metadata.tensor_properties
        if local_shards:
            device = local_shards[0].tensor.device
        else:
            device = local_device(metadata.shards_metadata, group)
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            metadata.size,
            dtype=props.dtype,
            layout=props.layout,
            device=device,
            requires_grad=props.requires_grad,
        )
        # The group may be None here (torch's ShardedTensorBase form, tied to no group).
        r._sharding_spec = spec
        r._metadata = metadata
        r._local_shards = local_shards
        r._process_group = group
        r._init_rrefs = False
        return r

    # -- construction from shards ------------------------------------------
    # torch 2.13's signature, which inserts process_group and init_rrefs before the base's sharding_spec.
    @classmethod
    def _init_from_local_shards_and_global_metadata(  # type: ignore[override]
        cls,
        local_shards: list[Shard],
        sharded_tensor_metadata: ShardedTensorMetadata,
        process_group: Any = None,
        init_rrefs: bool = False,
        sharding_spec: Optional[ShardingSpec] = None,
    ) -> ShardedTensor:
        """Build from this rank's shards and the global metadata, without communication.

        Every rank must pass the same metadata; only local facts are checked
        (shards match their metadata entries, placements, no overlap,
        covering).

        Args:
            local_shards: This rank's shards.
            sharded_tensor_metadata: Global metadata, the same on every rank.
            process_group: Group, torch ProcessGroup or None.
            init_rrefs: Must be False.
            sharding_spec: The spec; inferred from the metadata when None.

        Raises:
            ValueError: the metadata is invalid or the local shards do not
                match this rank's entries.
        """
        check_no_rrefs(init_rrefs)
        if process_group is None and no_default_group():
            # No group anywhere: torch's ShardedTensorBase form, every shard passed is held here.
            return super()._init_from_local_shards_and_global_metadata(
                local_shards, sharded_tensor_metadata, sharding_spec=sharding_spec
            )
        shards_md = _checked_shards_metadata(sharded_tensor_metadata)
        group = resolve_group(process_group)
        validate_placements(shards_md, group)
        validate_layout(shards_md, list(sharded_tensor_metadata.size))
        mine = [md for md in shards_md if is_local(md, group)]
        local = match_local_shards(local_shards, mine, sharded_tensor_metadata.tensor_properties, group.global_rank)
        spec = sharding_spec
        if spec is None:
            spec = infer_sharding_spec(shards_md, sharded_tensor_metadata.size)
        return cls._create(spec, sharded_tensor_metadata, local, group)

    @classmethod
    def _init_from_local_shards(
        cls,
        local_shards: list[Shard],
        *global_size: Any,
        process_group: Any = None,
        init_rrefs: bool = False,
    ) -> ShardedTensor:
        """See :func:`shardwise.sharded_tensor.init_from_local_shards`."""
        spec, metadata, local, group = assemble_local_shards(
            local_shards, *global_size, process_group=process_group, init_rrefs=init_rrefs
        )
        return cls._create(spec, metadata, local, group)

    @classmethod
    def _init_from_local_tensor(
        cls,
        local_tensor: torch.Tensor,
        sharding_spec: ShardingSpec,
        *global_size: Any,
        process_group: Any = None,
        init_rrefs: bool = False,
    ) -> ShardedTensor:
        """Build from this rank's single shard as a plain tensor, without communication.

        ``sharding_spec`` must place exactly one shard on each rank that
        passes a non-empty tensor; ranks with no shard pass an empty one.

        Raises:
            ValueError: the tensor does not match this rank's shard, or the
                spec places several shards on this rank.
        """
        check_no_rrefs(init_rrefs)
        group = resolve_group(process_group)
        if not isinstance(local_tensor, torch.Tensor):
            raise TypeError(f"local_tensor must be a torch.Tensor, got {type(local_tensor).__name__}")
        if not local_tensor.is_contiguous():
            raise ValueError(
                "local_tensor is not contiguous; call .contiguous() first (local_tensor is not a contiguous Tensor.)"
            )
        props = TensorProperties.create_from_tensor(local_tensor)
        metadata = sharding_spec.build_metadata(flatten_size(global_size), props)
        validate_placements(metadata.shards_metadata, group)
        mine = [md for md in metadata.shards_metadata if is_local(md, group)]
        if len(mine) > 1:
            raise ValueError(
                f"the spec places {len(mine)} shards on rank {group.global_rank}; _init_from_local_tensor takes one "
                "tensor per rank (use init_from_local_shards)"
            )
        local: list[Shard] = []
        if mine:
            local.append(Shard(local_tensor, mine[0]))
        elif local_tensor.numel() != 0 and group.is_member:  # outside the group it is ignored, as in torch
            raise ValueError(
                f"the spec places no shard on rank {group.global_rank}, but it passed a tensor of size "
                f"{list(local_tensor.size())}"
            )
        return cls._create(sharding_spec, metadata, local, group)

    # -- accessors ---------------------------------------------------------
    def metadata(self) -> ShardedTensorMetadata:
        """Global metadata: every shard's box and placement, the size, the properties."""
        return self._metadata

    def local_shards(self) -> list[Shard]:
        """This rank's shards (empty when it holds none)."""
        return self._local_shards

    def sharding_spec(self) -> ShardingSpec:
        """The spec the tensor is sharded by."""
        return self._sharding_spec

    def local_tensor(self) -> torch.Tensor:
        """This rank's one shard as a tensor.

        Raises:
            NotImplementedError: this rank holds no shard or several (the
                message says how many; use :meth:`local_shards`).
        """
        n = len(self._local_shards)
        if n != 1:
            raise NotImplementedError(
                f"local_tensor() needs exactly one local shard, but rank {getattr(self._process_group, 'rank', 0)} "
                f"holds {n}; use local_shards() (Only single local shard is supported.)"
            )
        return self._local_shards[0].tensor

    def size(self, dim: Optional[int] = None) -> Any:
        """Size of the whole tensor, or of dimension ``dim``."""
        size = self._metadata.size
        if dim is None:
            return size
        ndim = len(size)
        if not -ndim <= dim < ndim:
            raise IndexError(
                f"dimension {dim} out of range for a tensor of {ndim} dimensions (Dimension out of range "
                f"(expected to be in range of [{-ndim}, {ndim - 1}], but got {dim}))"
            )
        return size[dim]

    def dim(self) -> int:
        """Number of dimensions of the whole tensor."""
        return len(self._metadata.size)

    ndimension = dim

    def is_pinned(self) -> bool:  # type: ignore[override]
        """Whether the local shards are in pinned memory."""
        return self._metadata.tensor_properties.pin_memory

    @property
    def process_group(self) -> Any:
        """The shardwise :class:`~shardwise.Group` the tensor lives in."""
        return self._process_group

    def remote_shards(self) -> dict[int, list[Any]]:
        """torch's RRefs to other ranks' shards; shardwise has no RPC, so there are none.

        Raises:
            NotImplementedError: always (a ``RuntimeError``, as torch raises for
                a tensor built with ``init_rrefs=False``).
        """
        raise NotImplementedError(
            "remote_shards() needs torch RPC, which shardwise does not support; read other ranks' shards with "
            "full_tensor() or gather() (torch: ShardedTensor created with init_rrefs=False, no RRefs to remote "
            "shards available)"
        )

    # -- data movement -----------------------------------------------------
    def reshard(self, resharding_spec: ShardingSpec) -> ShardedTensor:
        """Re-cut the tensor by ``resharding_spec`` in place, and return it.

        Any spec to any spec: one exchange computed from the intersections
        of old and new shards, so each element crosses the wire at most once
        and no rank ever holds the whole tensor. Every rank calls it with
        the same spec (checked: a mismatch is a ValueError on every rank).
        A rank lacking the device of one of its new shards raises a
        ValueError naming it (its peers PeerError) before data moves.
        """
        metadata, shards = reshard_shards(self._local_shards, self._metadata, resharding_spec, self._process_group)
        # reshard_shards checked the spec (a TypeError on a rank that passed something else).
        self._replace(spec=resharding_spec, metadata=metadata, shards=shards)
        return self

    def gather(  # type: ignore[override]
        self,
        dst: int = 0,
        out: Optional[torch.Tensor] = None,
        enforce_dtype: bool = False,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        """Assemble the whole tensor into ``out`` on rank ``dst``.

        Args:
            dst: Rank of the group that receives the tensor.
            out: On ``dst``, a tensor of the full size; None elsewhere.
            enforce_dtype: Cast shards to ``dtype`` (or ``out``'s dtype)
                before sending, as torch 2.13 does.
            dtype: The dtype ``enforce_dtype`` casts to.
        """
        gather_to(
            self._local_shards, self._metadata, self._process_group, dst, out, enforce_dtype=enforce_dtype, dtype=dtype
        )

    def full_tensor(self) -> torch.Tensor:
        """The whole tensor, on every rank.

        A local shard that is itself a ShardedTensor (nested layouts, such as
        FSDP chunks inside a tensor-parallel shard) is first gathered over
        its own group, so every rank of that group takes part.

        Raises:
            ValueError: the ranks hold tensors built with different metadata
                (another size or spec on some rank); raised on every rank.
        """
        shards = self._local_shards
        if any(isinstance(s.tensor, ShardedTensor) for s in shards):
            shards = [Shard(s.tensor.full_tensor() if isinstance(s.tensor, ShardedTensor) else s.tensor, s.metadata)
                      for s in shards]
        return all_gather_tensor(shards, self._metadata, self._sharding_spec, self._process_group)

    # -- torch integration -------------------------------------------------
    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Optional[dict[str, Any]] = None
    ) -> Any:
        kwargs = kwargs or {}
        found: list[ShardedTensor] = []

        def visit(x: Any) -> None:
            if not found and isinstance(x, ShardedTensor):
                found.append(x)

        pytree.tree_map_(visit, args)
        pytree.tree_map_(visit, kwargs)
        if not found:
            raise TypeError(f"{func} dispatched to ShardedTensor without a ShardedTensor argument")
        st = found[0]
        registry = get_registry()
        record = registry.find_op(func, st._sharding_spec)
        if record is None:
            raise registry.op_not_found(func, st._sharding_spec)
        return record.impl(types, args, kwargs, st._process_group)

    def __getstate__(self) -> Any:
        pickling.register_safe_globals(ShardedTensor)
        return pickling.sharded_tensor_state(
            self._sharding_spec, self._metadata, self._local_shards, self._process_group,
            bool(getattr(self, "_is_param", False)),
        )

    def __setstate__(self, state: Any) -> None:
        restored = pickling.restore_state(state)
        self._replace(spec=restored.spec, metadata=restored.metadata, shards=restored.shards, group=restored.group)
        self._init_rrefs = False
        if restored.is_param:
            self._is_param = True


TensorLike = Union[torch.Tensor, ShardedTensor]
