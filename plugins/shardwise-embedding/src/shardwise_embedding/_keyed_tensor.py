"""Pooled embeddings of several features side by side, under TorchRec's name."""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["KeyedTensor"]


class KeyedTensor:
    """Pooled embeddings of several features side by side: ``values()`` is ``[batch, sum of dims]``.

    Args:
        keys: The feature names, in column order.
        length_per_key: Each key's number of columns (its table's dim).
        values: The ``[batch, sum(length_per_key)]`` tensor.
    """

    def __init__(self, keys: Sequence[str], length_per_key: Sequence[int], values: torch.Tensor) -> None:
        self._keys = list(keys)
        self._length_per_key = [int(n) for n in length_per_key]
        if len(self._keys) != len(self._length_per_key):
            raise ValueError(f"{len(self._keys)} keys but {len(self._length_per_key)} lengths")
        if values.dim() != 2 or values.shape[1] != sum(self._length_per_key):
            raise ValueError(
                f"values must be [batch, {sum(self._length_per_key)}] (the keys' columns side by side), "
                f"got {tuple(values.shape)}"
            )
        self._values = values

    def keys(self) -> list[str]:
        """The feature names, in column order."""
        return list(self._keys)

    def values(self) -> torch.Tensor:
        """``[batch, sum of dims]``: each key's pooled vectors in its columns."""
        return self._values

    def length_per_key(self) -> list[int]:
        """Each key's number of columns."""
        return list(self._length_per_key)

    def offset_per_key(self) -> list[int]:
        """Where each key's columns start, plus the end."""
        out = [0]
        for n in self._length_per_key:
            out.append(out[-1] + n)
        return out

    def key_dim(self) -> int:
        """The dim the keys are laid out along (1)."""
        return 1

    def __getitem__(self, key: str) -> torch.Tensor:
        """One key's ``[batch, dim]`` pooled vectors (a view)."""
        try:
            k = self._keys.index(key)
        except ValueError:
            raise KeyError(f"no key {key!r} in this KeyedTensor (keys: {self._keys})") from None
        lo, hi = self.offset_per_key()[k : k + 2]
        return self._values[:, lo:hi]

    def to_dict(self) -> dict[str, torch.Tensor]:
        """Every key's ``[batch, dim]`` pooled vectors (views)."""
        return {key: self[key] for key in self._keys}

    def __repr__(self) -> str:
        return f"KeyedTensor(keys={self._keys}, length_per_key={self._length_per_key}, values={self._values})"
