"""The plugin SDK: everything a shardwise plugin needs from the core, public and typed.

Plugins (backends, sharded ops, launchers) import from here and from the
other public modules (``shardwise``, ``shardwise.errors``,
``shardwise.hookspecs``, ``shardwise.torch_group``, ``shardwise.nn.functional``)
and never from a ``shardwise._*`` module: the private layers may change
between releases, this module may not without a deprecation.

What is here:

* **buffers** — :func:`empty`, :func:`empty_like`, :func:`zeros`: the core's
  allocator for large transient buffers (huge pages, a bounded cache of freed
  buffers) and its accounting (:func:`live_bytes`, :func:`peak_new_bytes`,
  :func:`reset_peak`). A plugin that moves data allocates through it so the
  memory bounds the core promises hold for plugin ops too.
  :func:`shares_memory` is the one test of whether two tensors may alias
  (by address span), for collectives that must copy an aliased input first;
  :func:`overlapping` applies it to a whole list at once (one output per
  rank) in O(n log n) instead of over every pair.
* **reduce ops** — :data:`REDUCE_OPS` (the names every backend accepts),
  :data:`BITWISE_REDUCE_OPS` (torch's bitwise ones, for backends of torch's
  process-group API) and :func:`normalize_reduce_op` (``"sum"``, ``torch.distributed.ReduceOp.SUM``,
  ``"prod"`` ... to one of them), so every backend reads ``op=`` the same way.
* **groups** — :class:`Group`, :func:`resolve_group` (every form a
  ``process_group=`` argument takes), :data:`DEFAULT_TIMEOUT`, and
  :class:`Work`, what a collective with ``async_op=True`` returns.
* **one copy on one host** — :func:`local_all_to_all`, :func:`local_scatter`,
  :func:`local_gather`, :func:`local_all_gather`, :func:`local_broadcast`: a backend's primitive
  offers them its flat buffers first; when every rank of the group is on
  this host they move the bytes by cross-memory attach (one copy, straight
  from the sender's memory) and return True on every rank, else False on
  every rank and the backend moves them itself. A backend opts in with a
  class attribute ``_local_copy = True``; the few integers the ranks swap
  (and every agreement's row) go through ``Group._all_gather_ints``, which a
  backend may override with a leaner all-gather of ``array("q")`` buffers. :class:`RoundTrip`: requests out and
  answers back (an all-gather, local work, an all-to-all) in two rounds, its
  addresses riding on the caller's agreement (see
  ``shardwise_embedding``'s column-wise lookups).
* **agreement** — :meth:`Group.agree`, the one "check locally, tell the
  peers, fail together" primitive, and :data:`AGREED_ERRORS`, the error
  kinds it carries to the peers.

Example, a sharded op's prologue in a plugin::

    from shardwise import sdk

    def my_op(types, args, kwargs, process_group):
        group = sdk.resolve_group(process_group)
        ids = group.agree(lambda: check_ids(args[0]), op="my_op")  # raises on every rank, or none
        out = sdk.empty((ids.numel(), 8), torch.float32, ids.device)
"""

from __future__ import annotations

from shardwise._comm.agreement import AGREED_ERRORS
from shardwise._comm.buffers import empty, empty_like, live_bytes, peak_new_bytes, reset_peak, zeros
from shardwise._comm.default_group import DEFAULT_TIMEOUT, resolve_group
from shardwise._comm.group import Group
from shardwise._comm.local_collectives import all_gather as local_all_gather
from shardwise._comm.local_collectives import all_to_all as local_all_to_all
from shardwise._comm.local_collectives import broadcast as local_broadcast
from shardwise._comm.local_collectives import gather as local_gather
from shardwise._comm.local_collectives import scatter as local_scatter
from shardwise._comm.round_trip import RoundTrip
from shardwise._comm.work import Work
from shardwise._vocab.wire import BITWISE_REDUCE_OPS, REDUCE_OPS, normalize_reduce_op, overlapping, shares_memory

__all__ = [
    "AGREED_ERRORS",
    "BITWISE_REDUCE_OPS",
    "DEFAULT_TIMEOUT",
    "REDUCE_OPS",
    "RoundTrip",
    "Group",
    "Work",
    "empty",
    "empty_like",
    "live_bytes",
    "local_all_gather",
    "local_all_to_all",
    "local_broadcast",
    "local_gather",
    "local_scatter",
    "normalize_reduce_op",
    "overlapping",
    "peak_new_bytes",
    "reset_peak",
    "resolve_group",
    "shares_memory",
    "zeros",
]
