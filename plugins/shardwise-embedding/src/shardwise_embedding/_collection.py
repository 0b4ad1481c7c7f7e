"""The sharded embedding-bag collection: many tables, one input and one output exchange per step.

:func:`shard_collection` cuts a dense :class:`EmbeddingBagCollection` by an
:class:`EmbeddingShardingPlan`: each rank keeps its blocks (and the whole of
every ``data_parallel`` table) as parameters. In ``forward`` every rank passes
its own batch and gets its own batch's pooled vectors, equal to the dense
collection's; ``backward`` (collective: every rank calls it) leaves in each
block's gradient the matching rows of the dense gradient of all ranks' losses
(a sparse gradient unless ``sparse_grad=False``), and in each
``data_parallel`` table's the sum over ranks.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, NoReturn, Optional

import torch

from shardwise import Group, sdk
from shardwise_embedding._blocks import LocalBlock
from shardwise_embedding._collection_pooling import CollectionPooling, _LocalTable
from shardwise_embedding._exchange import (
    Dispatched,
    Routes,
    modified_after_prefetch,
    no_batch_messages,
    ranks_without_batch,
    route_ids,
    uneven_batches,
)
from shardwise_embedding._jagged import KeyedJaggedTensor
from shardwise_embedding._keyed_tensor import KeyedTensor
from shardwise_embedding._plan_data import EmbeddingShardingPlan, PlanError, check_budget, plan_fingerprint
from shardwise_embedding._tables import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    TableDict,
    check_input,
    check_weights_pooling,
    feature_order,
)

__all__ = ["ShardedEmbeddingBagCollection", "shard_collection"]

OP = "EmbeddingBagCollection"
_log = logging.getLogger("shardwise.comm")


class ShardedEmbeddingBagCollection(CollectionPooling):
    """An :class:`EmbeddingBagCollection` sharded by a plan over a group (made by :func:`shard_collection`).

    Attributes:
        embedding_bags: One module per table holding this rank's part of it
            as ``weight`` (state-dict key ``embedding_bags.<table>.weight``: a
            ShardedTensor of the whole table, or the table itself when
            ``data_parallel``).
        plan: The plan it executes.
        group: The group its ranks form.
        last_exchange_bytes: ``(sent, received)`` bytes of the last forward's
            two exchanges on this rank.
    """

    def __init__(
        self,
        ebc: EmbeddingBagCollection,
        plan: EmbeddingShardingPlan,
        group: Group,
        sparse_grad: bool = True,
    ) -> None:
        super().__init__()
        tables = ebc.embedding_bag_configs()
        if not isinstance(plan, EmbeddingShardingPlan):
            group.reject(
                TypeError(f"plan must be an EmbeddingShardingPlan, got {type(plan).__name__}"), op="shard_collection"
            )

        def check() -> str:
            on_meta = [t.name for t in tables if ebc._weight(t.name).is_meta]
            if on_meta:
                raise ValueError(
                    f"tables {on_meta} are on the meta device: shard_collection takes each block's values from "
                    "the dense collection; build it on a real device (the same seed on every rank): values from "
                    "a checkpoint load afterwards, into the sharded collection's state dict"
                )
            plan.check(tables, group.size)
            check_budget(tables, plan)
            return plan_fingerprint(tables, plan)

        prints = group.agree(check, op="shard_collection", gather=True)
        if len(set(prints)) > 1:
            groups: dict[str, list[int]] = {}
            for r, p in enumerate(prints):
                groups.setdefault(p, []).append(r)
            raise PlanError(
                "ranks passed different plans or tables to shard_collection: "
                + "; ".join(f"ranks {v} agree with each other" for v in groups.values())
                + ". Make the plan once (e.g. on rank 0, or with the same planner arguments everywhere) "
                "and give every rank the same one (EmbeddingShardingPlan.from_json)"
            )
        self.plan = plan
        self.group = group
        self.sparse_grad = sparse_grad
        self._tables = tables
        self._order = feature_order(tables)
        plans = [plan[t.name] for t in tables]
        device = ebc._weight(tables[0].name).device if tables else torch.device("cpu")
        self._routes = Routes.build(tables, plans, group.size, device)
        self._dtype = tables[0].dtype if tables else torch.float32
        for t in tables[1:]:
            self._dtype = torch.promote_types(self._dtype, t.dtype)
        self.embedding_bags = TableDict()
        for t, p in zip(tables, plans, strict=True):
            dense = ebc._weight(t.name)
            block = LocalBlock(p, group, p.block_of(group.rank))
            (r0, r1), (c0, c1) = block.rows, block.cols
            self.embedding_bags[t.name] = _LocalTable(block, dense.detach()[r0:r1, c0:c1].clone())
        self.last_exchange_bytes = (0, 0)
        self._prefetched: Optional[Dispatched] = None

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        """The tables, in order."""
        return list(self._tables)

    def local_block(self, table: str) -> LocalBlock:
        """This rank's part of ``table``."""
        module = self.embedding_bags[table]
        assert isinstance(module, _LocalTable)
        return module.local_block

    def _check(self, given: Any) -> KeyedJaggedTensor:
        names = [f for f, _ in self._order]
        check_input(given, names)
        kjt: KeyedJaggedTensor = given
        kjt.validate()
        check_weights_pooling(kjt, self._tables)
        if kjt.keys() != names:
            kjt = kjt.select(names)
        for (f, t), bag in zip(self._order, kjt.split([1] * len(names)), strict=True):
            ids = bag.values()
            if ids.numel():
                lo, hi = int(ids.min()), int(ids.max())
                if lo < 0 or hi >= t.num_embeddings:
                    bad = lo if lo < 0 else hi
                    raise IndexError(
                        f"feature {f!r}: id {bad} is out of table {t.name!r}'s rows 0..{t.num_embeddings - 1}"
                    )
        return kjt

    def prefetch(self, features: KeyedJaggedTensor) -> None:
        """Start the input exchange of a batch that a later ``forward`` will pool.

        Collective (every rank calls it, each with its own batch, at the
        same point). The batch is checked and routed now, on every rank
        together (a bad batch raises here: the real error on the rank at
        fault, :class:`~shardwise.PeerError` on the others), and its ids
        start travelling to their tables' owners in the background while
        this rank goes on computing; ``forward(features)`` with the very
        same object then takes the exchanged ids instead of exchanging
        them again. The result is bit-for-bit that of an unprefetched
        ``forward``. One batch at a time may wait prefetched: forward it
        before prefetching the next (forwarding other batches meanwhile is
        fine: they exchange their own ids, as without a prefetch).
        :class:`SparseDistPipeline` calls this for you.

        Args:
            features: The batch, as ``forward`` would take it. Its ids,
                lengths and weights must not change until it has been
                forwarded: ``forward`` raises ValueError if they did (the
                ids already travelled).

        Raises:
            ValueError: a prefetched batch is still waiting for ``forward``
                (on every rank that prefetched twice; PeerError on the others).
            KeyError, IndexError, ValueError, PeerError: as ``forward``.
        """
        self._check_nothing_prefetched()
        versions = features._contents_version() if isinstance(features, KeyedJaggedTensor) else ()
        self._prefetched = dataclasses.replace(self._dispatch(features, async_op=True), versions=versions)

    def _check_nothing_prefetched(self) -> None:
        if self._prefetched is not None:
            self.group.reject(
                ValueError(
                    "prefetch: the batch prefetched before has not been forwarded yet; forward it (the same "
                    "KeyedJaggedTensor object) before prefetching another: one batch waits ahead at a time. "
                    "SparseDistPipeline prefetches too: a loop over another pipeline of this collection that was "
                    "left without ending (its iterator still referenced) holds one; close() that iterator first"
                ),
                op=OP,
            )

    def _prefetch_no_batch(self) -> None:
        """In :meth:`prefetch`'s place on a rank with no batch left: collective, with the peers' prefetch.

        :class:`SparseDistPipeline`'s end of the batches. This rank's input
        message to every rank says it has none (:data:`NO_BATCH`), so that
        peers that do have a batch raise in its ``forward`` rather than
        wait for this rank, and :meth:`_end_of_batches` tells this rank
        whether every rank had run out. One small exchange per loop.
        """
        self._check_nothing_prefetched()
        group = self.group
        work = group.all_to_all(no_batch_messages(group.size, self._device()), async_op=True)
        self._prefetched = Dispatched(None, 0, {}, 0, work)

    def _end_of_batches(self) -> None:
        """Wait for :meth:`_prefetch_no_batch`'s exchange; raise unless every rank had run out of batches too.

        Raises:
            ValueError: a peer had a batch (that peer raises the same error
                in its ``forward``).
        """
        dispatched, self._prefetched = self._prefetched, None
        assert dispatched is not None and dispatched.features is None
        without = ranks_without_batch(dispatched.received())
        if len(without) < self.group.size:
            raise uneven_batches(without, self.group.size)

    def _discard_prefetched(self) -> None:
        """Drop the prefetched batch, if any, once its exchange is done (a pipeline stopped early)."""
        dispatched, self._prefetched = self._prefetched, None
        if dispatched is not None:
            try:
                dispatched.received()
            except Exception:  # noqa: BLE001 - its ids are dropped anyway; a broken group shows at its next call
                _log.debug("a dropped prefetched batch's exchange had failed", exc_info=True)

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pool this rank's batch; collective: every rank of the group calls it, each with its own batch.

        Args:
            features: This rank's bags, keyed by the collection's features
                (any order; every feature present; on any device: they are
                moved to the tables'). If it was passed to :meth:`prefetch`,
                its ids have already been exchanged and are used as they are.

        Returns:
            This rank's ``[batch, sum of dims]`` pooled vectors, features in
            the collection's order.

        Raises:
            KeyError: a feature with no table, or one missing (on this rank;
                the others raise PeerError).
            IndexError: an id outside its table's rows.
            ValueError: lengths that do not add up to the ids, or weights
                with mean pooling; or ``features`` was prefetched and its
                ids, lengths or weights changed in place since.
            PeerError: another rank's input was bad.
        """
        dispatched = self._prefetched
        if dispatched is not None and dispatched.features is features:
            if features._contents_version() != dispatched.versions:
                self._discard_prefetched()
                self._fail_together(modified_after_prefetch())
            self._prefetched = None
        else:
            # Not the prefetched batch (an evaluation batch, activation checkpointing's recompute): its own
            # exchange, as without a prefetch; the prefetched batch keeps waiting, already exchanged.
            dispatched = self._dispatch(features, async_op=False)
        return self._pool(dispatched)

    def _fail_together(self, error: Exception) -> NoReturn:
        """Raise ``error`` here and PeerError on every peer, in the collective the peers are entering.

        For an error of this rank alone before the collective (a bad batch,
        a loader that raised): the peers would otherwise wait in it, or
        take this rank's next collective for it.
        """

        def check() -> None:
            raise error

        self.group.agree(check, op=OP)
        raise AssertionError("unreachable: the agreement re-raises the error")

    def _dispatch(self, features: KeyedJaggedTensor, async_op: bool) -> Dispatched:
        """Check and route ``features``, and start (or run) the exchange of its ids."""
        group = self.group
        try:
            kjt = self._check(features)
            batch = kjt.stride()
            kjt = kjt.to(self._device())  # ids where the tables are (one copy; none when they already are)
            per_table = dict(zip([t.name for t in self._tables], self._split_by_table(kjt), strict=True))
            routes = self._routes
            sharded = [per_table[r.config.name] for r in routes.sharded]
            messages = route_ids(
                routes, [s[0] for s in sharded], [s[1] for s in sharded], [s[2] for s in sharded], batch
            )
        except Exception as exc:  # noqa: BLE001 - any error of this rank's alone: the peers must hear it
            self._fail_together(exc)
        sent = sum(m.numel() * 8 for m in messages)
        if async_op:
            return Dispatched(features, batch, per_table, sent, group.all_to_all(messages, async_op=True))
        return Dispatched(features, batch, per_table, sent, group.all_to_all(messages))

    def _split_by_table(
        self, kjt: KeyedJaggedTensor
    ) -> list[tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]:
        """Each table's ids, lengths (features x batch, key-major) and weights; ``kjt`` in feature order."""
        out = []
        for part in kjt.split([len(t.feature_names) for t in self._tables]):
            out.append((part.values().to(torch.int64), part.lengths(), part.weights_or_none()))
        return out


def shard_collection(
    ebc: EmbeddingBagCollection,
    plan: EmbeddingShardingPlan,
    process_group: Any = None,
    *,
    sparse_grad: bool = True,
) -> ShardedEmbeddingBagCollection:
    """Shard a dense collection by a plan; collective: every rank of the group calls it.

    Every rank passes the same collection (the same tables with the same
    values, e.g. built after the same ``torch.manual_seed``) and the same plan.

    Args:
        ebc: The dense collection whose tables' values the shards start from.
        plan: Where each table goes; made for this group's size and these tables.
        process_group: A shardwise Group, a torch ProcessGroup or None (the default group).
        sparse_grad: Blocks get sparse (row) gradients, which the row-sparse
            optimizers (and torch's SGD, Adagrad, SparseAdam) step in time
            proportional to the rows touched. False: dense gradients, for
            any torch optimizer.

    Returns:
        The sharded collection.

    Raises:
        PlanError: (every rank) the plan is for another world size or other
            tables, is malformed, or ranks passed different plans.
        TypeError: ``ebc`` is not an EmbeddingBagCollection.
    """
    group = sdk.resolve_group(process_group)
    if not isinstance(ebc, EmbeddingBagCollection):
        group.reject(
            TypeError(f"shard_collection takes an EmbeddingBagCollection, got {type(ebc).__name__}"),
            op="shard_collection",
        )
    return ShardedEmbeddingBagCollection(ebc, plan, group, sparse_grad=sparse_grad)
