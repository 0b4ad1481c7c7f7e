"""``shardwise._comm.buffers.peak_new_bytes``: what the code since ``reset_peak`` allocated, whatever earlier buffers do."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from shardwise._comm import buffers as _memory

pytestmark = pytest.mark.skipif(not _memory.huge_pages_enabled(), reason="no MADV_HUGEPAGE on this platform")

MIB = 1 << 20


def _free_on_another_thread(tensors: list[torch.Tensor]) -> None:
    """Drop the last reference to ``tensors`` on a thread of its own, as gloo's worker does with a work's buffers."""
    thread = threading.Thread(target=tensors.clear)
    thread.start()
    thread.join()


def test_an_earlier_buffer_freed_late_does_not_offset_new_ones() -> None:
    gc.collect()
    earlier = [_memory.empty((8 * MIB,), torch.uint8)]
    _memory.reset_peak()
    _free_on_another_thread(earlier)  # freed inside the window, on another thread
    new = _memory.empty((8 * MIB,), torch.uint8)
    # The old count ("peak live" minus "live at the start") said this window added nothing.
    assert _memory.peak_new_bytes() == 8 * MIB
    assert _memory.live_bytes() >= 8 * MIB
    del new


def test_peak_of_new_buffers_counts_those_in_use_at_once() -> None:
    gc.collect()
    kept = _memory.empty((6 * MIB,), torch.uint8)  # before the window: not counted
    _memory.reset_peak()
    a = _memory.zeros((4 * MIB,), torch.uint8)
    b = _memory.empty((10 * MIB,), torch.uint8)  # 10 MiB: held in a 10 MiB mapping (whole 2 MiB pages)
    del a
    c = _memory.empty((4 * MIB,), torch.uint8)
    del b, c
    assert _memory.peak_new_bytes() == 14 * MIB
    _memory.reset_peak()
    assert _memory.peak_new_bytes() == 0
    d = _memory.empty((3 * MIB, 2), torch.uint8)  # 6 MiB
    assert _memory.peak_new_bytes() == 6 * MIB
    del kept  # taken in an earlier window: freeing it leaves this window's count alone
    e = _memory.empty((2 * MIB,), torch.float32)  # 8 MiB
    assert _memory.peak_new_bytes() == 14 * MIB
    del d, e
