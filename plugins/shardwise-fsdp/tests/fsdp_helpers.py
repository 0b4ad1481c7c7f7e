"""The small model the FSDP tests wrap, and one training step that moves it away from its init."""

from __future__ import annotations

import torch


def small_model(seed: int) -> torch.nn.Module:
    """Linear(5, 7) -> ReLU -> Linear(7, 3), the same on every rank for a seed (7 and 3 rows: uneven chunks)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))


def one_step(model: torch.nn.Module) -> torch.nn.Module:
    """One SGD step on a batch every rank shares, so the values are not the init; returns ``model``."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.linspace(-1, 1, 20).reshape(4, 5)).pow(2).sum().backward()
    opt.step()
    return model
