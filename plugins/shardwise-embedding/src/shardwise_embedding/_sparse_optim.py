"""Row-sparse optimizers for embedding blocks: each step costs O(touched rows), never O(table).

A sharded collection's block is a plain parameter whose gradient is a sparse
COO tensor over its rows (``F.embedding_bag(..., sparse=True)``). These
optimizers coalesce it (duplicate rows summed) and read, update and write back
only the touched rows with ``index_select`` / ``index_copy_``: no dense
gradient, no table-sized temporary. Optimizer state (Adagrad's sum, Adam's
moments, row-wise Adagrad's per-row accumulator) is allocated once, at the
first step or the first :meth:`~_RowSparseOptimizer.sharded_state_dict`.

Dense gradients (``data_parallel`` tables, already all-reduced) are accepted
too: the rows whose gradient is not all zeros count as touched. For SGD (no
weight decay) and both Adagrads that is exactly the dense update, since a
zero row changes nothing; for SGD's weight decay and Adam it is the lazy
(SparseAdam-style) update, not torch's dense one: untouched rows keep their
weights and moments.

:class:`RowWiseAdagrad` is collective when a table is cut into column blocks:
a row's accumulator needs the mean of g² over the whole row, so each step()
exchanges per-row partial sums with the ranks holding the row's other columns
(one ``all_to_all`` for all such parameters). Every rank of the group must
then call step() and load_sharded_state_dict() together.

Checkpoints: :meth:`~_RowSparseOptimizer.sharded_state_dict` shows each
table's state laid out as the whole table (ShardedTensors sharing storage with
the state), so ``shardwise.checkpoint.save`` / ``load`` reshard it between
plans; :meth:`~_RowSparseOptimizer.load_sharded_state_dict` finishes a load.
"""

from __future__ import annotations

import math
import zlib
from typing import Any, Callable, Iterable, Optional

import torch
from torch.optim import Optimizer

from shardwise import Group, ShardedTensor
from shardwise_embedding._blocks import LocalBlock, block_of

__all__ = ["RowSparseAdagrad", "RowSparseAdam", "RowSparseSGD", "RowWiseAdagrad", "touched_rows"]

Params = Iterable[Any]

#: Dtype of the row-wise exchange's messages: holds row numbers exactly (below 2**53) and float32/64
#: partial sums without rounding, so every column peer adds the very same numbers.
_WIRE = torch.float64


