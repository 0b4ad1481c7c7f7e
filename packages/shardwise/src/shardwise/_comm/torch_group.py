"""A :class:`~shardwise.Group` over a ``torch.distributed`` process group.

Backends built on torch's own process groups (gloo, nccl, or any backend a
user initialised with ``torch.distributed``) share this adapter; the gloo and
nccl plugins only choose the torch backend name and the device.

Primitives with uneven sizes are built from what every torch backend
implements correctly: uneven all-gathers and reduce-scatters pad to the
largest chunk, and gather/scatter run as an all-to-all with one receiver or
one sender (gloo's own uneven ``scatter`` raises on one rank and hangs the
others).
"""

from __future__ import annotations

import functools
import gc
import os
import weakref
from array import array
from datetime import timedelta
from typing import Any, Callable, MutableMapping, Optional, Sequence, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d

from shardwise._comm import buffers, local_collectives
from shardwise._comm.group import Group
from shardwise._vocab.launch import LaunchInfo
from shardwise.errors import LaunchError, PeerLostError, ShardwiseError

__all__ = ["TorchGroup", "init_torch_process_group", "wrap_process_group"]

_REDUCE = {
    "sum": dist.ReduceOp.SUM,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "product": dist.ReduceOp.PRODUCT,
}


# torch backends reduce none of these natively; modular arithmetic makes the
# wider sum/product wrap exactly as the narrow one would.
_UPCAST = {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64}


def _device_types(backend: str) -> tuple[str, ...]:
    """Device types a torch backend string (``"cpu:gloo,cuda:nccl"``) moves natively."""
    if ":" in backend:
        return tuple(part.split(":", 1)[0] for part in backend.split(","))
    return {"gloo": ("cpu",), "nccl": ("cuda",)}.get(backend, ("cpu",))


#: gloo all-gathers of at most this many bytes per rank go as one all-to-all (see TorchGroup._all_gather).
_DIRECT_GATHER_BYTES = 256 * 1024


_Primitive = TypeVar("_Primitive", bound=Callable[..., Any])


def _peer_failures(name: str) -> Callable[[_Primitive], _Primitive]:
    """Turn the backend's error inside a primitive into :class:`PeerLostError`.

    Arguments were validated (on every rank) before a primitive runs, so a
    ``RuntimeError`` from torch here is the transport failing: gloo's
    "Connection closed by peer" or "Timed out waiting ...", NCCL's watchdog.
    The message says which rank, which collective, and what to look at.
    """

    def wrap(primitive: _Primitive) -> _Primitive:
        @functools.wraps(primitive)
        def run(self: TorchGroup, *args: Any, **kwargs: Any) -> Any:
            try:
                return primitive(self, *args, **kwargs)
            except RuntimeError as exc:
                # Local failures keep their own type: out of memory (callers catch it to retry
                # smaller), an unsupported operation, shardwise's own errors.
                if isinstance(exc, (ShardwiseError, torch.OutOfMemoryError, NotImplementedError)):
                    raise
                detail = " ".join(str(exc).split())
                raise PeerLostError(
                    f"rank {self.rank} of {self.size}: {self._describe(name)} on the {self.backend} backend "
                    f"failed: {detail}. "
                    "A peer has probably died, stopped calling collectives, or not answered within the "
                    "group's timeout (shardwise.init(timeout=...), SHARDWISE_TIMEOUT); see the other "
                    "ranks' logs. The group cannot be used any more: end the job and resume from a checkpoint."
                ) from exc

        return run  # type: ignore[return-value]

    return wrap


# Every live TorchGroup that made its process group; destroying torch's default
# group destroys them all, so its owner releases them too (TorchGroup.destroy_local).
_owning: weakref.WeakSet[TorchGroup] = weakref.WeakSet()


