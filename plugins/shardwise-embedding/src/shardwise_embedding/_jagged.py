"""Jagged multi-feature input and keyed pooled output, under TorchRec's names.

A :class:`KeyedJaggedTensor` holds, for a batch of ``stride`` samples and
several features (its keys), one bag of ids per (feature, sample): all ids in
one ``values`` tensor, the bag sizes in ``lengths`` in **key-major** order
(every sample of the first key, then every sample of the second ...), and
optional per-id ``weights``. It is what TorchRec users pass to an
``EmbeddingBagCollection``, rebuilt here without TorchRec (whose CPU kernels
need fbgemm).

The pooled result is a :class:`~shardwise_embedding.KeyedTensor`.
"""

from __future__ import annotations

from typing import Iterator, Optional, Sequence, Union

import torch

__all__ = ["JaggedTensor", "KeyedJaggedTensor"]


#: dtype <-> code in :meth:`KeyedJaggedTensor.pack`'s header.
_DTYPE_CODES = {
    torch.int64: 1,
    torch.int32: 2,
    torch.float32: 3,
    torch.float64: 4,
    torch.float16: 5,
    torch.bfloat16: 6,
}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}
_PACK_HEADER = 5


def _as_1d(name: str, t: torch.Tensor, *, integer: bool) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if integer and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        raise TypeError(f"{name} must hold integers (int32 or int64), got {t.dtype}")
    return t


def _version_of(t: Optional[torch.Tensor]) -> int:
    """``t``'s in-place version counter; -1 for no tensor or one that keeps none (an inference tensor)."""
    if t is None or t.is_inference():
        return -1
    return t._version


def _offsets_of(lengths: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, 0, out=out[1:])
    return out


class JaggedTensor:
    """One feature's bags: ``values`` split by ``lengths`` (one length per sample).

    Args:
        values: The ids (or values) of every bag, end to end.
        lengths: The size of each bag.
        weights: Optional per-value weights, as long as ``values``.
    """

    def __init__(self, values: torch.Tensor, lengths: torch.Tensor, weights: Optional[torch.Tensor] = None) -> None:
        self._values = values
        self._lengths = lengths
        self._weights = weights

    def values(self) -> torch.Tensor:
        """Every bag's values, end to end."""
        return self._values

    def lengths(self) -> torch.Tensor:
        """The size of each bag."""
        return self._lengths

    def offsets(self) -> torch.Tensor:
        """Where each bag starts in :meth:`values`, plus the end (``len(lengths) + 1`` entries)."""
        return _offsets_of(self._lengths)

    def weights_or_none(self) -> Optional[torch.Tensor]:
        """The per-value weights, or None."""
        return self._weights

    def to_dense(self) -> list[torch.Tensor]:
        """One tensor per bag."""
        return list(torch.split(self._values, self._lengths.tolist()))

    def __repr__(self) -> str:
        return f"JaggedTensor(values={self._values}, lengths={self._lengths}, weights={self._weights})"