def touched_rows(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows a gradient touches, and their summed gradient.

    Args:
        grad: A sparse COO gradient (any number of sparse dims, possibly
            uncoalesced) or a dense one.

    Returns:
        ``(rows, values)``: sorted unique row numbers (int64) and
        ``values[i]`` = the gradient of row ``rows[i]``. For a dense gradient,
        the rows that are not all zeros.
    """
    if grad.is_sparse:
        g = grad.coalesce()
        indices, values = g.indices(), g.values()
        if g.sparse_dim() == 1:
            return indices[0], values
        # Several sparse dims: sum the entries into their rows; still O(nnz).
        rows, inverse = torch.unique(indices[0], sorted=True, return_inverse=True)
        out = values.new_zeros((rows.numel(), *g.shape[1:]))
        out.index_put_((inverse, *indices[1:]), values, accumulate=True)
        return rows, out
    if grad.layout != torch.strided:
        raise TypeError(f"row-sparse optimizers take sparse COO or dense gradients, not {grad.layout}")
    nonzero = grad.flatten(1).ne(0).any(dim=1) if grad.dim() > 1 else grad.ne(0)
    rows = nonzero.nonzero().squeeze(1)
    return rows, grad.index_select(0, rows)


class _Work:
    """One parameter's share of a step: its touched rows and their gradient."""

    def __init__(self, param: torch.Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        self.param = param
        self.group = group
        self.state = state
        self.block = block_of(param)
        if param.grad is None:
            self.rows = torch.empty(0, dtype=torch.long, device=param.device)
            self.values = param.new_zeros((0, *param.shape[1:]))
        else:
            self.rows, self.values = touched_rows(param.grad)


class _RowSparseOptimizer(Optimizer):
    """What the row-sparse optimizers share: the step loop and the sharded state dict."""

    #: State shaped like the parameter (shown like the table in sharded_state_dict).
    _ELEMENT_STATE: tuple[str, ...] = ()
    #: State with one value per row (shown like the table's rows).
    _ROW_STATE: tuple[str, ...] = ()
    #: Whether the state holds a per-parameter "step" counter.
    _COUNTS_STEPS = True

    def _new_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def _update(self, work: _Work) -> None:
        raise NotImplementedError

    def _joins_without_grad(self, param: torch.Tensor) -> bool:
        """Whether ``param`` takes part in a step even without a gradient (a collective needs it)."""
        return False

    def _state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        state: dict[str, Any] = self.state[param]
        if not state:
            state.update(self._new_state(param, group))
            if self._COUNTS_STEPS:
                # float64: exact far beyond torch's float32 counter (2**24 steps).
                state["step"] = torch.tensor(0.0, dtype=torch.float64)
        return state

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Update the touched rows of every parameter with a gradient.

        Args:
            closure: Re-evaluates the model and returns the loss (optional).

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None and not self._joins_without_grad(p):
                    continue
                state = self._state(p, group)
                if self._COUNTS_STEPS and p.grad is not None:
                    # As torch: a parameter's step counts the steps it had a gradient in.
                    state["step"] += 1
                work.append(_Work(p, group, state))
        self._apply(work)
        return loss

    def _apply(self, work: list[_Work]) -> None:
        for item in work:
            if item.rows.numel():
                self._update(item)

    # -- checkpoints ------------------------------------------------------------------------------------

    def _entries(self) -> list[tuple[str, torch.Tensor, dict[str, Any], Optional[LocalBlock]]]:
        """``(key, param, param group, block)``: the key is the table's name, or ``param<i>`` without a block."""
        out = []
        seen: set[str] = set()
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                block = block_of(p)
                key = block.table.name if block is not None else f"param{index}"
                if key in seen:
                    raise ValueError(f"two parameters of this optimizer are blocks of table {key!r}")
                seen.add(key)
                out.append((key, p, group, block))
                index += 1
        return out

    def sharded_state_dict(self) -> dict[str, dict[str, Any]]:
        """The state keyed by table, laid out like the tables, for ``shardwise.checkpoint.save`` / ``load``.

        State not yet created is created now (at its initial values), so the
        result can be the target of a load before any step.

        Returns:
            ``{table name (or "param<i>" for a parameter of no collection):
            {state name: value}}``: per-element state as the table's
            ShardedTensor (``LocalBlock.present``; the tensor itself for a
            ``data_parallel`` table), per-row state as ``LocalBlock.present_rows``,
            ``"step"`` as a 0-d float64 tensor. The tensors share storage with
            the optimizer's state: loading into them loads the optimizer.
            Parameters without state (SGD) are left out.
        """
        result: dict[str, dict[str, Any]] = {}
        for key, p, group, block in self._entries():
            state = self._state(p, group)
            entry: dict[str, Any] = {}
            for name in self._ELEMENT_STATE:
                entry[name] = block.present(state[name]) if block is not None else state[name]
            for name in self._ROW_STATE:
                t = state[name]
                entry[name] = block.present_rows(t, t.dtype) if block is not None else t
            if "step" in state:
                entry["step"] = state["step"]
            if entry:
                result[key] = entry
        return result

    def load_sharded_state_dict(self, state_dict: dict[str, dict[str, Any]]) -> None:
        """Finish loading a :meth:`sharded_state_dict` that ``shardwise.checkpoint.load`` filled.

        Copies whatever does not already share storage with the state (the
        steps; tensors of a state dict built elsewhere). Collective for
        :class:`RowWiseAdagrad` with column-split tables: call on every rank.

        Raises:
            KeyError: a table's (or parameter's) state is missing.
            ValueError: a local shard of another shape than the state.
        """
        for key, p, group, _ in self._entries():
            state = self._state(p, group)
            names = self._ELEMENT_STATE + self._ROW_STATE + (("step",) if "step" in state else ())
            if not names:
                continue
            if key not in state_dict:
                raise KeyError(f"the optimizer state to load has no entry {key!r} (it has {sorted(state_dict)})")
            entry = state_dict[key]
            for name in names:
                if name not in entry:
                    raise KeyError(f"the optimizer state of {key!r} has no {name!r} (it has {sorted(entry)})")
                if name == "step":
                    if entry[name] is not state[name]:
                        state[name].fill_(float(entry[name]))
                else:
                    _copy_into(state[name], entry[name], f"{key}.{name}")
        self._after_load()

    def _after_load(self) -> None:
        """Hook run on every rank at the end of a load."""


def _copy_into(dst: torch.Tensor, src: Any, what: str) -> None:
    """Copy ``src`` (a tensor, or a ShardedTensor's local shard) into ``dst`` unless they share storage."""
    if isinstance(src, ShardedTensor):
        tensors = [shard.tensor for shard in src.local_shards()]
    elif isinstance(src, torch.Tensor):
        tensors = [src]
    else:
        raise TypeError(f"{what}: expected a tensor or ShardedTensor, got {type(src).__name__}")
    for t in tensors:
        if t.shape != dst.shape:
            raise ValueError(f"{what}: local state of shape {tuple(t.shape)} does not fit {tuple(dst.shape)}")
        if t.data_ptr() != dst.data_ptr() or t.stride() != dst.stride():
            dst.copy_(t)


def _check(**values: float) -> None:
    for what, value in values.items():
        if not value >= 0.0:  # also catches NaN
            raise ValueError(f"invalid {what}: {value} (must be at least 0)")


class RowSparseSGD(_RowSparseOptimizer):
    """SGD on the touched rows: ``w[rows] -= lr * (g + weight_decay * w[rows])``.

    Untouched rows are not decayed (unlike ``torch.optim.SGD`` with a dense
    gradient). Keeps no state.

    Args:
        params: Parameters or param groups.
        lr: Learning rate.
        weight_decay: L2 penalty, on the touched rows only.
    """

    _COUNTS_STEPS = False

    def __init__(self, params: Params, lr: float, weight_decay: float = 0.0) -> None:
        _check(lr=lr, weight_decay=weight_decay)
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})

    def _new_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        return {}

    def _update(self, work: _Work) -> None:
        p, rows, g = work.param, work.rows, work.values
        w = p.index_select(0, rows)
        d = g.add(w, alpha=work.group["weight_decay"]) if work.group["weight_decay"] else g
        w.add_(d, alpha=-work.group["lr"])
        p.index_copy_(0, rows, w)


