"""A gradient-only scaling step (for ``scale_grad_by_freq`` across ranks)."""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd import Function

__all__ = ["scale_grad"]


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
    return _ScaleGrad.apply(rows, scale)