class KeyedJaggedTensor:
    """Bags of ids for several features over one batch, as TorchRec lays them out.

    ``lengths`` has ``len(keys) * stride`` entries, key-major: entry
    ``k * stride + b`` is the size of sample ``b``'s bag for key ``k``, and
    ``values`` holds the bags in that order.

    Build one with :meth:`from_lengths_sync` or :meth:`from_offsets_sync`;
    both check the structure (:meth:`validate`). Ids are checked against the
    tables where they are looked up.

    Example:
        >>> # 2 samples; feature "a": [1, 2] and [] ; feature "b": [7] and [8, 9]
        >>> kjt = KeyedJaggedTensor.from_lengths_sync(
        ...     keys=["a", "b"], values=torch.tensor([1, 2, 7, 8, 9]), lengths=torch.tensor([2, 0, 1, 2]))
        >>> kjt["b"].to_dense()
        [tensor([7]), tensor([8, 9])]
    """

    def __init__(
        self,
        keys: Sequence[str],
        values: torch.Tensor,
        weights: Optional[torch.Tensor] = None,
        lengths: Optional[torch.Tensor] = None,
        offsets: Optional[torch.Tensor] = None,
        stride: Optional[int] = None,
    ) -> None:
        if lengths is None and offsets is None:
            raise ValueError("KeyedJaggedTensor needs lengths or offsets")
        if lengths is None:
            assert offsets is not None
            offsets = _as_1d("offsets", offsets, integer=True)
            if offsets.numel() < 1:
                raise ValueError("offsets must have at least one entry (the start, 0)")
            lengths = offsets[1:] - offsets[:-1]
            if lengths.numel() and int(lengths.min()) < 0:
                raise ValueError("offsets must not decrease: each bag starts where the one before it ends or later")
        self._keys = [str(k) for k in keys]
        self._values = _as_1d("values", values, integer=True)
        self._lengths = _as_1d("lengths", lengths, integer=True).to(torch.int64)
        self._weights = None if weights is None else _as_1d("weights", weights, integer=False)
        if self._weights is not None and not self._weights.is_floating_point():
            raise TypeError(f"weights must be floating point, got {self._weights.dtype}")
        self._stride = self._infer_stride(stride)
        self._offsets: Optional[torch.Tensor] = None
        self._length_per_key: Optional[list[int]] = None

    def _infer_stride(self, stride: Optional[int]) -> int:
        n_keys = len(self._keys)
        if stride is not None:
            if isinstance(stride, bool) or not isinstance(stride, int) or stride < 0:
                raise ValueError(f"stride (the batch size) must be an int >= 0, got {stride!r}")
            return stride
        if n_keys == 0:
            return 0
        if self._lengths.numel() % n_keys:
            raise ValueError(
                f"lengths has {self._lengths.numel()} entries, not a multiple of the {n_keys} keys "
                f"{self._keys}: it needs one length per key and sample (key-major)"
            )
        return self._lengths.numel() // n_keys

    # -- construction -----------------------------------------------------------------------

    @classmethod
    def from_lengths_sync(
        cls,
        keys: Sequence[str],
        values: torch.Tensor,
        lengths: torch.Tensor,
        weights: Optional[torch.Tensor] = None,
        stride: Optional[int] = None,
    ) -> KeyedJaggedTensor:
        """Build from bag sizes (key-major, one per key and sample), checked.

        Args:
            keys: Feature names, in the order of ``lengths``.
            values: Every bag's ids, end to end.
            lengths: ``len(keys) * stride`` bag sizes.
            weights: Optional per-id weights (as long as ``values``).
            stride: The batch size (default: ``len(lengths) // len(keys)``).

        Raises:
            ValueError: the lengths are negative, not one per key and
                sample, or do not add up to the number of values; weights
                of another length; a key twice.
            TypeError: ids or lengths that are not integers.
        """
        kjt = cls(keys, values, weights=weights, lengths=lengths, stride=stride)
        kjt.validate()
        return kjt

    @classmethod
    def from_offsets_sync(
        cls,
        keys: Sequence[str],
        values: torch.Tensor,
        offsets: torch.Tensor,
        weights: Optional[torch.Tensor] = None,
        stride: Optional[int] = None,
    ) -> KeyedJaggedTensor:
        """Build from bag starts (``len(keys) * stride + 1`` offsets, the last the end), checked.

        Raises:
            ValueError: offsets that do not start at 0, decrease, or do not
                end at the number of values; and as :meth:`from_lengths_sync`.
        """
        offsets = _as_1d("offsets", offsets, integer=True)
        if offsets.numel() and int(offsets[0]) != 0:
            raise ValueError(f"offsets must start at 0, got {int(offsets[0])}")
        kjt = cls(keys, values, weights=weights, offsets=offsets, stride=stride)
        kjt.validate()
        return kjt

    @classmethod
    def empty(cls, keys: Sequence[str] = (), stride: int = 0) -> KeyedJaggedTensor:
        """A batch of ``stride`` samples with every bag empty."""
        lengths = torch.zeros(len(keys) * stride, dtype=torch.int64)
        return cls(keys, torch.empty(0, dtype=torch.int64), lengths=lengths, stride=stride)

    @classmethod
    def concat(cls, kjts: Sequence[KeyedJaggedTensor]) -> KeyedJaggedTensor:
        """Join KeyedJaggedTensors of one batch (same stride) and different keys into one."""
        if not kjts:
            return cls.empty()
        strides = {k.stride() for k in kjts}
        if len(strides) > 1:
            raise ValueError(f"concat needs one batch size, got strides {sorted(strides)}")
        weighted = {k.weights_or_none() is not None for k in kjts}
        if len(weighted) > 1:
            raise ValueError("concat needs every KeyedJaggedTensor weighted, or none")
        keys = [key for k in kjts for key in k.keys()]
        weights = torch.cat([k.weights() for k in kjts]) if weighted == {True} else None
        out = cls(
            keys,
            torch.cat([k.values() for k in kjts]),
            weights=weights,
            lengths=torch.cat([k.lengths() for k in kjts]),
            stride=strides.pop(),
        )
        out.validate()
        return out

    def validate(self) -> None:
        """Check the structure: raises ValueError naming what is wrong.

        Lengths are non-negative, one per key and sample, and add up to the
        number of values; weights (if any) are one per value; keys are distinct.
        """
        if len(set(self._keys)) != len(self._keys):
            dup = sorted({k for k in self._keys if self._keys.count(k) > 1})
            raise ValueError(f"KeyedJaggedTensor keys must be distinct, got {dup} more than once")
        expected = len(self._keys) * self._stride
        if self._lengths.numel() != expected:
            raise ValueError(
                f"lengths has {self._lengths.numel()} entries; {len(self._keys)} keys x stride {self._stride} "
                f"needs {expected} (key-major: every sample of the first key, then the next key)"
            )
        if self._lengths.numel() and int(self._lengths.min()) < 0:
            raise ValueError(f"lengths must be >= 0, got {int(self._lengths.min())}")
        total = int(self._lengths.sum()) if self._lengths.numel() else 0
        if total != self._values.numel():
            raise ValueError(
                f"lengths add up to {total} but there are {self._values.numel()} values: "
                "each value belongs to exactly one bag"
            )
        if self._weights is not None and self._weights.numel() != self._values.numel():
            raise ValueError(f"weights has {self._weights.numel()} entries for {self._values.numel()} values")

    def _contents_version(self) -> tuple[int, ...]:
        """Version counters of the ids, lengths and weights: any in-place change to one moves its counter.

        A prefetched batch is compared against this when it is forwarded
        (:meth:`ShardedEmbeddingBagCollection.prefetch`). Tensors made under
        ``torch.inference_mode`` keep no counter (-1).
        """
        return tuple(_version_of(t) for t in (self._values, self._lengths, self._weights))

    # -- TorchRec's accessors -----------------------------------------------------------------

    def keys(self) -> list[str]:
        """The feature names, in order."""
        return list(self._keys)

    def values(self) -> torch.Tensor:
        """Every bag's ids, end to end (key-major)."""
        return self._values

    def weights(self) -> torch.Tensor:
        """The per-id weights.

        Raises:
            ValueError: the tensor has no weights (see :meth:`weights_or_none`).
        """
        if self._weights is None:
            raise ValueError("this KeyedJaggedTensor has no weights")
        return self._weights

    def weights_or_none(self) -> Optional[torch.Tensor]:
        """The per-id weights, or None."""
        return self._weights

    def lengths(self) -> torch.Tensor:
        """Bag sizes, ``len(keys) * stride`` of them, key-major (int64)."""
        return self._lengths

    def offsets(self) -> torch.Tensor:
        """Bag starts in :meth:`values`, plus the end (int64)."""
        if self._offsets is None:
            self._offsets = _offsets_of(self._lengths)
        return self._offsets

    def stride(self) -> int:
        """The batch size: samples per key."""
        return self._stride

    def length_per_key(self) -> list[int]:
        """How many ids each key has over the batch."""
        if self._length_per_key is None:
            if self._stride == 0 or not self._keys:
                self._length_per_key = [0] * len(self._keys)
            else:
                self._length_per_key = self._lengths.view(len(self._keys), self._stride).sum(1).tolist()
        return list(self._length_per_key)

    def offset_per_key(self) -> list[int]:
        """Where each key's ids start in :meth:`values`, plus the end."""
        out = [0]
        for n in self.length_per_key():
            out.append(out[-1] + n)
        return out

    def __getitem__(self, key: str) -> JaggedTensor:
        """One key's bags."""
        try:
            k = self._keys.index(key)
        except ValueError:
            raise KeyError(f"no key {key!r} in this KeyedJaggedTensor (keys: {self._keys})") from None
        start, stop = self.offset_per_key()[k : k + 2]
        lengths = self._lengths[k * self._stride : (k + 1) * self._stride]
        weights = None if self._weights is None else self._weights[start:stop]
        return JaggedTensor(self._values[start:stop], lengths, weights)

    def to_dict(self) -> dict[str, JaggedTensor]:
        """Every key's bags."""
        return {key: self[key] for key in self._keys}

    def split(self, segments: Sequence[int]) -> list[KeyedJaggedTensor]:
        """Cut the keys into consecutive groups of ``segments[i]`` keys, one KeyedJaggedTensor each.

        Raises:
            ValueError: the segments do not add up to the number of keys.
        """
        if sum(segments) != len(self._keys) or any(s < 0 for s in segments):
            raise ValueError(f"segments {list(segments)} must be >= 0 and add up to the {len(self._keys)} keys")
        offsets = self.offset_per_key()
        out, k = [], 0
        for n in segments:
            lo, hi = offsets[k], offsets[k + n]
            out.append(
                KeyedJaggedTensor(
                    self._keys[k : k + n],
                    self._values[lo:hi],
                    weights=None if self._weights is None else self._weights[lo:hi],
                    lengths=self._lengths[k * self._stride : (k + n) * self._stride],
                    stride=self._stride,
                )
            )
            k += n
        return out

    def permute(self, indices: Sequence[int]) -> KeyedJaggedTensor:
        """A KeyedJaggedTensor with keys ``[keys[i] for i in indices]`` (a key may be left out or repeated).

        Raises:
            IndexError: an index outside ``0 .. len(keys) - 1``.
        """
        bad = [i for i in indices if not 0 <= int(i) < len(self._keys)]
        if bad:
            raise IndexError(f"permute indices {bad} are not in 0..{len(self._keys) - 1} (the {len(self._keys)} keys)")
        return self._select([int(i) for i in indices])

    def select(self, keys: Sequence[str]) -> KeyedJaggedTensor:
        """A KeyedJaggedTensor of only ``keys``, in that order.

        Raises:
            KeyError: a key that is not here.
        """
        missing = [k for k in keys if k not in self._keys]
        if missing:
            raise KeyError(f"no keys {missing} in this KeyedJaggedTensor (keys: {self._keys})")
        return self._select([self._keys.index(k) for k in keys])

    def _select(self, idx: list[int]) -> KeyedJaggedTensor:
        offsets = self.offset_per_key()
        pieces = [slice(offsets[i], offsets[i + 1]) for i in idx]
        values = torch.cat([self._values[p] for p in pieces]) if pieces else self._values[:0]
        weights = None
        if self._weights is not None:
            weights = torch.cat([self._weights[p] for p in pieces]) if pieces else self._weights[:0]
        lengths = [self._lengths[i * self._stride : (i + 1) * self._stride] for i in idx]
        return KeyedJaggedTensor(
            [self._keys[i] for i in idx],
            values,
            weights=weights,
            lengths=torch.cat(lengths) if lengths else self._lengths[:0],
            stride=self._stride,
        )

    def pack(self) -> torch.Tensor:
        """Everything but the keys in one int64 tensor, to move or send in one piece.

        Layout: ``[stride, len(lengths), len(values), values dtype, weights
        dtype]``, then the lengths, the ids, and the weights as float64 bits
        (exact for every float dtype). :meth:`unpack` reads it back.
        """
        w_code = 0 if self._weights is None else _DTYPE_CODES[self._weights.dtype]
        header = torch.tensor(
            [self._stride, self._lengths.numel(), self._values.numel(), _DTYPE_CODES[self._values.dtype], w_code],
            dtype=torch.int64,
            device=self._values.device,
        )
        parts = [header, self._lengths, self._values.to(torch.int64)]
        if self._weights is not None:
            parts.append(self._weights.to(torch.float64).view(torch.int64))
        return torch.cat(parts)

    @classmethod
    def unpack(cls, keys: Sequence[str], packed: torch.Tensor) -> KeyedJaggedTensor:
        """The KeyedJaggedTensor :meth:`pack` made (its dtypes restored), with ``keys``; views into ``packed``.

        Raises:
            ValueError: ``packed`` is not what :meth:`pack` makes.
        """
        if packed.dtype != torch.int64 or packed.dim() != 1 or packed.numel() < _PACK_HEADER:
            raise ValueError("unpack takes the 1-D int64 tensor KeyedJaggedTensor.pack() makes")
        stride, n_len, n_val, v_code, w_code = packed[:_PACK_HEADER].tolist()
        weighted = w_code != 0
        if packed.numel() != _PACK_HEADER + n_len + n_val * (2 if weighted else 1) or v_code not in _CODE_DTYPES:
            raise ValueError("the packed tensor's sizes do not match its header: it was not made by pack()")
        pos = _PACK_HEADER
        lengths = packed[pos : pos + n_len]
        values = packed[pos + n_len : pos + n_len + n_val].to(_CODE_DTYPES[v_code])
        weights = None
        if weighted:
            bits = packed[pos + n_len + n_val :]
            weights = bits.view(torch.float64).to(_CODE_DTYPES[w_code])
        return cls(keys, values, weights=weights, lengths=lengths, stride=stride)

    def to(self, device: Union[str, torch.device], non_blocking: bool = False) -> KeyedJaggedTensor:
        """The same bags on ``device``, moved as one tensor (one copy, not one per part)."""
        if torch.device(device) == self._values.device:
            return self
        return KeyedJaggedTensor.unpack(self._keys, self.pack().to(device, non_blocking=non_blocking))

    @property
    def device(self) -> torch.device:
        """Where the ids are."""
        return self._values.device

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __repr__(self) -> str:
        return (
            f"KeyedJaggedTensor(keys={self._keys}, stride={self._stride}, values={self._values}, "
            f"lengths={self._lengths}, weights={self._weights})"
        )
