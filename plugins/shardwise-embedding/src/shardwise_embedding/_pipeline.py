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
from shardwise_embedding._jagged import KeyedJaggedTensor

__all__ = ["SparseDistPipeline"]

B = TypeVar("B")

_END = object()  # what the loader returns when the batches run out


class SparseDistPipeline(Generic[B]):
    """Iterate over batches with the next batch's input exchange running during this one's step.

    Iterating yields the batches in order, as iterating ``batches`` would;
    the loop body trains on each as usual and must call the collection (in
    the model's forward) exactly once per batch, with ``features(batch)``
    (the same object). Behind it: before yielding batch i the pipeline has
    started batch i's exchange (at the end of batch i-1's collection
    forward, through a forward hook), and with ``load_ahead`` a background
    thread is loading batch i+1 (the thread only ever runs ``next()`` on
    ``batches``, one call at a time; collectives stay on the caller's
    thread). Memory: one batch beyond the current one is loaded and in
    flight at any time.

    Every rank must iterate together, over as many batches (the exchange
    is collective). Ranks that run out of batches at different steps raise
    ``ValueError`` on every rank instead of waiting for each other: a rank
    that has no next batch says so in the exchange the others start for
    theirs, and raises at the end of its loop; the others raise in that
    batch's forward. Reaching the end costs every rank one small exchange.
    A bad batch raises when its exchange starts, on every rank (the real
    error on the rank at fault, :class:`~shardwise.PeerError` on the
    others), which is inside the previous step's forward.

    Args:
        collection: The sharded collection whose input exchange to run ahead.
        batches: The batches, each a whole training step's input on this rank.
        features: Picks the collection's input out of a batch (the
            :class:`KeyedJaggedTensor` the model will pass to ``collection``).
        load_ahead: Load the next batch on a background thread while this
            one computes (for batches that are made or read, not just
            looked up). Leave it off when ``batches`` must be iterated on
            the calling thread.

    Raises:
        TypeError: ``collection`` is not a sharded collection.
        RuntimeError: (while iterating) a step did not call the collection
            with its batch's features exactly once.
        ValueError: (while iterating) the ranks ran out of batches at
            different steps: at the end of the loop on the ranks that ran
            out, in the next batch's forward on the others.

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

    def _prefetch(self, upcoming: Any) -> None:
        """Start the exchange of the batch after this one, or say every rank's part that this rank has none."""
        if upcoming is _END:
            self.collection._prefetch_no_batch()
        else:
            self.collection.prefetch(self._features(upcoming))

    def __iter__(self) -> Iterator[B]:
        source = iter(self._batches)
        loader = concurrent.futures.ThreadPoolExecutor(1, "shardwise-batch-loader") if self._load_ahead else None
        coming: Optional[concurrent.futures.Future[Any]] = None

        def load_next() -> Any:
            return next(source, _END)

        def start_loading() -> None:
            nonlocal coming
            coming = loader.submit(load_next) if loader is not None else None

        def take_next() -> Any:
            return coming.result() if coming is not None else load_next()

        state: dict[str, Any] = {"next": _END, "calls": 0}

        def after_forward(module: nn.Module, args: Any, output: Any) -> None:
            # Batch i is pooled: start batch i+1's exchange now, so that it travels during the rest of step i.
            state["calls"] += 1
            if state["calls"] > 1:
                return  # reported after the step, where the caller's loop can see which batch it was
            upcoming = take_next()
            state["next"] = upcoming
            self._prefetch(upcoming)

        current = load_next()
        self._prefetch(current)
        hook = self.collection.register_forward_hook(after_forward)
        try:
            while current is not _END:
                state["calls"] = 0
                start_loading()
                yield current
                if state["calls"] != 1:
                    raise RuntimeError(
                        f"SparseDistPipeline: the step called the collection {state['calls']} times; each step must "
                        "call it exactly once, with its batch's features (the object `features(batch)` returns)"
                    )
                current = state["next"]
            # This rank has no next batch: unless every rank ran out with it, raise (as the peers that had
            # one do in its forward).
            self.collection._end_of_batches()
        finally:
            hook.remove()
            # Stopped early (a break, an error): the next batch's exchange ran on every rank; let it finish.
            self.collection._discard_prefetched()
            if loader is not None:
                loader.shutdown(wait=True, cancel_futures=True)
