"""Large CPU buffers backed by transparent huge pages.

Why: a fresh tensor of tens of MiB comes from ``mmap`` (glibc hands out
every block above 32 MiB that way, and gives it back on free), so each
call of a sharded op or collective faults its result in 4 KiB at a time.
Measured on a 2-core CPU machine, faulting a 51 MiB gradient costs
~18 ms while writing it costs ~5 ms; the faults, not the arithmetic,
dominated sharded embedding passes. Buffers from here are anonymous
mappings advised ``MADV_HUGEPAGE``, so the kernel maps them 2 MiB at a
time (when its THP mode is ``always`` or ``madvise``; under ``never``
they behave like ordinary memory).

The tensors are ordinary CPU tensors except that their storage cannot be
resized (``resize_`` to a larger size raises). ``SHARDWISE_HUGE_PAGES=0``
turns this off (every buffer then comes from torch's allocator).

When the last tensor viewing a mapping is freed, the mapping goes back to a
small cache instead of to the kernel, and the next buffer of that size
(rounded up to 2 MiB) reuses it: a fresh mapping is zero-filled by the
kernel on first touch, which costs about as much as a copy into it, and
loops (a reshard or a lookup every step) ask for the same sizes again and
again. The cache holds at most ``SHARDWISE_BUFFER_CACHE_MB`` MiB per process
(default 256, :data:`DEFAULT_CACHE_MB`; 0 turns it off); when a freed
mapping does not fit, the least recently freed ones are unmapped to make
room. Memory the program no longer uses therefore stays resident up to that
much, like torch's CUDA caching allocator: :func:`empty_cache`
(``shardwise.empty_cache()``) gives it all back; :func:`cached_bytes` says how much
this process holds (``shardwise info`` shows the limit in force).

Measured side by side on 2 ranks (2 CPU cores, gloo and MPI), the loops of
``make bench`` (a 64 MiB tensor resharded, scattered; sharded embedding
forward + backward over a 100 MiB table) cache up to ~250 MiB per rank and
run as fast with 256 MiB as with 1024 (within the noise of a busy machine),
while with the cache off they take 1.1 to 1.9 times as long.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import threading
import weakref
from typing import Optional, Sequence, Union

import torch

from shardwise._vocab.switches import switched_on

__all__ = [
    "DEFAULT_CACHE_MB",
    "HUGE_PAGE_MIN_BYTES",
    "cache_limit",
    "cached_bytes",
    "empty",
    "empty_cache",
    "empty_like",
    "huge_pages_enabled",
    "live_bytes",
    "on_huge_pages",
    "peak_live_bytes",
    "peak_new_bytes",
    "reset_peak",
    "zeros",
]

#: Smallest buffer worth a mapping of its own: below it glibc's heap reuses freed memory anyway.
HUGE_PAGE_MIN_BYTES = 4 << 20

Shape = Union[Sequence[int], torch.Size]


def huge_pages_enabled() -> bool:
    """Whether large CPU buffers get their own huge-page mapping (``SHARDWISE_HUGE_PAGES``, default on)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False  # not Linux, or a Python built without it
    return switched_on("SHARDWISE_HUGE_PAGES")


#: Mappings are sized in whole huge pages, so that buffers of nearby sizes share cache entries.
_GRAIN = 2 << 20

_lock = threading.Lock()
_free: list[tuple[int, mmap.mmap]] = []  # idle mappings and their sizes, least recently freed first
_cached = 0  # bytes in _free
_live = 0  # bytes of mappings some tensor still uses
_peak = 0  # highest _live since reset_peak()
# A collective backend may drop its last reference to a buffer on its own thread some time
# after the call returned (gloo's worker releases its work object late), so buffers from
# before reset_peak() can be freed inside the window and lower _live under its starting
# value. _window_live counts only the mappings taken since reset_peak() (tagged by _window),
# so its peak is what the code in the window added, whatever earlier buffers do meanwhile.
_spans: dict[int, int] = {}  # start address -> size of each mapping a tensor uses now
_window = 0  # incremented by reset_peak(); each mapping remembers the window it was taken in
_window_live = 0  # bytes of mappings taken in the current window and still in use
_window_peak = 0  # highest _window_live since reset_peak()


