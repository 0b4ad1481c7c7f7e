"""The layout layer: moving a tensor's data between layouts, from metadata and local tensors.

:mod:`~shardwise._layout.plan` works out a :class:`~shardwise._layout.plan_records.TransferPlan`
(what one rank copies, sends and receives, and how) from metadata alone, and
:mod:`~shardwise._layout.plan_rounds` cuts it into the parts of its rounds;
:mod:`~shardwise._layout.redistribute` executes plans over a ``Group``.
Nothing here knows ``ShardedTensor``: this layer imports only from
``shardwise._vocab`` and ``shardwise._comm``.
"""