class TorchGroup(Group):
    """Adapter from a ``torch.distributed.ProcessGroup`` to :class:`~shardwise.Group`.

    Args:
        pg: The torch process group.
        device: Device collectives run on (default: the current CUDA device
            for nccl-only groups, else CPU).
        owns: ``"default"`` if destroying this group must also destroy
            torch's default process group (it was made by
            :func:`init_torch_process_group`), ``"group"`` if it must
            destroy ``pg``, None to leave ``pg`` alone (a user's group).
        verify: See :class:`~shardwise.Group`.
        own_channel: (``pg`` is ``dist.group.WORLD``) Talk on a process group
            of its own over the same ranks, made here by every process, and leave
            ``pg`` to other code: the default group's, whose process group
            ``dist.group.WORLD`` torch code such as DDP uses too. A
            collective of this group's worker thread would otherwise meet
            theirs in a different order on different ranks. The mpi
            backend's group duplicates its communicator likewise.
    """

    def _communicator(self) -> object:
        # Wrappers of one torch process group come and go (wrap_process_group makes a new one when the old
        # is collected); what they share is the process group.
        return self.pg

    def __init__(
        self,
        pg: dist.ProcessGroup,
        *,
        device: Optional[torch.device] = None,
        owns: Optional[str] = None,
        verify: Optional[bool] = None,
        own_channel: bool = False,
    ) -> None:
        backend = str(dist.get_backend(pg))
        devices = _device_types(backend)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if devices == ("cuda",) else torch.device("cpu")
        super().__init__(
            backend=backend,
            rank=dist.get_rank(pg),
            size=dist.get_world_size(pg),
            device=device,
            devices=devices,
            verify=verify,
            # Placements name global ranks; the world group needs no translation table.
            ranks=None if pg is dist.group.WORLD else dist.get_process_group_ranks(pg),
        )
        self._pg: Optional[dist.ProcessGroup] = pg
        self._owns = owns
        # What this group's collectives run on: pg, or one of its own (own_channel).
        self._wire_pg: Optional[dist.ProcessGroup] = None
        if own_channel:
            assert pg is dist.group.WORLD, "own_channel is for the default process group (every process calls)"
            self._wire_pg = dist.new_group(backend=backend, timeout=self._collective_timeout())
        # Ranks on one host move CPU data by cross-memory attach (one copy from the
        # sender's memory; gloo copies through a socket): see shardwise._comm.local_copy.
        self._local_copy = self._device.type == "cpu"
        self._direct_gather = self._device.type == "cpu" and "gloo" in backend
        if owns is not None:
            _owning.add(self)
        # One group per process group: wrapping a process group shardwise made (the default group's is
        # dist.group.WORLD) gives this group, so calls through either name share one worker thread and its order.
        _wrapped[id(pg)] = self

    @property
    def pg(self) -> dist.ProcessGroup:
        """The torch process group (for the default group: ``dist.group.WORLD``, though it talks on its own).

        Raises:
            LaunchError: the group was destroyed (it no longer holds one).
        """
        pg = self._pg
        if pg is None:
            raise LaunchError(
                f"rank {self.rank} of {self.size}: this {self.backend} group was destroyed (by "
                "shardwise.destroy(), destroy() on it, or at interpreter exit) and cannot run collectives; "
                "call shardwise.init() again for a new default group"
            )
        return pg

    @property
    def _wire(self) -> dist.ProcessGroup:
        """The process group this group's collectives run on."""
        pg = self.pg  # raises once destroyed
        return pg if self._wire_pg is None else self._wire_pg

    def _reduction_dtype(self, dtype: torch.dtype) -> torch.dtype:
        if dtype == torch.uint64:
            raise TypeError(f"backend {self.backend!r} cannot reduce uint64 tensors; cast to int64 first")
        return _UPCAST.get(dtype, dtype)

    @_peer_failures("barrier")
    def _barrier(self) -> None:
        if self._device.type == "cuda":
            dist.barrier(group=self._wire, device_ids=[self._device.index or 0])
        else:
            dist.barrier(group=self._wire)

    @_peer_failures("broadcast")
    def _broadcast(self, buf: torch.Tensor, src: int) -> None:
        if local_collectives.broadcast(self, buf, src):
            return
        dist.broadcast(buf, group=self._wire, group_src=src)

    @_peer_failures("all_reduce")
    def _all_reduce(self, buf: torch.Tensor, op: str) -> None:
        dist.all_reduce(buf, op=_REDUCE[op], group=self._wire)

    @_peer_failures("all_gather")
    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor, counts: Sequence[int]) -> None:
        if local_collectives.all_gather(self, out, inp, counts):
            return
        most = max(counts)
        if self._direct_gather and most * inp.element_size() <= _DIRECT_GATHER_BYTES:
            # gloo's all-gather passes the pieces round a ring, one hop after another; its
            # all-to-all sends each peer its piece at once (benchmarks/gloo_rounds.py).
            sent = [inp.numel()] * self.size
            dist.all_to_all_single(out, inp.repeat(self.size), list(counts), sent, group=self._wire)
            return
        if all(c == most for c in counts):
            dist.all_gather_single(out, inp, group=self._wire)
            return
        padded_in = inp.new_zeros(most)
        padded_in[: inp.numel()] = inp
        padded_out = buffers.empty_like(inp, (most * self.size,))
        dist.all_gather_single(padded_out, padded_in, group=self._wire)
        torch.cat([padded_out[r * most : r * most + c] for r, c in enumerate(counts)], out=out)

    @_peer_failures("reduce_scatter")
    def _reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, counts: Sequence[int], op: str) -> None:
        most = max(counts)
        if all(c == most for c in counts):
            dist.reduce_scatter_single(out, inp, op=_REDUCE[op], group=self._wire)
            return
        padded = inp.new_zeros(most * self.size)
        offset = 0
        for r, c in enumerate(counts):
            padded[r * most : r * most + c] = inp[offset : offset + c]
            offset += c
        chunk = inp.new_empty(most)
        dist.reduce_scatter_single(chunk, padded, op=_REDUCE[op], group=self._wire)
        out.copy_(chunk[: counts[self.rank]])

    @_peer_failures("all_to_all")
    def _all_to_all(
        self, out: torch.Tensor, out_counts: Sequence[int], inp: torch.Tensor, in_counts: Sequence[int]
    ) -> None:
        if local_collectives.all_to_all(self, out, out_counts, inp, in_counts):
            return
        dist.all_to_all_single(
            out, inp, output_split_sizes=list(out_counts), input_split_sizes=list(in_counts), group=self._wire
        )

    @_peer_failures("gather")
    def _gather(self, out: Optional[torch.Tensor], counts: Sequence[int], inp: torch.Tensor, dst: int) -> None:
        if not local_collectives.gather(self, out, counts, inp, dst):
            super()._gather(out, counts, inp, dst)

    @_peer_failures("scatter")
    def _scatter(self, out: torch.Tensor, inp: Optional[torch.Tensor], counts: Sequence[int], src: int) -> None:
        if not local_collectives.scatter(self, out, inp, counts, src):
            super()._scatter(out, inp, counts, src)

    def _collective_timeout(self) -> Optional[timedelta]:
        """The process group's collective timeout, or None where the backend does not say."""
        try:
            backend = self.pg._get_backend(self._device)
        except (RuntimeError, ValueError):  # no backend for this device (a custom one): its default applies
            return None
        timeout = getattr(getattr(backend, "options", None), "_timeout", None)
        return timeout if isinstance(timeout, timedelta) else None

    @_peer_failures("new_group")
    def _new_group(self, ranks: Sequence[int]) -> Optional[Group]:
        member = self.rank in ranks
        global_ranks = [dist.get_global_rank(self.pg, r) for r in ranks]
        # torch gives a new group its default timeout (30 min), not its parent's: pass on ours
        # (shardwise.init(timeout=...)) so a subgroup's peer failures surface as soon as the parent's.
        timeout = self._collective_timeout()
        if self.size == dist.get_world_size():
            # Every process calls: torch then names the group from a counter all of them advance together.
            sub = dist.new_group(global_ranks, backend=self.backend, timeout=timeout)
            return TorchGroup(sub, device=self._device, owns="group", verify=self.verify) if member else None
        # Only this group's ranks call, so only the members may make the group (use_local_synchronization),
        # and torch names such a group after its ranks and how many process groups the calling rank holds.
        # Members holding different numbers would wait for each other under different names until the
        # timeout: agree on the numbers first, and bring every member up to the largest.
        held = array("q", [len(_c10d._world.pg_names)])  # private, but what torch's name is made of
        table = array("q", bytes(8 * self.size))
        self._all_gather_ints(table, held)
        if not member:
            return None
        most = max(table[r] for r in ranks)
        # A process group of this rank alone raises its count by one, names nothing a peer makes (its
        # name hashes this rank) and costs no round: the members then name the subgroup alike.
        pads = [
            dist.new_group([dist.get_rank()], backend=self.backend, timeout=timeout, use_local_synchronization=True)
            for _ in range(most - table[self.rank])
        ]
        sub = dist.new_group(global_ranks, backend=self.backend, timeout=timeout, use_local_synchronization=True)
        for pad in pads:
            dist.destroy_process_group(pad)
        return TorchGroup(sub, device=self._device, owns="group", verify=self.verify)

    def _destroy_waits(self) -> bool:
        # Only a group that made process groups waits for its peers before releasing them.
        return self._owns is not None or self._wire_pg is not None

    def destroy(self) -> None:
        """Wait for every rank, then release the process groups this group made.

        The barrier keeps a rank from tearing its connections down while a
        peer still uses them.
        """
        if self._destroy_waits():
            self._barrier()
        self.destroy_local()

    def destroy_local(self) -> None:
        """Release the process group (if this group made it) without waiting for the other ranks.

        torch's ``destroy_process_group``, with no barrier before it. Only a
        collective this rank still has in flight (an ``async_op`` never
        waited for, one a Ctrl-C interrupted) ends first: when its peers
        complete it, or fail, or at the timeout.
        """
        # Cycles may still hold finished collectives' tensors; free them while torch is whole.
        gc.collect()
        owns, self._owns = self._owns, None
        _owning.discard(self)
        wire, self._wire_pg = self._wire_pg, None
        if wire is not None and dist.is_initialized() and owns != "default":
            # This group's own (own_channel); torch's default group takes it along when destroyed.
            dist.destroy_process_group(wire)
        if owns == "default":
            if dist.is_initialized():
                dist.destroy_process_group()
            # torch destroyed every process group with its default one, so the
            # subgroups shardwise made let go of theirs as well.
            for group in list(_owning):
                group._owns = None
                group._pg = None
            _owning.clear()
        elif owns == "group":
            dist.destroy_process_group(self.pg)
        if owns is not None:
            # Dropping the last reference deletes the C++ process group, which
            # (with the GIL released) joins gloo's worker threads. Left running,
            # a worker may still be handing back a finished collective when the
            # interpreter finalizes: that needs the GIL (to free the tensors or
            # autograd context the work holds), Python ends the thread instead,
            # and the process aborts with "terminate called without an active
            # exception" (SIGABRT). A process group the user also holds lives on.
            self._pg = None