#: MiB of idle mappings the cache keeps unless ``SHARDWISE_BUFFER_CACHE_MB`` says otherwise: what the
#: benchmarks' loops (a 64 MiB tensor resharded, sharded embedding passes over a 100 MiB table on 2
#: ranks) reuse at full speed, and a quarter of the 1 GiB this cache once kept by default.
DEFAULT_CACHE_MB = 256


def cache_limit() -> int:
    """Bytes of idle mappings kept for reuse (``SHARDWISE_BUFFER_CACHE_MB``, default 256 MiB; 0: none).

    Raises:
        ValueError: ``SHARDWISE_BUFFER_CACHE_MB`` is not a number.
    """
    raw = os.environ.get("SHARDWISE_BUFFER_CACHE_MB", str(DEFAULT_CACHE_MB)).strip()
    try:
        return max(0, int(float(raw) * (1 << 20)))
    except ValueError:
        raise ValueError(
            f"SHARDWISE_BUFFER_CACHE_MB={raw!r} is not a number of MiB (e.g. {DEFAULT_CACHE_MB}, or 0 for none)"
        ) from None


def cached_bytes() -> int:
    """Bytes of idle mappings in the cache now."""
    return _cached


def empty_cache() -> int:
    """Give the large CPU buffers shardwise keeps for reuse back to the operating system.

    Like ``torch.cuda.empty_cache()``. shardwise keeps the large buffers
    (4 MiB and up) that its collectives, redistributions and sharded ops
    free, up to ``SHARDWISE_BUFFER_CACHE_MB`` MiB per process (default 256),
    so the next call of the same size skips the kernel's page faults; they
    stay resident until reused or released. Call this when a phase that
    moved large tensors is over and the memory is wanted elsewhere
    (it returns how many bytes it released). It is local to the calling
    process (no communication; call it on any or every rank), leaves
    buffers in use alone, and later calls fill the cache again.

    Returns:
        The bytes released (what :func:`cached_bytes` reported before; 0
        when nothing was cached).

    Example::

        for step in range(steps):
            st = st.reshard(spec_a if step % 2 else spec_b)
        freed = shardwise.empty_cache()  # the phase is over: release its buffers
    """
    global _cached
    with _lock:
        regions = [region for _, region in _free]
        released = _cached
        _free.clear()
        _cached = 0
    _unmap(regions)
    return released


def _unmap(regions: list[mmap.mmap]) -> None:
    """Unmap idle mappings (called without the lock held)."""
    for region in regions:
        try:
            region.close()
        except BufferError:
            # Still exported (its last tensor is being freed on another thread right now): it is unmapped
            # when that export goes, as the cache held the last reference.
            pass


