"""A training loop that exchanges the next batch's ids while this batch computes.

In the spirit of TorchRec's ``TrainPipelineSparseDist``: a step of a model
with a :class:`~shardwise_embedding.ShardedEmbeddingBagCollection` starts
with the collection's input exchange (every rank sends each id to the rank
holding its row), which the blocking loop waits for. :class:`SparseDistPipeline`
starts batch i+1's exchange as soon as batch i's embeddings are pooled, so it
travels while batch i runs its dense layers, its backward and its optimizer
steps; and it can load batch i+1 on a background thread while batch i
computes. The model code does not change: the collection recognises the
prefetched batch when the model calls it (:meth:`ShardedEmbeddingBagCollection.prefetch`).

Only the order of work changes, never the numbers: the collectives run in
the same order on every rank, each batch is pooled from the same ids, so the
losses are bit-for-bit those of the blocking loop, provided loading a batch
and the step do not draw from one random generator (batch i+1 is made
during step i, so their draws would interleave in another order). A dense
part under DDP on torch's default process group needs nothing more: the
default group, whose worker moves the exchange ahead, talks on a process
group of its own. A collection on a group over a process group of the
user's talks on that one, so DDP must not use it.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Callable, Generic, Iterable, Iterator, Optional, TypeVar

from torch import nn

from shardwise_embedding._collection import ShardedEmbeddingBagCollection
from shardwise_embedding._exchange import modified_after_prefetch
from shardwise_embedding._jagged import KeyedJaggedTensor

__all__ = ["SparseDistPipeline"]

B = TypeVar("B")

_END = object()  # what the loader returns when the batches run out


class SparseDistPipeline(Generic[B]):
    """Iterate over batches with the next batch's input exchange running during this one's step.

    Iterating yields the batches in order, as iterating ``batches`` would;
    the loop body trains on each as usual, passing the collection (in the
    model's forward) the batch's features: the very object
    ``features(batch)`` returns. Behind it: before yielding batch i the
    pipeline has started batch i's exchange (when batch i-1 had been
    pooled, through a forward hook), and with ``load_ahead`` a background
    thread is loading batch i+1 (the thread only ever runs ``next()`` on
    ``batches``, one call at a time; collectives stay on the caller's
    thread). Memory: one batch beyond the current one is loaded and in
    flight at any time.

    A step may call the collection more than once (activation
    checkpointing recomputes the forward in backward; an evaluation batch):
    the other calls exchange their own ids, as without the pipeline. A step
    that does not call it with its batch at all, on every rank (a batch
    skipped, or a forward that raised and was caught), costs one small
    agreement, and the next batch's exchange starts when the step ends. A
    step that called it only with other objects (a ``features`` that builds
    a new KeyedJaggedTensor, a model that selects or copies it) raises
    ValueError on every rank: the exchange ahead would be wasted.

    Every rank must iterate together, over as many batches (the exchange
    is collective). Ranks that run out of batches at different steps raise
    ``ValueError`` on every rank instead of waiting for each other: a rank
    that has no next batch says so in the exchange the others start for
    theirs, and raises at the end of its loop; the others raise in that
    batch's forward. Reaching the end costs every rank one small exchange.
    A bad next batch (an id out of range; also ``batches`` or ``features``
    raising) fails its exchange on every rank together, the real error on
    the rank at fault and :class:`~shardwise.errors.PeerError` on the
    others; the step being trained completes, and the loop raises the
    error where it would move on to the bad batch.

    A batch must not change once its exchange has started: the loop body
    must not modify the batch in place before the model runs (do it in
    ``batches``), and the batches must not share tensors that loading the
    next one overwrites (a loader refilling one buffer) while
    ``load_ahead`` runs it during the step. Either raises ValueError, on
    every rank, rather than training on ids that half changed.

    Args:
        collection: The sharded collection whose input exchange to run ahead.
        batches: The batches, each a whole training step's input on this rank.
        features: Picks the collection's input out of a batch (the
            :class:`KeyedJaggedTensor` the model will pass to ``collection``).
        load_ahead: Load the next batch on a background thread while this
            one computes (for batches that are made or read, not just
            looked up). Leave it off when making a batch calls collectives
            (on another thread they would meet the step's out of order) or
            must run on the calling thread.

    Raises:
        TypeError: ``collection`` is not a sharded collection.
        ValueError: (while iterating) a step passed the collection other
            objects than its batch's features; a batch changed after its
            exchange started; the ranks ran out of batches at different
            steps (at the end of the loop on the ranks that ran out, in the
            next batch's forward on the others).

    A loop left early (``break``, an error) ends the pipeline: its hook is
    removed and the batch exchanged ahead is dropped. An iterator taken
    with ``iter()`` and abandoned keeps them until it is closed
    (``it.close()``) or garbage-collected.

    Example::

        pipe = SparseDistPipeline(sharded, loader, features=lambda b: b.sparse)
        for batch in pipe:
            loss = loss_fn(model(batch.dense, batch.sparse), batch.labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    """

    def __init__(
        self,
        collection: ShardedEmbeddingBagCollection,
        batches: Iterable[B],
        features: Callable[[B], KeyedJaggedTensor],
        *,
        load_ahead: bool = True,
    ) -> None:
        if not isinstance(collection, ShardedEmbeddingBagCollection):
            raise TypeError(
                f"SparseDistPipeline runs a ShardedEmbeddingBagCollection's exchange ahead, got "
                f"{type(collection).__name__}; shard the collection first (shard_collection)"
            )
        self.collection = collection
        self._batches = batches
        self._features = features
        self._load_ahead = load_ahead

    def __iter__(self) -> Iterator[B]:
        source = iter(self._batches)
        loader = concurrent.futures.ThreadPoolExecutor(1, "shardwise-batch-loader") if self._load_ahead else None
        collection = self.collection
        step = _Step()

        def load_next() -> Any:
            return next(source, _END)

        def start_loading() -> None:
            step.loading = loader.submit(load_next) if loader is not None else None

        def start_next() -> _Ahead:
            """Take the next batch and start its exchange; an error of this rank's alone fails on every rank."""
            try:
                upcoming = step.loading.result() if step.loading is not None else load_next()
                step.loading = None
                if loader is not None and step.ahead.changed():
                    # The loader overwrote the batch being trained while it ran beside the step.
                    raise modified_after_prefetch()
                ahead = _Ahead(upcoming, None if upcoming is _END else self._features(upcoming))
            except Exception as exc:  # noqa: BLE001 - the peers are entering this exchange: they must hear it
                collection._fail_together(exc)
            if ahead.features is None:
                collection._prefetch_no_batch()
            else:
                collection.prefetch(ahead.features)
            return ahead

        def before_forward(module: nn.Module, args: Any, kwargs: Any) -> None:
            if _passed(args, kwargs) is step.ahead.features:
                step.called = True
            else:
                step.others = True

        def after_forward(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            # Batch i is pooled: start batch i+1's exchange now, so that it travels during the rest of step i.
            if step.next is not None or step.error is not None or _passed(args, kwargs) is not step.ahead.features:
                return
            try:
                step.next = start_next()
            except Exception as exc:  # noqa: BLE001 - every rank raised it together: step i may still finish
                step.error = exc

        step.ahead = start_next()
        hooks = [
            collection.register_forward_pre_hook(before_forward, with_kwargs=True),
            collection.register_forward_hook(after_forward, with_kwargs=True),
        ]
        try:
            while step.ahead.batch is not _END:
                start_loading()
                yield step.ahead.batch
                if step.error is not None:
                    error, step.error = step.error, None
                    raise error
                if step.next is None:
                    # The step did not pool its batch (skipped, or its forward raised and was caught): with the
                    # peers' consent, drop that batch's exchange and start the next one's.
                    collection.group.agree(step.check_skipped, op="SparseDistPipeline")
                    collection._discard_prefetched()
                    step.next = start_next()
                step.advance()
            # This rank has no next batch: unless every rank ran out with it, raise (as the peers that had
            # one do in its forward).
            collection._end_of_batches()
        finally:
            for hook in hooks:
                hook.remove()
            # Stopped early (a break, an error): the next batch's exchange ran on every rank; let it finish.
            collection._discard_prefetched()
            if loader is not None:
                loader.shutdown(wait=True, cancel_futures=True)


def _passed(args: Any, kwargs: Any) -> Any:
    """The features a call of the collection passed (positionally or by name)."""
    return args[0] if args else kwargs.get("features")


class _Ahead:
    """A batch whose exchange has started: the batch, its features and their versions at that moment."""

    def __init__(self, batch: Any, features: Optional[KeyedJaggedTensor]) -> None:
        self.batch = batch
        self.features = features
        self.versions = features._contents_version() if isinstance(features, KeyedJaggedTensor) else ()

    def changed(self) -> bool:
        """Whether the features' ids, lengths or weights changed in place since the exchange started."""
        return isinstance(self.features, KeyedJaggedTensor) and self.features._contents_version() != self.versions


class _Step:
    """What the hooks saw of the current step (one pipeline loop's state)."""

    def __init__(self) -> None:
        self.ahead = _Ahead(_END, None)  # the step's batch, exchanged ahead
        self.next: Optional[_Ahead] = None  # the next batch, once its exchange has started
        self.loading: Optional[concurrent.futures.Future[Any]] = None
        self.error: Optional[Exception] = None  # the next exchange's failure, raised when the step ends
        self.called = False  # the collection was called with the step's features
        self.others = False  # ... or with something else

    def advance(self) -> None:
        assert self.next is not None
        self.ahead, self.next = self.next, None
        self.called = self.others = False

    def check_skipped(self) -> None:
        """The step's agreement when it did not pool its batch: fine, unless it passed only other objects."""
        if self.others and not self.called:
            raise ValueError(
                "SparseDistPipeline: the step called the collection, but never with its batch's features (the "
                "object `features(batch)` returned): pass the model that very object. A `features` that builds a "
                "new KeyedJaggedTensor on each call, or a model that selects keys or copies it before calling "
                "the collection, defeats the exchange ahead"
            )