def init_torch_process_group(
    backend: str,
    launch: LaunchInfo,
    timeout: timedelta,
    *,
    device: Optional[torch.device] = None,
    before_init: Optional[Callable[[dist.Store], object]] = None,
) -> TorchGroup:
    """Rendezvous and make a torch process group for ``launch``.

    If ``torch.distributed`` is not initialised yet, this initialises its
    default process group (so torch-native code — DTensor, distributed
    checkpoint — runs too) with a ``TCPStore`` at the launch's
    ``master_addr:master_port``. Under torchrun's agent store
    (``TORCHELASTIC_USE_AGENT_STORE=True``) every rank connects as a client.
    If torch is already initialised with the same world, the group reuses
    it (or makes a new group of ``backend`` over it).

    A group over torch's default process group keeps ``dist.group.WORLD``
    as its ``pg`` but talks on a process group of its own over the same
    ranks, made here by every process: torch code on ``dist.group.WORLD``
    (DDP, DTensor) then never meets the group's asynchronous collectives,
    which run on its worker thread.

    Args:
        backend: torch backend name (``"gloo"``, ``"nccl"``).
        launch: What the launcher said about this job.
        timeout: Rendezvous and collective timeout.
        device: Device to bind (``cuda:<local rank>`` for nccl).
        before_init: Called with the rendezvous store once every rank can
            reach it and before the process group is made (its return value is
            ignored), for choices
            that need the other ranks (shardwise-gloo picks its network
            interface here). Not called when torch was already initialised.

    Raises:
        LaunchError: no rendezvous address is known for a multi-rank job,
            or the rendezvous fails.
    """
    if dist.is_initialized():
        if dist.get_world_size() != launch.world_size or dist.get_rank() != launch.rank:
            raise LaunchError(
                f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but the launcher says rank {launch.rank} of {launch.world_size}"
            )
        world = dist.group.WORLD
        assert world is not None
        if str(dist.get_backend(world)) == backend:
            return TorchGroup(world, device=device, own_channel=True)
        return TorchGroup(dist.new_group(backend=backend, timeout=timeout), device=device, owns="group")
    if launch.world_size == 1 and (launch.master_addr is None or launch.master_port is None):
        store: dist.Store = dist.HashStore()
    else:
        if launch.master_addr is None or launch.master_port is None:
            given = (("MASTER_ADDR", launch.master_addr), ("MASTER_PORT", launch.master_port))
            missing = [name for name, value in given if value is None]
            raise LaunchError(
                f"backend {backend!r} needs a rendezvous address, but the {launch.launcher} launch "
                f"does not provide {' and '.join(missing)}: {launch.rendezvous_hint}"
            )
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        try:
            store = dist.TCPStore(
                launch.master_addr,
                launch.master_port,
                launch.world_size,
                is_master=launch.rank == 0 and not agent_store,
                timeout=timeout,
                multi_tenant=not agent_store,
            )
        except (RuntimeError, OSError) as exc:
            raise LaunchError(
                f"rank {launch.rank} could not rendezvous at {launch.master_addr}:{launch.master_port} "
                f"within {timeout.total_seconds():g}s ({exc}). Check that MASTER_ADDR is reachable "
                "from every rank, MASTER_PORT is free on it, and every rank was started."
            ) from exc
    if before_init is not None:
        before_init(store)
    kwargs: dict[str, Any] = {}
    if device is not None and device.type == "cuda":
        kwargs["device_id"] = device
    dist.init_process_group(
        backend, store=store, rank=launch.rank, world_size=launch.world_size, timeout=timeout, **kwargs
    )
    world = dist.group.WORLD
    assert world is not None
    return TorchGroup(world, device=device, owns="default", own_channel=True)


# Keyed by id; the entry dies with the wrapper. A live TorchGroup holds its
# process group until destroyed (``_pg`` None), after which the id may be reused.
_wrapped: MutableMapping[int, TorchGroup] = weakref.WeakValueDictionary()


def wrap_process_group(pg: dist.ProcessGroup) -> TorchGroup:
    """The :class:`TorchGroup` over a torch process group: the one already made over it, else a new one."""
    group = _wrapped.get(id(pg))
    # None yet, one whose process group is gone (its id reused), or one destroyed over a process group that lives on.
    if group is None or group._pg is not pg or group._destroyed:
        group = TorchGroup(pg)  # registers itself
    return group