def on_huge_pages(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s memory lies in one of this cache's huge-page mappings (in use now).

    Another process copies from or into such memory about twice as fast as
    from 4 KiB pages (the kernel pins the pages of a cross-memory copy one by
    one); :mod:`shardwise._comm.box_moves` weighs copies by it.
    """
    if tensor.device.type != "cpu" or not tensor.numel():
        return False
    at = tensor.data_ptr()
    with _lock:
        return any(start <= at < start + size for start, size in _spans.items())


def live_bytes() -> int:
    """Bytes of mapped buffers in use now (by any tensor)."""
    return _live


def peak_live_bytes() -> int:
    """The highest :func:`live_bytes` since :func:`reset_peak`, buffers from before it included.

    Subtracting the live bytes at :func:`reset_peak` does not give what the
    code since then added: earlier buffers freed meanwhile (possibly late, by
    a backend's thread) lower it. Use :func:`peak_new_bytes` for that.
    """
    return _peak


def peak_new_bytes() -> int:
    """The most bytes of buffers taken since :func:`reset_peak` that were in use at once.

    What a piece of code allocated here at once: buffers taken before the
    window neither count nor, when freed during it, offset the new ones.
    """
    return _window_peak


def reset_peak() -> None:
    """Start a new window: :func:`peak_live_bytes` from the current live bytes, :func:`peak_new_bytes` from 0."""
    global _peak, _window, _window_live, _window_peak
    with _lock:
        _peak = _live
        _window += 1
        _window_live = 0
        _window_peak = 0


def _take(size: int) -> tuple[mmap.mmap, bool, int]:
    """A mapping of ``size`` bytes, whether it is fresh (zero-filled), and the window it is counted in.

    A cached mapping when there is one.
    """
    global _cached, _live, _peak, _window_live, _window_peak
    cache_limit()  # a bad setting raises here, in the caller, not later in a finalizer
    with _lock:
        # The most recently freed mapping of that size: the likeliest to be still in the CPU's caches.
        at = next((i for i in range(len(_free) - 1, -1, -1) if _free[i][0] == size), None)
        region = _free.pop(at)[1] if at is not None else None
        if region is not None:
            _cached -= size
        _live += size
        _peak = max(_peak, _live)
        _window_live += size
        _window_peak = max(_window_peak, _window_live)
        window = _window
    if region is not None:
        return region, False, window
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    return region, True, window


def _give_back(region: mmap.mmap, size: int, window: int, start: int) -> None:
    """Called when the last tensor on ``region`` (taken in ``window``) is freed: keep it for reuse, or unmap it.

    Runs on whichever thread drops the last reference (a backend's worker
    thread, too), hence the lock.
    """
    global _cached, _live, _window_live
    try:
        limit = cache_limit()
    except ValueError:
        limit = 0
    evicted: list[mmap.mmap] = []
    with _lock:
        _spans.pop(start, None)
        _live -= size
        if window == _window:
            _window_live -= size
        if size <= limit:
            # Make room by unmapping the least recently freed mappings: a loop keeps asking for the
            # sizes it freed last, while older sizes belong to work that is over.
            while _free and _cached + size > limit:
                old_size, old = _free.pop(0)
                _cached -= old_size
                evicted.append(old)
            _free.append((size, region))
            _cached += size
    _unmap(evicted)
    # A mapping that does not fit at all is unmapped when its last reference goes (closing it here
    # could fail: the buffer export it is being returned from may not be released yet).


def _mapped(shape: Shape, dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """A tensor on a (possibly reused) mapping, and whether its memory is known to be zero."""
    nbytes = _nbytes(shape, dtype)
    size = -(-nbytes // _GRAIN) * _GRAIN
    region, fresh, window = _take(size)
    # The tensor keeps ``holder`` (an export of the mapping) alive; when the last view
    # of it is freed, the finalizer hands the mapping back.
    holder = (ctypes.c_char * size).from_buffer(region)
    start = ctypes.addressof(holder)
    with _lock:
        _spans[start] = size
    weakref.finalize(holder, _give_back, region, size, window, start).atexit = False
    flat = torch.frombuffer(holder, dtype=torch.uint8)[:nbytes]
    return flat.view(dtype).view(tuple(shape)), fresh


def _nbytes(shape: Shape, dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _wants_mapping(shape: Shape, dtype: torch.dtype, device: Optional[torch.device]) -> bool:
    if device is not None and torch.device(device).type != "cpu":
        return False
    return _nbytes(shape, dtype) >= HUGE_PAGE_MIN_BYTES and huge_pages_enabled()


def empty(shape: Shape, dtype: torch.dtype, device: Optional[torch.device] = None) -> torch.Tensor:
    """An uninitialised contiguous tensor; large CPU ones on huge pages.

    Args:
        shape: Size of the result.
        dtype: Its dtype.
        device: Its device (None: CPU). Other devices use ``torch.empty``.

    Returns:
        A contiguous tensor (its contents are zero when it came from a mapping,
        but callers must not rely on that; use :func:`zeros`).
    """
    if _wants_mapping(shape, dtype, device):
        return _mapped(shape, dtype)[0]
    return torch.empty(tuple(shape), dtype=dtype, device=device)


def empty_like(tensor: torch.Tensor, shape: Optional[Shape] = None) -> torch.Tensor:
    """:func:`empty` with ``tensor``'s dtype and device (and its shape unless ``shape`` is given)."""
    return empty(tensor.shape if shape is None else shape, tensor.dtype, tensor.device)


def zeros(shape: Shape, dtype: torch.dtype, device: Optional[torch.device] = None) -> torch.Tensor:
    """A zero-filled contiguous tensor; large CPU ones on huge pages (the kernel zero-fills fresh ones)."""
    if _wants_mapping(shape, dtype, device):
        tensor, fresh = _mapped(shape, dtype)
        return tensor if fresh else tensor.zero_()
    return torch.zeros(tuple(shape), dtype=dtype, device=device)