class RowSparseAdagrad(_RowSparseOptimizer):
    """``torch.optim.Adagrad``'s maths on the touched rows (state ``"sum"`` per element, ``"step"``).

    Equal to torch's Adagrad on the dense model: there an untouched row has a
    zero gradient, which changes neither its sum nor its weights.

    Args:
        params: Parameters or param groups.
        lr: Learning rate.
        lr_decay: The learning rate at step t is ``lr / (1 + (t - 1) * lr_decay)``.
        eps: Added to the denominator.
        initial_accumulator_value: Initial value of every sum.
    """

    _ELEMENT_STATE = ("sum",)

    def __init__(
        self,
        params: Params,
        lr: float = 1e-2,
        lr_decay: float = 0.0,
        eps: float = 1e-10,
        initial_accumulator_value: float = 0.0,
    ) -> None:
        _check(lr=lr, lr_decay=lr_decay, eps=eps, initial_accumulator_value=initial_accumulator_value)
        defaults = {"lr": lr, "lr_decay": lr_decay, "eps": eps, "initial_accumulator_value": initial_accumulator_value}
        super().__init__(params, defaults)

    def _new_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        return {"sum": torch.full_like(param, group["initial_accumulator_value"])}

    def _update(self, work: _Work) -> None:
        p, rows, g, state, group = work.param, work.rows, work.values, work.state, work.group
        step = float(state["step"])
        clr = group["lr"] / (1 + (step - 1) * group["lr_decay"])
        s = state["sum"].index_select(0, rows)
        s.addcmul_(g, g, value=1)
        state["sum"].index_copy_(0, rows, s)
        std = s.sqrt_().add_(group["eps"])
        w = p.index_select(0, rows)
        w.addcdiv_(g, std, value=-clr)
        p.index_copy_(0, rows, w)


