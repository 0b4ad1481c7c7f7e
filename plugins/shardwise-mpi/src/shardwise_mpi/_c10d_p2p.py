"""Point-to-point messages of the ``"mpi4py"`` torch backend: posted without blocking, finished in ``wait()``.

torch's ``isend``/``irecv`` and ``batch_isend_irecv`` return at once and
let the program post the matching calls before it waits: two ranks that
each ``isend`` to the other and then ``irecv`` from it must not block in
the send. An ``MPI_Send`` of more than the library's eager size waits for
the matching receive, so each message here is an ``MPI_Isend`` or
``MPI_Irecv`` whose request a :class:`P2PWork` completes when the caller
waits (torch's blocking ``send``/``recv`` wait at once). A message is
received into the caller's tensor where it is contiguous CPU memory, else
into a staging tensor copied over in ``wait()``.

Requests the caller never waits for (torch requires the wait, gloo keeps
going without it) stay referenced by their group's :class:`Outstanding`
until MPI has finished them, so no buffer MPI may still read or write is
freed under it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch
from torch._C._distributed_c10d import Work

from shardwise_mpi._c10d_buffers import prefer_huge_pages
from shardwise_mpi._watchdog import Watchdog

__all__ = ["Outstanding", "P2PWork", "post_recv", "post_send"]

#: Requests of groups already shut down that MPI had not finished: kept (never freed) so that a late
#: message lands in memory still owned by this process.
_ABANDONED: list[Any] = []


class Outstanding:
    """A group's posted requests not yet known to be complete, with the tensors they read or write.

    Args:
        mpi: The ``mpi4py.MPI`` module.
    """

    def __init__(self, mpi: Any) -> None:
        self._mpi = mpi
        self._posted: list[tuple[list[Any], Any]] = []

    def add(self, requests: Sequence[Any], keep: Any) -> None:
        """Hold ``keep`` (the buffers) until ``requests`` are complete; drop the entries already complete."""
        self._posted = [(r, k) for r, k in self._posted if not self._mpi.Request.Testall(r)]
        self._posted.append((list(requests), keep))

    def abandon(self) -> None:
        """The group is shutting down: keep what MPI has not finished alive for good (see :data:`_ABANDONED`)."""
        posted, self._posted = self._posted, []
        _ABANDONED.extend((r, k) for r, k in posted if not self._mpi.Request.Testall(r))


class P2PWork(Work):
    """The ``Work`` of posted sends or receives: ``wait()`` completes them (watched by the group's watchdog).

    Args:
        mpi: The ``mpi4py.MPI`` module.
        requests: The posted ``mpi4py`` requests.
        tensors: The caller's tensors (``result()`` gives them).
        finish: Runs once the requests are complete (copies a staged
            receive into the caller's tensor).
        watch: The group's watchdog; a wait longer than its timeout ends
            the job, naming ``what``.
        what: ``"send"`` or ``"recv"``.
    """

    def __init__(
        self,
        mpi: Any,
        requests: Sequence[Any],
        tensors: list[torch.Tensor],
        finish: Callable[[], None],
        watch: Watchdog,
        what: str,
    ) -> None:
        super().__init__()
        self._mpi = mpi
        self._requests = list(requests)
        self._tensors = tensors
        self._finish: Optional[Callable[[], None]] = finish
        self._watch = watch
        self._what = what

    def _done(self) -> None:
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()

    def wait(self, timeout: timedelta = timedelta(seconds=0)) -> bool:
        """Block until every message has gone (a send's buffer may be reused) or arrived."""
        if self._finish is not None:
            with self._watch(self._what):
                self._mpi.Request.Waitall(self._requests)
            self._done()
        return True

    def is_completed(self) -> bool:
        """Whether ``wait()`` would return at once (and, for a receive, the tensor holds the message)."""
        if self._finish is not None:
            if not self._mpi.Request.Testall(self._requests):
                return False
            self._done()
        return True

    def is_success(self) -> bool:
        return self.is_completed()

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._tensors

    def get_future(self) -> torch.futures.Future[Any]:
        """A future of the tensors, complete once the messages are (it waits for them: MPI has no callback)."""
        self.wait()
        fut: torch.futures.Future[Any] = torch.futures.Future()
        fut.set_result(self._tensors)
        return fut


def _checked_tag(mpi: Any, comm: Any, tag: int) -> int:
    """``tag``, if MPI can carry it; else ValueError naming the library's limit."""
    # MPI_TAG_UB hangs off MPI_COMM_WORLD (Open MPI gives None on other communicators; MPICH on all).
    upper = mpi.COMM_WORLD.Get_attr(mpi.TAG_UB)
    if upper is None:
        upper = (1 << 31) - 1
    if not 0 <= tag <= upper:
        raise ValueError(
            f'send/recv: tag {tag} is outside what this MPI library carries (0..{upper}, MPI_TAG_UB); torch backend '
            '"mpi4py" passes tags to MPI as they are: use a smaller one'
        )
    return tag


def post_send(
    mpi: Any, comm: Any, tensors: list[torch.Tensor], dst: int, tag: int
) -> tuple[list[Any], Any, Callable[[], None]]:
    """``MPI_Isend`` each tensor (a contiguous CPU copy where it is not one); the requests, what they read, a no-op."""
    tag = _checked_tag(mpi, comm, tag)
    sources = [t.detach().contiguous().cpu() for t in tensors]
    requests = [
        comm.Isend(
            [mpi.buffer.fromaddress(s.data_ptr(), s.numel() * s.element_size(), readonly=True), mpi.BYTE],
            dest=dst,
            tag=tag,
        )
        for s in sources
    ]
    return requests, sources, _nothing


def _nothing() -> None:
    """A send has nothing to do once its requests are complete."""


def post_recv(
    mpi: Any, comm: Any, tensors: list[torch.Tensor], src: int, tag: int
) -> tuple[list[Any], Any, Callable[[], None]]:
    """``MPI_Irecv`` into each tensor (or a staging tensor); the requests, what they write, and the copy back."""
    tag = _checked_tag(mpi, comm, tag)
    # A dense but permuted tensor (a transpose) is not contiguous: MPI writes bytes in memory order, which
    # its element order is not, so it is staged in row-major order like any other non-contiguous target.
    direct = [t.is_contiguous() and t.device.type == "cpu" for t in tensors]
    buffers = [t.detach() if d else torch.empty(t.shape, dtype=t.dtype) for t, d in zip(tensors, direct, strict=True)]
    requests = []
    for buf in buffers:
        prefer_huge_pages(buf)
        requests.append(
            comm.Irecv([mpi.buffer.fromaddress(buf.data_ptr(), buf.numel() * buf.element_size()), mpi.BYTE], src, tag)
        )

    def finish() -> None:
        for t, buf, d in zip(tensors, buffers, direct, strict=True):
            if not d:
                with torch.no_grad():
                    t.copy_(buf)

    return requests, buffers, finish
