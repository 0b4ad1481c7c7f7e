"""Row-sparse optimizers for embedding blocks: a step costs O(touched rows), never O(table).

A collection's block is a plain parameter with a sparse COO gradient over its
rows (``F.embedding_bag(..., sparse=True)``). These optimizers coalesce it and
update only the touched rows (``index_select`` / ``index_copy_``): no dense
gradient, no table-sized temporary. State is allocated once, at the first step
or :meth:`~_RowSparseOptimizer.sharded_state_dict`. With a dense gradient
(``data_parallel`` tables) the rows not all zeros count as touched: the exact
dense update for both Adagrads and SGD without weight decay, the lazy one
(untouched rows keep weights and moments) for weight decay and Adam.

:meth:`~_RowSparseOptimizer.sharded_state_dict` lays each table's state out
like the table (ShardedTensors sharing storage with the state), so
``shardwise.checkpoint.save`` / ``load`` reshard it between plans.
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

#: Dtype of row-wise Adagrad's messages: row numbers exact (below 2**53), float32/64 sums unrounded,
#: so every column peer adds the very same numbers.
_WIRE = torch.float64

Received = dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]]
#: ``(param, param group, block)`` of the parameters with column peers.
Peered = list[tuple[torch.Tensor, dict[str, Any], LocalBlock]]
Entry = tuple[str, torch.Tensor, dict[str, Any], Optional[LocalBlock]]


def touched_rows(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows a gradient touches, and their summed gradient.

    Args:
        grad: A sparse COO gradient (any number of sparse dims, possibly
            uncoalesced) or a dense one.

    Returns:
        ``(rows, values)``: sorted unique row numbers and ``values[i]``, the
        gradient of row ``rows[i]``. For a dense gradient, the rows not all zeros.
    """
    if grad.is_sparse:
        g = grad.coalesce()
        indices, values = g.indices(), g.values()
        if g.sparse_dim() == 1:
            return indices[0], values
        # Several sparse dims: sum the entries into their rows; still O(nnz).
        rows, inverse = torch.unique(indices[0], sorted=True, return_inverse=True)
        out = values.new_zeros((rows.numel(), *g.shape[1:]))
        return rows, out.index_put_((inverse, *indices[1:]), values, accumulate=True)
    if grad.layout != torch.strided:
        raise TypeError(f"row-sparse optimizers take sparse COO or dense gradients, not {grad.layout}")
    rows = (grad.flatten(1).ne(0).any(dim=1) if grad.dim() > 1 else grad.ne(0)).nonzero().squeeze(1)
    return rows, grad.index_select(0, rows)


