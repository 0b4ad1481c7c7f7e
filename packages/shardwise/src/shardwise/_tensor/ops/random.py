"""Random fills whose values depend on the seed and each element's global position only.

Given the same seed, the assembled tensor is the same whatever the world
size, the spec and the device of the shards (torch 2.13 gives each rank
its own stream, so the whole tensor changes with the layout).

How: each fill draws ONE base seed from the generator (torch's default
CPU generator unless one is given) — every rank draws exactly once,
whatever it holds, so the generators stay in step. The flattened global
index space is cut into fixed blocks of :data:`BLOCK_SIZE` elements; block
``b`` is sampled by torch on the CPU with its own ``torch.Generator``
seeded from ``(base seed, b)``. A rank samples only the blocks that meet
its shards and copies the part it needs, one block at a time, so memory
stays bounded by one block beyond the shard. A shard cut along a late
dimension (column-sharded) meets many blocks and samples more than it
keeps: it costs time, not memory. Values reach CUDA shards by copy, so
CPU and CUDA shards get the same numbers.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch

from shardwise._tensor.sharded_tensor import ShardedTensor

__all__ = ["BLOCK_SIZE", "block_seed", "draw_seed", "fill_box", "fill_normal", "fill_sharded", "fill_uniform"]

#: Elements per block of the global flat index space.
BLOCK_SIZE = 1 << 16

_MASK = (1 << 64) - 1

#: ``sample(n, generator) -> tensor``: ``n`` values on the CPU.
Sampler = Callable[[int, torch.Generator], torch.Tensor]
#: ``make(n, dtype, generator) -> tensor``.
Maker = Callable[[int, torch.dtype, torch.Generator], torch.Tensor]


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def block_seed(base: int, block: int) -> int:
    """The seed of block ``block`` of a fill with base seed ``base`` (a well-mixed 64-bit value)."""
    return _splitmix64((base & _MASK) ^ _splitmix64(block))


def draw_seed(generator: Optional[torch.Generator] = None) -> int:
    """One base seed from ``generator`` (default: torch's default CPU generator): exactly one draw."""
    if generator is None:
        return int(torch.randint(0, 2**63 - 1, (1,)).item())
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    return int(torch.randint(0, 2**63 - 1, (1,), generator=generator, device=generator.device).item())


def _ragged(begins: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Concatenation of ``arange(b, b + n)`` for each pair."""
    before = torch.cumsum(lengths, 0) - lengths
    return torch.repeat_interleave(begins - before, lengths) + torch.arange(int(lengths.sum()))


def fill_box(
    out: torch.Tensor,
    offsets: Sequence[int],
    global_size: Sequence[int],
    base: int,
    sample: Sampler,
    block_size: Optional[int] = None,
) -> None:
    """Fill ``out``, the box at ``offsets`` of a tensor of ``global_size``, from the blocks of ``base``.

    The values are those the box would hold if the whole tensor were
    filled: element at flat global index ``i`` gets value ``i % block_size``
    of ``sample(len(block), Generator(block_seed(base, i // block_size)))``.

    Args:
        out: The box's tensor (any device, any strides); written in place.
        offsets: Where the box starts in the whole tensor.
        global_size: Size of the whole tensor.
        base: Base seed of the fill (:func:`draw_seed`).
        sample: Draws ``n`` values on the CPU with a generator.
        block_size: Elements per block (default: :data:`BLOCK_SIZE`, read at
            call time so tests can shrink it).
    """
    if out.numel() == 0:
        return
    block_size = BLOCK_SIZE if block_size is None else block_size
    size = [int(s) for s in global_size] or [1]
    offs = [int(o) for o in offsets] or [0]
    sizes = list(out.shape) or [1]
    # The box is a set of equal runs, contiguous in the flat index space:
    # dims after k (the last one the box does not span) are whole.
    k = max((d for d in range(len(size)) if sizes[d] != size[d]), default=0)
    inner = math.prod(size[k + 1 :])
    row, col, run = size[k] * inner, offs[k] * inner, sizes[k] * inner
    n_runs = math.prod(sizes[:k])
    total = math.prod(size)
    strides = [math.prod(size[d + 1 : k]) for d in range(k)]

    def starts(j0: int, j1: int) -> torch.Tensor:
        j = torch.arange(j0, j1)
        q = torch.zeros_like(j)
        for d in reversed(range(k)):
            q += (j % sizes[d] + offs[d]) * strides[d]
            j = j // sizes[d]
        return q * row + col

    dest = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype, device=out.device)
    flat = dest.view(-1)
    j, pos = 0, int(starts(0, 1)[0])
    while j < n_runs:
        block = pos // block_size
        lo = block * block_size
        hi = min(lo + block_size, total)
        generator = torch.Generator()
        generator.manual_seed(block_seed(base, block))
        values = sample(hi - lo, generator)
        # Run starts are increasing and at least `row` apart: this window
        # holds every run that meets [lo, hi).
        run_starts = starts(j, min(n_runs, j + (hi - lo) // row + 2))
        run_starts = run_starts[run_starts < hi]
        m = len(run_starts)
        seg_lo = run_starts.clamp(min=lo)
        lengths = (run_starts + run).clamp(max=hi) - seg_lo
        dst = torch.arange(j, j + m) * run + (seg_lo - run_starts)
        if m == 1:
            d, s, n = int(dst[0]), int(seg_lo[0]) - lo, int(lengths[0])
            flat[d : d + n].copy_(values[s : s + n])
        else:
            flat[_ragged(dst, lengths).to(flat.device)] = values[_ragged(seg_lo - lo, lengths)].to(flat.device)
        if int(run_starts[-1]) + run > hi:
            j, pos = j + m - 1, hi
        else:
            j += m
            if j < n_runs:
                pos = int(starts(j, j + 1)[0])
    if dest is not out:
        out.copy_(dest)


def fill_sharded(st: ShardedTensor, make: Maker, generator: Optional[torch.Generator] = None) -> ShardedTensor:
    """Fill every local shard of ``st`` in place from one base seed (under ``no_grad``).

    ``make`` is first tried on one element, so arguments torch rejects
    (bounds, dtypes) raise on every rank before any generator is touched.

    Args:
        st: The tensor to fill.
        make: ``make(n, dtype, generator)``: ``n`` values on the CPU.
        generator: Where the base seed comes from (default: torch's
            default CPU generator, seeded by ``torch.manual_seed``).

    Returns:
        ``st``.
    """
    dtype = st.metadata().tensor_properties.dtype
    make(1, dtype, torch.Generator())
    base = draw_seed(generator)
    size = st.size()
    with torch.no_grad():
        for shard in st.local_shards():
            fill_box(shard.tensor, shard.metadata.shard_offsets, size, base, lambda n, g: make(n, dtype, g))
    return st


def fill_uniform(
    st: ShardedTensor, low: float = 0.0, high: float = 1.0, generator: Optional[torch.Generator] = None
) -> ShardedTensor:
    """Fill ``st`` with uniform numbers on ``[low, high)`` (torch's ``uniform_`` per block).

    Args:
        st: The tensor to fill in place.
        low: Lower bound.
        high: Upper bound.
        generator: Source of the base seed (default: torch's default generator).

    Returns:
        ``st``.

    Raises:
        RuntimeError: ``low > high``, or bounds out of range for the dtype.
        NotImplementedError: the dtype has no uniform distribution (integers).
    """
    return fill_sharded(st, lambda n, dtype, g: torch.empty(n, dtype=dtype).uniform_(low, high, generator=g), generator)


def fill_normal(
    st: ShardedTensor, mean: float = 0.0, std: float = 1.0, generator: Optional[torch.Generator] = None
) -> ShardedTensor:
    """Fill ``st`` with normal numbers of ``mean`` and ``std`` (torch's ``normal_`` per block).

    Args:
        st: The tensor to fill in place.
        mean: Mean.
        std: Standard deviation (>= 0).
        generator: Source of the base seed (default: torch's default generator).

    Returns:
        ``st``.

    Raises:
        RuntimeError: ``std < 0``.
        NotImplementedError: the dtype has no normal distribution (integers).
    """
    return fill_sharded(st, lambda n, dtype, g: torch.empty(n, dtype=dtype).normal_(mean, std, generator=g), generator)
