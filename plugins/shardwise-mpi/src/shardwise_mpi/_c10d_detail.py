# The overrides take the backend signatures the C++ trampoline calls (as in _c10d.py).
# mypy: disable-error-code="override,assignment"
"""``TORCH_DISTRIBUTED_DEBUG=DETAIL`` for the ``"mpi4py"`` backend: each collective's fingerprint agreed first.

Under ``DETAIL``, torch wraps the groups of its own backends (and of
registered ones) in a ``ProcessGroupWrapper``: before every collective the
ranks compare a fingerprint of the call (the collective, a sequence number,
and the shapes, dtypes and device types of its tensors) and all raise
``RuntimeError("Detected mismatch between collectives on ranks. ...")``
when they differ, instead of mismatched MPI calls corrupting the data or
hanging. torch skips that wrapper for a backend whose creator returns a
``ProcessGroup``, as this one must (a Python group cannot be a C++
``Backend``), so :class:`CheckedMpiProcessGroup` runs the same comparison
itself, one ``MPI_Allgather`` of the pickled fingerprint per collective,
with torch's choice of tensors per collective: none for the all-to-alls and
the coalesced forms (their shapes may differ by design), and none for the
list ``all_gather``/``reduce_scatter`` when the list's tensors differ in
size (uneven on purpose). The creator picks this class when the debug level
is ``DETAIL`` when the group is made; otherwise nothing is checked and
nothing is paid.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, TypeVar

import torch

from shardwise_mpi._c10d import MpiProcessGroup

__all__ = ["CheckedMpiProcessGroup"]

T = TypeVar("T")

Fingerprint = tuple[str, int, tuple[tuple[tuple[int, ...], str, str], ...]]


def _same_size(tensors: Sequence[torch.Tensor]) -> bool:
    return all(t.shape == tensors[0].shape for t in tensors)


def _describe(print_: Fingerprint) -> str:
    op, sequence, tensors = print_
    if not tensors:
        return f"CollectiveFingerPrint(SequenceNumber={sequence}, OpType={op})"
    shapes = ", ".join(str(list(shape)) for shape, _, _ in tensors)
    dtypes = [dtype for _, dtype, _ in tensors]
    devices = [device for _, _, device in tensors]
    return (
        f"CollectiveFingerPrint(SequenceNumber={sequence}, OpType={op}, TensorShape=[{shapes}], "
        f"TensorDtypes={dtypes}, TensorDeviceTypes={devices})"
    )


def _differences(mine: Fingerprint, theirs: Fingerprint) -> str:
    names = ("Op type", "Sequence number")
    found = [f"{name}: {a} vs {b}" for name, a, b in zip(names, mine[:2], theirs[:2], strict=True) if a != b]
    for k, what in enumerate(("Tensor shapes", "Tensor dtypes", "Tensor devices")):
        # Shapes as lists, as torch prints them: [4] rather than (4,).
        a = [list(t[k]) if k == 0 else t[k] for t in mine[2]]
        b = [list(t[k]) if k == 0 else t[k] for t in theirs[2]]
        if a != b:
            found.append(f"{what}: {a} vs {b}")
    return "; ".join(found)


class CheckedMpiProcessGroup(MpiProcessGroup):
    """:class:`~shardwise_mpi._c10d.MpiProcessGroup` that compares each collective's fingerprint across ranks first.

    Every rank raises the same kind of error when they differ, naming
    another rank and what differs; point-to-point calls are not checked (as
    under torch's wrapper). A collective the group runs inside another (the
    coalesced forms run the plain ones) is checked once, as the outer call.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sequence = 0
        self._inside = False

    def __repr__(self) -> str:
        return f"CheckedMpiProcessGroup(rank={self.rank()}, size={self.size()})"

    def _run(self, op: str, tensors: Sequence[torch.Tensor], call: Callable[..., T], *args: Any) -> T:
        """``call(*args)``, after every rank showed the same fingerprint of collective ``op`` on ``tensors``."""
        if self._inside:
            return call(*args)
        self._sequence += 1
        mine: Fingerprint = (
            op,
            self._sequence,
            tuple((tuple(t.shape), str(t.dtype).removeprefix("torch."), t.device.type) for t in tensors),
        )
        with self._watch(f"{op} (the TORCH_DISTRIBUTED_DEBUG=DETAIL check before it)"):
            everyone: list[Fingerprint] = self.comm.allgather(mine)
        for rank, theirs in enumerate(everyone):
            if theirs != mine:
                raise RuntimeError(
                    f"Detected mismatch between collectives on ranks. Rank {self.rank()} is running collective: "
                    f"{_describe(mine)}, but Rank {rank} is running collective: {_describe(theirs)}. Collectives "
                    f"differ in the following aspects: {_differences(mine, theirs)} "
                    '(torch.distributed backend "mpi4py", TORCH_DISTRIBUTED_DEBUG=DETAIL)'
                )
        self._inside = True
        try:
            return call(*args)
        finally:
            self._inside = False

    def barrier(self, opts: Any = None) -> Any:
        return self._run("BARRIER", (), super().barrier, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        return self._run("BROADCAST", tensors, super().broadcast, tensors, opts)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        return self._run("ALLREDUCE", tensors, super().allreduce, tensors, opts)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        return self._run("ALLREDUCE_COALESCED", (), super().allreduce_coalesced, tensors, opts)

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        return self._run("REDUCE", tensors, super().reduce, tensors, opts)

    def _allgather_base(self, output: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> Any:
        return self._run("_ALLGATHER_BASE", (inp,), super()._allgather_base, output, inp, opts)

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        return self._run(
            "ALLGATHER_INTO_TENSOR_COALESCED", (), super().allgather_into_tensor_coalesced, outputs, inputs, opts
        )

    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        checked = inputs if _same_size(output_lists[-1]) else ()  # uneven outputs: shapes differ by design
        return self._run("ALLGATHER", checked, super().allgather, output_lists, inputs, opts)

    def allgather_coalesced(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        return self._run("ALLGATHER_COALESCED", (), super().allgather_coalesced, output_lists, inputs, opts)

    def _reduce_scatter_base(self, output: torch.Tensor, inp: torch.Tensor, opts: Any) -> Any:
        return self._run("_REDUCE_SCATTER_BASE", (inp, output), super()._reduce_scatter_base, output, inp, opts)

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any
    ) -> Any:
        return self._run(
            "REDUCE_SCATTER_TENSOR_COALESCED", (), super().reduce_scatter_tensor_coalesced, outputs, inputs, opts
        )

    def reduce_scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any) -> Any:
        checked = outputs if _same_size(input_lists[-1]) else ()  # uneven inputs: shapes differ by design
        return self._run("REDUCE_SCATTER", checked, super().reduce_scatter, outputs, input_lists, opts)

    def alltoall_base(
        self,
        output: torch.Tensor,
        inp: torch.Tensor,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
        opts: Any = None,
    ) -> Any:
        # Uneven splits are legal: no shapes compared (nor for alltoall).
        split = super().alltoall_base
        return self._run("ALLTOALL_BASE", (), split, output, inp, output_split_sizes, input_split_sizes, opts)

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        return self._run("ALLTOALL", (), super().alltoall, outputs, inputs, opts)

    def gather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> Any:
        return self._run("GATHER", inputs, super().gather, output_lists, inputs, opts)

    def scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any) -> Any:
        return self._run("SCATTER", outputs, super().scatter, outputs, input_lists, opts)

    # The names torch's Python front end calls, bound to the checked forms (the base binds its own).
    all_gather_single = _allgather_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single = _reduce_scatter_base
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced
    all_to_all_single = alltoall_base
