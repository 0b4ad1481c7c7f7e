"""Autograd steps of the sharded embeddings.

A gradient-only scaling step (for ``scale_grad_by_freq`` across ranks), and
the sum over ranks of a collection's replicated tables' gradients.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from torch.autograd import Function

if TYPE_CHECKING:
    from shardwise import Group

__all__ = ["SumOverRanks", "pool_by_frequency", "scale_grad"]


class _ScaleGrad(Function):
    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(scale)
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (scale,) = ctx.saved_tensors
        return grad * scale.unsqueeze(1), None


def scale_grad(rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``rows`` unchanged, whose gradient is multiplied row by row by ``scale``."""
    scaled: torch.Tensor = _ScaleGrad.apply(rows, scale)
    return scaled


def pool_by_frequency(
    ids: torch.Tensor,
    table: torch.Tensor,
    bag: torch.Tensor,
    bags: int,
    weights: Optional[torch.Tensor],
    padding_idx: Optional[int],
    max_norm: Optional[float],
    norm_type: float,
) -> torch.Tensor:
    """Sum the rows ``table[ids]`` into ``bags`` bags, each row's gradient divided by its id's count in ``ids``.

    ``F.embedding_bag(..., scale_grad_by_freq=True)`` in torch 2.13 divides
    the gradient by the wrong count on CPU when ids occur with different
    frequencies (ids ``[1, 1, 3]`` give row 3 a gradient of 0.5, not 1), so
    sums with that option are built from ``F.embedding`` rows instead.
    Padding entries add nothing (their rows are still looked up, so
    ``max_norm`` renorms them, as the dense op does).

    Args:
        ids: Row indices into ``table`` (all ids of the batch that reach it).
        table: The weight (shard).
        bag: Bag number of each id, in ``[0, bags)``.
        bags: Number of bags.
        weights: ``per_sample_weights`` for the ids, or None.
        padding_idx: Row of ``table`` that is padding, or None.
        max_norm, norm_type: As for ``F.embedding``.

    Returns:
        ``[bags, table.shape[1]]`` sums.
    """
    rows = torch.nn.functional.embedding(ids, table, padding_idx, max_norm, norm_type)
    if ids.numel():
        _, where, counts = torch.unique(ids, return_inverse=True, return_counts=True)
        rows = scale_grad(rows, 1.0 / counts[where].to(rows.dtype))
    if weights is not None:
        rows = rows * weights.unsqueeze(1)
    if padding_idx is not None:
        rows = rows * (ids != padding_idx).unsqueeze(1).to(rows.dtype)
    return rows.new_zeros((bags, table.shape[1])).index_add(0, bag, rows)


class SumOverRanks(Function):
    """Identity on the replicated tables; in backward, one all-reduce adds every rank's gradients of all of them."""

    @staticmethod
    def forward(ctx: Any, group: Group, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        ctx.shapes = [w.shape for w in weights]
        ctx.dtype_device = [(w.dtype, w.device) for w in weights]
        return tuple(w.view_as(w) for w in weights)

    @staticmethod
    def backward(ctx: Any, *grads: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], ...]:
        # A table no bag of this rank's batch reached still takes part: its zeros keep the sum's layout.
        filled = [
            torch.zeros(s, dtype=dt, device=dev) if g is None else g
            for g, s, (dt, dev) in zip(grads, ctx.shapes, ctx.dtype_device, strict=True)
        ]
        flat = torch.cat([g.reshape(-1) for g in filled])
        ctx.group.all_reduce(flat, "sum")
        out = []
        pieces = flat.split([g.numel() for g in filled])
        for piece, s, (dt, _) in zip(pieces, ctx.shapes, ctx.dtype_device, strict=True):
            out.append(piece.view(s).to(dt))  # tables of several dtypes were summed in the widest
        return (None, *out)