class _Work:
    """One parameter's share of a step: its touched rows and their gradient (none without a gradient)."""

    def __init__(self, param: torch.Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        self.param, self.group, self.state, self.block = param, group, state, block_of(param)
        empty = (torch.empty(0, dtype=torch.long, device=param.device), param.new_zeros((0, *param.shape[1:])))
        self.rows, self.values = touched_rows(param.grad) if param.grad is not None else empty


class _RowSparseOptimizer(Optimizer):
    """The step loop and the sharded state dict the row-sparse optimizers share."""

    #: State shaped like the parameter, and state with one value per row.
    _ELEMENT_STATE: tuple[str, ...] = ()
    _ROW_STATE: tuple[str, ...] = ()
    #: Whether the state counts steps ("step", per parameter).
    _COUNTS_STEPS = True

    def _new_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        return {}

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
                    state["step"] += 1  # as torch: the steps the parameter had a gradient in
                work.append(_Work(p, group, state))
        self._apply(work)
        return loss

    def _apply(self, work: list[_Work]) -> None:
        for item in work:
            if item.rows.numel():
                self._update(item)

    def _entries(self) -> list[Entry]:
        """``(key, param, param group, block)``; the key is the table's name, or ``param<i>`` without a block."""
        out: list[Entry] = []
        for group in self.param_groups:
            for p in group["params"]:
                block = block_of(p)
                key = block.table.name if block is not None else f"param{len(out)}"
                if any(key == seen for seen, *_ in out):
                    raise ValueError(f"two parameters of this optimizer are blocks of table {key!r}")
                out.append((key, p, group, block))
        return out

    def _names(self, state: dict[str, Any], block: Optional[LocalBlock]) -> tuple[str, ...]:
        # A rank without a block of the table leaves its (meaningless) step out: the checkpoint keeps
        # one step per table, which must come from a rank that stepped the table.
        holds_nothing = block is not None and block.block is None and not block.replicated
        step = ("step",) if "step" in state and not holds_nothing else ()
        return self._ELEMENT_STATE + self._ROW_STATE + step

    def sharded_state_dict(self) -> dict[str, dict[str, Any]]:
        """The state keyed by table and laid out like the tables, for ``shardwise.checkpoint.save`` / ``load``.

        Creates state not created yet (at its initial values), so the result
        can be a load's target before any step. Every rank calls it.

        Returns:
            ``{table name (or "param<i>" for a parameter of no collection):
            {state name: value}}``: per-element state as the table's
            ShardedTensor (``LocalBlock.present``; the tensor itself for a
            ``data_parallel`` table), per-row state as ``LocalBlock.present_rows``,
            ``"step"`` as a 0-d float64 tensor (left out on ranks without a
            block of the table). The tensors share storage with the state:
            loading into them loads the optimizer. SGD has no state: ``{}``.
        """
        result: dict[str, dict[str, Any]] = {}
        for key, p, group, block in self._entries():
            state = self._state(p, group)
            entry: dict[str, Any] = {}
            for name in self._names(state, block):
                v = state[name]
                if block is not None and name != "step":
                    v = block.present(v) if name in self._ELEMENT_STATE else block.present_rows(v, v.dtype)
                entry[name] = v
            if entry:
                result[key] = entry
        return result

    def load_sharded_state_dict(self, state_dict: dict[str, dict[str, Any]]) -> None:
        """Finish loading a :meth:`sharded_state_dict` that ``shardwise.checkpoint.load`` filled.

        Copies what does not share storage with the state already (tensors of
        a state dict built otherwise; the steps). Collective for
        :class:`RowWiseAdagrad` (every rank of the group calls it).

        Raises:
            KeyError: a table's (or parameter's) state is missing.
            ValueError: a local shard of another shape than the state.
        """
        for key, p, group, block in self._entries():
            state = self._state(p, group)
            for name in self._names(state, block):
                entry = state_dict.get(key, {})
                if name not in entry:
                    raise KeyError(f"the optimizer state to load has no {name!r} for {key!r}")
                if name == "step":
                    if entry[name] is not state[name]:
                        state[name].fill_(float(entry[name]))
                else:
                    _copy_into(state[name], entry[name], f"{key}.{name}")


def _copy_into(dst: torch.Tensor, src: Any, what: str) -> None:
    """Copy ``src`` (a tensor, or a ShardedTensor's local shard) into ``dst`` unless they share storage."""
    tensors = [s.tensor for s in src.local_shards()] if isinstance(src, ShardedTensor) else [src]
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.shape != dst.shape:
            raise ValueError(f"{what}: {getattr(t, 'shape', t)!r} does not fit the state's {tuple(dst.shape)}")
        if t.data_ptr() != dst.data_ptr() or t.stride() != dst.stride():
            dst.copy_(t)


def _check(**values: float) -> None:
    for what, value in values.items():
        if not value >= 0.0:  # NaN too
            raise ValueError(f"invalid {what}: {value} (must be at least 0)")


class RowSparseSGD(_RowSparseOptimizer):
    """SGD on the touched rows: ``w[rows] -= lr * (g + weight_decay * w[rows])``; no state.

    Args:
        params: Parameters or param groups.
        lr: Learning rate.
        weight_decay: L2 penalty, on the touched rows only (torch's SGD with a
            dense gradient decays every row).
    """

    _COUNTS_STEPS = False

    def __init__(self, params: Iterable[Any], lr: float, weight_decay: float = 0.0) -> None:
        _check(lr=lr, weight_decay=weight_decay)
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})

    def _update(self, work: _Work) -> None:
        p, rows, g, group = work.param, work.rows, work.values, work.group
        w = p.index_select(0, rows)
        # The same operations as torch's SGD, on the gathered rows.
        d = g.add(w, alpha=group["weight_decay"]) if group["weight_decay"] else g
        p.index_copy_(0, rows, w.add_(d, alpha=-group["lr"]))


