"""A gradient-only scaling step (for ``scale_grad_by_freq`` across ranks)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.autograd import Function

__all__ = ["pool_by_frequency", "scale_grad"]


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
