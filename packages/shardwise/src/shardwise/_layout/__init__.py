"""The layout layer: moving a tensor's data between layouts, from metadata and local tensors.

:mod:`~shardwise._layout.plan` works out a :class:`~shardwise._layout.plan.TransferPlan`
(what one rank copies, sends and receives, and how) from metadata alone;
:mod:`~shardwise._layout.redistribute` executes plans over a ``Group``.
Nothing here knows ``ShardedTensor``: this layer imports only from
``shardwise._vocab`` and ``shardwise._comm``.
"""