class RowSparseAdam(_RowSparseOptimizer):
    """Lazy Adam, as ``torch.optim.SparseAdam``: only the touched rows' moments and weights change.

    State: ``"exp_avg"`` and ``"exp_avg_sq"`` per element, ``"step"`` per
    parameter (counting the steps it had a gradient in, touched rows or not,
    as SparseAdam). With a dense gradient the rows that are not all zeros are
    the touched ones (torch's Adam would decay every row's moments instead).

    Args:
        params: Parameters or param groups.
        lr: Learning rate.
        betas: Decay rates of the first and second moments.
        eps: Added to the denominator.
    """

    _ELEMENT_STATE = ("exp_avg", "exp_avg_sq")

    def __init__(
        self, params: Params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8
    ) -> None:
        _check(lr=lr, eps=eps)
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas {betas}: each must be in [0, 1)")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps})

    def _new_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        return {"exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)}

    def _update(self, work: _Work) -> None:
        # The same operations, in the same order, as torch's sparse_adam, on gathered rows.
        p, rows, g, state, group = work.param, work.rows, work.values, work.state, work.group
        beta1, beta2 = group["betas"]
        step = float(state["step"])
        old_avg = state["exp_avg"].index_select(0, rows)
        old_sq = state["exp_avg_sq"].index_select(0, rows)
        avg = g.sub(old_avg).mul_(1 - beta1).add_(old_avg)
        sq = g.pow(2).sub_(old_sq).mul_(1 - beta2).add_(old_sq)
        state["exp_avg"].index_copy_(0, rows, avg)
        state["exp_avg_sq"].index_copy_(0, rows, sq)
        denom = sq.sqrt_().add_(group["eps"])
        step_size = group["lr"] * math.sqrt(1 - beta2**step) / (1 - beta1**step)
        w = p.index_select(0, rows)
        w.add_(avg.div_(denom).mul_(-step_size))
        p.index_copy_(0, rows, w)


class RowWiseAdagrad(_RowSparseOptimizer):
    """Row-wise Adagrad (FBGEMM / TorchRec): one accumulator per row.

    ``acc[row] += mean(g[row] ** 2)`` over the row's whole embedding_dim, then
    ``w[row] -= lr * g[row] / (sqrt(acc[row]) + eps)``. State ``"sum"``
    (``[rows]``, float32 for half-precision weights) and ``"step"``.

    When a table is cut into column blocks, the ranks holding a row's blocks
    exchange their partial sums of g² (one ``all_to_all`` over the group per
    step for all such parameters) and add them in column order, so they keep
    bit-identical accumulators even when they touched different rows. Every
    rank of the group must call step() (and load_sharded_state_dict()): the
    decision to exchange is taken from the tables' plans, which every rank's
    optimizer must see (a registered parameter of each column-split table on
    every rank, as the sharded collection gives; ``block_of``).

    Args:
        params: Parameters or param groups.
        lr: Learning rate.
        eps: Added to the denominator.
        initial_accumulator_value: Initial value of every row's accumulator.
    """

    _ROW_STATE = ("sum",)

    def __init__(
        self, params: Params, lr: float = 1e-2, eps: float = 1e-10, initial_accumulator_value: float = 0.0
    ) -> None:
        _check(lr=lr, eps=eps, initial_accumulator_value=initial_accumulator_value)
        super().__init__(params, {"lr": lr, "eps": eps, "initial_accumulator_value": initial_accumulator_value})

    def _new_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        if param.dim() < 1:
            raise ValueError("row-wise Adagrad needs parameters with rows (at least one dimension)")
        dtype = torch.promote_types(param.dtype, torch.float32)
        return {
            "sum": torch.full(
                (param.shape[0],), float(group["initial_accumulator_value"]), dtype=dtype, device=param.device
            )
        }

    def _joins_without_grad(self, param: torch.Tensor) -> bool:
        # Peers may have touched rows this rank did not: its accumulator must still take their sums.
        block = block_of(param)
        return block is not None and bool(block.column_peers())

    def _exchanging_groups(self) -> list[tuple[Group, torch.device]]:
        """Groups with a column-split table, in the order of the parameters (the same on every rank).

        With each, the device its messages go from: its first such parameter's.
        """
        groups: list[tuple[Group, torch.device]] = []
        for group in self.param_groups:
            for p in group["params"]:
                block = block_of(p)
                if block is not None and len(block.table.column_cuts) > 1:
                    if not any(g is block.group for g, _ in groups):
                        groups.append((block.group, p.device))
        return groups

    def _apply(self, work: list[_Work]) -> None:
        partials = {id(item): self._row_sums(item) for item in work}
        received: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for group, device in self._exchanging_groups():
            peered = [
                item
                for item in work
                if item.block is not None and item.block.group is group and item.block.column_peers()
            ]
            blocks = [(item.block, item.param.shape[0]) for item in peered if item.block is not None]
            outgoing = [(b, item.rows, partials[id(item)]) for (b, _), item in zip(blocks, peered, strict=True)]
            received.update(_exchange(group, device, blocks, outgoing))
        for item in work:
            acc = item.state["sum"]
            parts = [(item.rows, partials[id(item)])]
            block = item.block
            if block is not None and block.block is not None and block.column_peers():
                # Every holder of these rows adds the same partials in column order: equal accumulators.
                got = received.get(block.table.name, {})
                empty = (item.rows[:0], acc[:0])
                parts = [parts[0] if rank == block.block.rank else got.get(rank, empty) for rank in _holders(block)]
            rows = torch.cat([r for r, _ in parts])
            if not rows.numel():
                continue
            union, inverse = torch.unique(rows, sorted=True, return_inverse=True)
            total = acc.new_zeros(union.shape)
            start = 0
            for r, v in parts:
                total.index_add_(0, inverse[start : start + r.numel()], v.to(acc.dtype))
                start += r.numel()
            new_acc = acc.index_select(0, union).add_(total.div_(self._full_dim(item)))
            acc.index_copy_(0, union, new_acc)
            if item.rows.numel():
                self._update_weights(item)

    def _row_sums(self, item: _Work) -> torch.Tensor:
        """Sum of g² over this rank's columns of each touched row, in the accumulator's dtype."""
        squares = item.values.to(item.state["sum"].dtype).pow(2)
        return squares.flatten(1).sum(dim=1) if squares.dim() > 1 else squares

    @staticmethod
    def _full_dim(item: _Work) -> int:
        block = item.block
        if block is not None and not block.replicated:
            return block.table.embedding_dim
        return math.prod(item.param.shape[1:])

    def _update_weights(self, item: _Work) -> None:
        p, rows, acc, group = item.param, item.rows, item.state["sum"], item.group
        std = acc.index_select(0, rows).sqrt_().add_(group["eps"])
        std = std.reshape(-1, *([1] * (p.dim() - 1)))
        w = p.index_select(0, rows).to(acc.dtype)
        w.addcdiv_(item.values.to(acc.dtype), std, value=-group["lr"])
        p.index_copy_(0, rows, w.to(p.dtype))

    def _after_load(self) -> None:
        # The checkpoint holds one accumulator per row, loaded by the first column block's ranks:
        # hand it to the ranks holding the same rows' other columns.
        for group, device in self._exchanging_groups():
            accs: dict[str, torch.Tensor] = {}
            blocks: list[tuple[LocalBlock, int]] = []
            outgoing = []
            for pg in self.param_groups:
                for p in pg["params"]:
                    block = block_of(p)
                    if block is None or block.group is not group or not block.column_peers():
                        continue
                    acc = accs[block.table.name] = self._state(p, pg)["sum"]
                    blocks.append((block, p.shape[0]))
                    if block.holds_first_columns():
                        outgoing.append((block, torch.arange(acc.shape[0], device=acc.device), acc))
            for name, by_rank in _exchange(group, device, blocks, outgoing).items():
                for rows, values in by_rank.values():
                    accs[name].index_copy_(0, rows, values.to(accs[name].dtype))


def _holders(block: LocalBlock) -> list[int]:
    """Group ranks holding ``block``'s rows, one per column block, in column order (this rank included)."""
    assert block.block is not None
    rows = block.block.rows
    return [b.rank for b in sorted(block.table.blocks, key=lambda b: b.cols) if b.rows == rows]


def _table_key(name: str) -> float:
    return float(zlib.crc32(name.encode()))


def _exchange(
    group: Group,
    device: torch.device,
    blocks: list[tuple[LocalBlock, int]],
    outgoing: list[tuple[LocalBlock, torch.Tensor, torch.Tensor]],
) -> dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """Send each ``(block, rows, values)`` to the block's column peers; one ``all_to_all`` over ``group``.

    Each message is a ``[n, 2]`` float64 tensor of segments: a header row
    ``(table key, count)`` then ``count`` rows of ``(row, value)``.

    Args:
        group: The group every rank of which calls this together.
        device: Where the messages are built (the group's device for parameters).
        blocks: This rank's blocks with column peers in ``group`` and their
            row counts (what it may receive for).
        outgoing: What to send, per block.

    Returns:
        ``{table name: {sender group rank: (rows, values)}}``.

    Raises:
        RuntimeError: a peer sent rows for a table this rank holds no block of
            beside it, or rows outside the block.
    """
    by_key: dict[float, tuple[LocalBlock, int]] = {}
    for block, num_rows in blocks:
        key = _table_key(block.table.name)
        if key in by_key:
            raise RuntimeError(
                f"tables {block.table.name!r} and {by_key[key][0].table.name!r} have the same exchange key; rename one"
            )
        by_key[key] = (block, num_rows)
    messages: list[list[torch.Tensor]] = [[] for _ in range(group.size)]
    for block, rows, values in outgoing:
        header = torch.tensor([[_table_key(block.table.name), float(rows.numel())]], dtype=_WIRE, device=device)
        body = torch.stack([rows.to(device, _WIRE), values.to(device, _WIRE)], dim=1)
        for peer in block.column_peers():
            messages[peer] += [header, body]
    inputs = [torch.cat(m) if m else torch.empty((0, 2), dtype=_WIRE, device=device) for m in messages]
    out: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for sender, message in enumerate(group.all_to_all(inputs)):
        # Headers are read on the host; the message is small (touched rows only).
        host = message.cpu()
        at = 0
        while at < host.shape[0]:
            key, count = float(host[at, 0]), int(host[at, 1])
            found = by_key.get(key)
            if found is None or sender not in found[0].column_peers():
                raise RuntimeError(
                    f"rank {sender} of the group sent row-wise optimizer state for a table this "
                    "rank holds no column block of beside it: the ranks' plans or optimizers differ"
                )
            block, num_rows = found
            rows = host[at + 1 : at + 1 + count, 0].long()
            if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= num_rows):
                raise RuntimeError(f"rank {sender} sent rows outside this rank's block of table {block.table.name!r}")
            out.setdefault(block.table.name, {})[sender] = (
                rows.to(message.device),
                message[at + 1 : at + 1 + count, 1],
            )
            at += 1 + count
    return out
