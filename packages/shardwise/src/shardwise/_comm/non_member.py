"""The stand-in group of a rank outside a subgroup (torch's ``GroupMember.NON_GROUP_MEMBER``)."""

from __future__ import annotations

from typing import NoReturn, Optional, Sequence

import torch

from shardwise._comm.group import Group

__all__ = ["NON_MEMBER", "NonMemberGroup"]


class NonMemberGroup(Group):
    """What a ``process_group=`` argument means on a rank outside that group.

    torch's ``new_group`` returns ``GroupMember.NON_GROUP_MEMBER`` on the
    ranks it leaves out; every rank may still make the same call, and the
    ranks outside get a ShardedTensor with no local shards. This stand-in
    (``rank`` -1, as ``torch.distributed.get_rank`` reports there; ``size``
    0 and ``ranks`` empty, as it knows no member) lets the sharded-tensor
    code tell such a rank apart (``is_member`` is False); it moves no
    data, and any collective on it raises.
    """

    is_member = False

    def __init__(self) -> None:
        super().__init__(backend="none", rank=-1, size=0, device=torch.device("cpu"), devices=(), verify=False)

    @property
    def global_rank(self) -> int:
        """-1: this rank has no rank in the group."""
        return -1

    def group_rank(self, global_rank: int) -> int:
        """Always raises: the members of a group this rank is outside of are unknown here.

        Raises:
            ValueError: always.
        """
        raise ValueError(
            f"cannot translate global rank {global_rank}: this rank is not a member of the process group "
            "(torch's GroupMember.NON_GROUP_MEMBER), so it does not know the group's members"
        )

    def _refuse(self) -> NoReturn:
        raise RuntimeError(
            "this rank is not a member of the process group (torch's GroupMember.NON_GROUP_MEMBER), so it "
            "cannot take part in the group's collectives; only the group's members may call them"
        )

    def _check_async(self) -> None:
        # An asynchronous collective raises at the call too, as a blocking one does, and starts no worker thread.
        self._refuse()

    def _barrier(self) -> None:
        self._refuse()

    def _broadcast(self, buf: torch.Tensor, src: int) -> None:
        self._refuse()

    def _all_reduce(self, buf: torch.Tensor, op: str) -> None:
        self._refuse()

    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor, counts: Sequence[int]) -> None:
        self._refuse()

    def _reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, counts: Sequence[int], op: str) -> None:
        self._refuse()

    def _all_to_all(
        self, out: torch.Tensor, out_counts: Sequence[int], inp: torch.Tensor, in_counts: Sequence[int]
    ) -> None:
        self._refuse()

    def _new_group(self, ranks: Sequence[int]) -> Optional[Group]:
        self._refuse()

    def __repr__(self) -> str:
        return "<NonMemberGroup: this rank is outside the process group>"


#: The one stand-in :func:`shardwise.resolve_group` gives for ``GroupMember.NON_GROUP_MEMBER``.
NON_MEMBER = NonMemberGroup()