class RowSparseAdagrad(_RowSparseOptimizer):
    """``torch.optim.Adagrad``'s maths on the touched rows; state ``"sum"`` (per element) and ``"step"``.

    Equal to torch's Adagrad on the dense model, where an untouched row's zero
    gradient changes neither its sum nor its weights.

    Args:
        params: Parameters or param groups.
        lr: Learning rate.
        lr_decay: The learning rate at step t is ``lr / (1 + (t - 1) * lr_decay)``.
        eps: Added to the denominator.
        initial_accumulator_value: Every sum's initial value.
    """

    _ELEMENT_STATE = ("sum",)

    def __init__(
        self,
        params: Iterable[Any],
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
        clr = group["lr"] / (1 + (float(state["step"]) - 1) * group["lr_decay"])
        s = state["sum"].index_select(0, rows).addcmul_(g, g, value=1)
        state["sum"].index_copy_(0, rows, s)
        p.index_copy_(0, rows, p.index_select(0, rows).addcdiv_(g, s.sqrt_().add_(group["eps"]), value=-clr))


class RowSparseAdam(_RowSparseOptimizer):
    """Lazy Adam, as ``torch.optim.SparseAdam``: only the touched rows' moments and weights change.

    State ``"exp_avg"``, ``"exp_avg_sq"`` (per element) and ``"step"`` (the
    steps the parameter had a gradient in, touched rows or not, as SparseAdam).
    A dense gradient's touched rows are those not all zeros (torch's Adam would
    decay every row's moments).

    Args:
        params: Parameters or param groups.
        lr: Learning rate.
        betas: Decay rates of the first and second moments.
        eps: Added to the denominator.
    """

    _ELEMENT_STATE = ("exp_avg", "exp_avg_sq")

    def __init__(
        self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8
    ) -> None:
        _check(lr=lr, eps=eps)
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas {betas}: each must be in [0, 1)")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps})

    def _new_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        return {"exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)}

    def _update(self, work: _Work) -> None:
        # torch's sparse_adam, operation for operation, on the gathered rows: the same numbers.
        p, rows, g, state, group = work.param, work.rows, work.values, work.state, work.group
        beta1, beta2 = group["betas"]
        step = float(state["step"])
        old_avg = state["exp_avg"].index_select(0, rows)
        old_sq = state["exp_avg_sq"].index_select(0, rows)
        avg = g.sub(old_avg).mul_(1 - beta1).add_(old_avg)
        sq = g.pow(2).sub_(old_sq).mul_(1 - beta2).add_(old_sq)
        state["exp_avg"].index_copy_(0, rows, avg)
        state["exp_avg_sq"].index_copy_(0, rows, sq)
        step_size = group["lr"] * math.sqrt(1 - beta2**step) / (1 - beta1**step)
        update = avg.div_(sq.sqrt_().add_(group["eps"])).mul_(-step_size)
        p.index_copy_(0, rows, p.index_select(0, rows).add_(update))


class RowWiseAdagrad(_RowSparseOptimizer):
    """Row-wise Adagrad (FBGEMM / TorchRec): one accumulator per row.

    ``acc[row] += mean(g[row] ** 2)`` over the row's whole embedding_dim, then
    ``w[row] -= lr * g[row] / (sqrt(acc[row]) + eps)``. State ``"sum"``
    (``[rows]``; float32 for half-precision weights) and ``"step"``.

    When a table is cut into column blocks, the ranks holding a row's blocks
    swap partial sums of g² (one ``all_to_all`` over the group per step for all
    such parameters) and add them in column order: their accumulators stay
    bit-identical, even when they touched different rows. Every rank of the
    group then calls step() and load_sharded_state_dict() together, deciding
    so from the plans of its registered parameters (``register_block``): each
    rank's optimizer must see every column-split table (the collection
    registers one parameter per table on every rank). Else no collective.

    Args:
        params: Parameters or param groups.
        lr: Learning rate.
        eps: Added to the denominator.
        initial_accumulator_value: Every row's initial accumulator.
    """

    _ROW_STATE = ("sum",)

    def __init__(
        self, params: Iterable[Any], lr: float = 1e-2, eps: float = 1e-10, initial_accumulator_value: float = 0.0
    ) -> None:
        _check(lr=lr, eps=eps, initial_accumulator_value=initial_accumulator_value)
        super().__init__(params, {"lr": lr, "eps": eps, "initial_accumulator_value": initial_accumulator_value})

    def _new_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        if param.dim() < 1:
            raise ValueError("row-wise Adagrad needs parameters with rows (at least one dimension)")
        dtype = torch.promote_types(param.dtype, torch.float32)
        init = float(group["initial_accumulator_value"])
        return {"sum": torch.full((param.shape[0],), init, dtype=dtype, device=param.device)}

    def _joins_without_grad(self, param: torch.Tensor) -> bool:
        # Peers may have touched rows: the accumulator takes their sums without a gradient here.
        block = block_of(param)
        return block is not None and bool(block.column_peers())

    def _groups(self) -> list[tuple[Group, torch.device, Peered]]:
        """Groups with a column-split table, in parameter order (the same on every rank).

        With each: the device of its messages (its first such parameter's) and
        this rank's parameters with column peers in it.
        """
        out: list[tuple[Group, torch.device, Peered]] = []
        for pg in self.param_groups:
            for p in pg["params"]:
                block = block_of(p)
                if block is None or len(block.table.column_cuts) < 2:
                    continue
                if not any(g is block.group for g, _, _ in out):
                    out.append((block.group, p.device, []))
                if block.column_peers():
                    next(peered for g, _, peered in out if g is block.group).append((p, pg, block))
        return out

    def _apply(self, work: list[_Work]) -> None:
        # Sum of g² over this rank's columns of each touched row, in the accumulator's dtype.
        squares = {id(item): item.values.to(item.state["sum"].dtype).pow(2) for item in work}
        partials = {key: sq.flatten(1).sum(dim=1) if sq.dim() > 1 else sq for key, sq in squares.items()}
        by_param = {id(item.param): item for item in work}
        received: Received = {}
        for group, device, peered in self._groups():
            # Every peered parameter joins each step (_joins_without_grad), so each is in work.
            mine = [by_param[id(p)] for p, _, _ in peered]
            outgoing = [(b, item.rows, partials[id(item)]) for (_, _, b), item in zip(peered, mine, strict=True)]
            received.update(_exchange(group, device, peered, outgoing))
        for item in work:
            acc, block = item.state["sum"], item.block
            parts = [(item.rows, partials[id(item)])]
            if block is not None and block.block is not None and block.column_peers():
                # Every holder of the rows adds the same partials in column order: equal accumulators.
                got, empty = received.get(block.table.name, {}), (item.rows[:0], acc[:0])
                parts = [parts[0] if rank == block.block.rank else got.get(rank, empty) for rank in _holders(block)]
            rows = torch.cat([r for r, _ in parts])
            if not rows.numel():
                continue
            union, inverse = torch.unique(rows, sorted=True, return_inverse=True)
            total, start = acc.new_zeros(union.shape), 0
            for r, v in parts:
                total.index_add_(0, inverse[start : start + r.numel()], v.to(acc.dtype))
                start += r.numel()
            full_dim = block.table.embedding_dim if block is not None and not block.replicated else None
            full_dim = full_dim or math.prod(item.param.shape[1:])
            acc.index_copy_(0, union, acc.index_select(0, union).add_(total.div_(full_dim)))
            if item.rows.numel():
                self._update_weights(item)

    @staticmethod
    def _update_weights(item: _Work) -> None:
        p, rows, acc, group = item.param, item.rows, item.state["sum"], item.group
        std = acc.index_select(0, rows).sqrt_().add_(group["eps"]).reshape(-1, *([1] * (p.dim() - 1)))
        w = p.index_select(0, rows).to(acc.dtype).addcdiv_(item.values.to(acc.dtype), std, value=-group["lr"])
        p.index_copy_(0, rows, w.to(p.dtype))

    def load_sharded_state_dict(self, state_dict: dict[str, dict[str, Any]]) -> None:
        """As the base class's; then the first column block's ranks send the loaded accumulators to their peers."""
        super().load_sharded_state_dict(state_dict)
        # The checkpoint holds one accumulator per row, loaded by the first column block's ranks only.
        for group, device, peered in self._groups():
            accs = {b.table.name: self._state(p, pg)["sum"] for p, pg, b in peered}
            every = {b.table.name: torch.arange(p.shape[0], device=p.device) for p, _, b in peered}
            outgoing = [(b, every[b.table.name], accs[b.table.name]) for _, _, b in peered if b.holds_first_columns()]
            for name, by_rank in _exchange(group, device, peered, outgoing).items():
                for rows, values in by_rank.values():
                    accs[name].index_copy_(0, rows, values.to(accs[name].dtype))


def _holders(block: LocalBlock) -> list[int]:
    """Group ranks holding ``block``'s rows, one per column block, in column order (this rank included)."""
    assert block.block is not None
    return [b.rank for b in sorted(block.table.blocks, key=lambda b: b.cols) if b.rows == block.block.rows]


def _table_key(name: str) -> float:
    return float(zlib.crc32(name.encode()))


def _exchange(
    group: Group, device: torch.device, peered: Peered, outgoing: list[tuple[LocalBlock, torch.Tensor, torch.Tensor]]
) -> Received:
    """Send each ``(block, rows, values)`` to the block's column peers: one ``all_to_all`` over ``group``.

    A message is a ``[n, 2]`` float64 tensor of segments: a header ``(table
    key, count)``, then ``count`` rows ``(row, value)``.

    Args:
        group: The group, every rank of which calls this together.
        device: Where to build the messages.
        peered: This rank's parameters with column peers (what it may receive for).
        outgoing: What to send.

    Returns:
        ``{table name: {sender's group rank: (rows, values)}}``.

    Raises:
        RuntimeError: a peer sent rows this rank holds no block of (the ranks' plans differ).
    """
    by_key: dict[float, tuple[LocalBlock, int]] = {}
    for p, _, block in peered:
        clash = by_key.setdefault(_table_key(block.table.name), (block, p.shape[0]))[0]
        if clash is not block:
            raise RuntimeError(f"tables {block.table.name!r} and {clash.table.name!r} share an exchange key")
    messages: list[list[torch.Tensor]] = [[] for _ in range(group.size)]
    for block, rows, values in outgoing:
        header = torch.tensor([[_table_key(block.table.name), float(rows.numel())]], dtype=_WIRE, device=device)
        body = torch.stack([rows.to(device, _WIRE), values.to(device, _WIRE)], dim=1)
        for peer in block.column_peers():
            messages[peer] += [header, body]
    inputs = [torch.cat(m) if m else torch.empty((0, 2), dtype=_WIRE, device=device) for m in messages]
    out: Received = {}
    for sender, message in enumerate(group.all_to_all(inputs)):
        host, at = message.cpu(), 0  # headers are read on the host; messages hold touched rows only
        while at < host.shape[0]:
            found, count = by_key.get(float(host[at, 0])), int(host[at, 1])
            rows = host[at + 1 : at + 1 + count, 0].long()
            if found is None or sender not in found[0].column_peers():
                raise RuntimeError(
                    f"rank {sender} sent row sums for a table this rank holds no column block of beside it"
                )
            if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= found[1]):
                raise RuntimeError(f"rank {sender} sent rows outside this rank's block of {found[0].table.name!r}")
            out.setdefault(found[0].table.name, {})[sender] = (rows.to(device), message[at + 1 : at + 1 + count, 1])
            at += 1 + count
    return out
