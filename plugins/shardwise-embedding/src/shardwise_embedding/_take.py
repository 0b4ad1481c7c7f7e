"""Row gathers whose results and gradients live on huge pages.

``F.embedding`` computes the same thing, but its result and its weight
gradient come fresh from torch's allocator, which faults them in 4 KiB at
a time; for tables and batches of tens of MiB that costs several times
the copy itself (see ``shardwise._memory``). These functions write into
``shardwise._memory`` buffers instead and, in backward, add the rows'
gradients into a zero-filled one with ``index_add_`` (cheaper here than
``embedding_dense_backward``'s sort).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.autograd import Function

from shardwise import _memory

__all__ = ["place_columns", "take_rows"]


class _TakeRows(Function):
    @staticmethod
    def forward(ctx: Any, table: torch.Tensor, index: torch.Tensor, padding_idx: Optional[int]) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.rows, ctx.padding_idx = table.shape[0], padding_idx
        out = _memory.empty((index.numel(), table.shape[1]), table.dtype, table.device)
        return torch.index_select(table, 0, index, out=out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], None, None]:
        (index,) = ctx.saved_tensors
        if not grad.is_contiguous():
            # index_add_ reads a broadcast gradient (as from out.sum()) several times slower than a dense one.
            grad = _memory.empty_like(grad).copy_(grad)
        table_grad = _memory.zeros((ctx.rows, grad.shape[1]), grad.dtype, grad.device)
        table_grad.index_add_(0, index, grad)
        if ctx.padding_idx is not None:
            table_grad[ctx.padding_idx] = 0  # the dense op gives the padding row no gradient
        return table_grad, None, None


def take_rows(
    table: torch.Tensor,
    index: torch.Tensor,
    padding_idx: Optional[int] = None,
    max_norm: Optional[float] = None,
    norm_type: float = 2.0,
) -> torch.Tensor:
    """``F.embedding(index, table, padding_idx, max_norm, norm_type)`` for a 1-D ``index``.

    Returns:
        ``[index.numel(), table.shape[1]]`` rows; autograd into ``table``.
    """
    index = index.reshape(-1)
    if max_norm is not None:
        # As the dense op: rows about to be read are renormed in place, outside autograd.
        with torch.no_grad():
            torch.embedding_renorm_(table.detach(), index.contiguous(), max_norm, norm_type)
    if not (table.requires_grad and torch.is_grad_enabled()):
        out = _memory.empty((index.numel(), table.shape[1]), table.dtype, table.device)
        return torch.index_select(table, 0, index, out=out)
    result: torch.Tensor = _TakeRows.apply(table, index, padding_idx)
    return result


Block = tuple[int, int, int]  # (start in the flat buffer, first column, number of columns)


def _place(flat: torch.Tensor, blocks: list[Block], rows: int, cols: int) -> torch.Tensor:
    out = _memory.empty((rows, cols), flat.dtype, flat.device)
    for start, first, width in blocks:
        out[:, first : first + width] = flat[start : start + rows * width].view(rows, width)
    return out


class _PlaceColumns(Function):
    @staticmethod
    def forward(ctx: Any, flat: torch.Tensor, blocks: list[Block], rows: int, cols: int) -> torch.Tensor:
        ctx.blocks, ctx.rows, ctx.numel = blocks, rows, flat.numel()
        return _place(flat, blocks, rows, cols)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        # One flat gradient written block by block (slicing views in autograd would zero-fill a buffer per block).
        flat_grad = _memory.empty((ctx.numel,), grad.dtype, grad.device)
        for start, first, width in ctx.blocks:
            flat_grad[start : start + ctx.rows * width].view(ctx.rows, width).copy_(grad[:, first : first + width])
        return flat_grad, None, None, None


def place_columns(flat: torch.Tensor, blocks: list[Block], rows: int, cols: int) -> torch.Tensor:
    """Lay ``[rows, width]`` blocks stored one after another in ``flat`` side by side as ``[rows, cols]``.

    Args:
        flat: 1-D buffer holding every block, each row-major.
        blocks: ``(start, first column, width)`` of each block; together
            they cover ``flat`` and the ``cols`` columns exactly once.
        rows: Rows of every block.
        cols: Columns of the result.

    Returns:
        A new ``[rows, cols]`` tensor; autograd into ``flat``.
    """
    if flat.requires_grad and torch.is_grad_enabled():
        result: torch.Tensor = _PlaceColumns.apply(flat, blocks, rows, cols)
        return result
    return _place(flat, blocks, rows, cols)
